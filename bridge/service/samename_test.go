package service

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/delaybridge/delaybridge/config"
)

// A delay topic and the delay stream may not share a name in one config
// (task ids are scoped to their source by name), but they may across a
// restart: the NATS stream "delay" of one run, the Kafka topic "delay" of
// the next (or the other way round). The tasks the first left pending and
// the messages of the second then share a scope, and a replace or cancel
// must be ordered against them by broker time, as between two partitions:
// before, a NATS stream sequence and a Kafka offset (both "partition 0")
// were compared as offsets of one log, so the Kafka replace below (offset
// 0, below the stream sequence of its task) was dropped as older, and
// never delivered, and the cancel ignored.
func TestSourceNameMovesToKafka(t *testing.T) {
	e := newEnv(t, "")
	e.mutate = func(c *config.Config) { c.NATS.Stream, c.Kafka = "delay", nil }
	svc, stop := e.start()
	for i := range 3 {
		e.publishNATS("delay.a", []byte("now"+strconv.Itoa(i)), "delay-after", "0s", "delay-target", "orders.a")
	}
	e.publishNATS("delay.a", []byte("x-nats"), "delay-after", "1h", "delay-target", "orders.a", "delay-id", "x")
	e.publishNATS("delay.a", []byte("c-nats"), "delay-after", "1h", "delay-target", "orders.a", "delay-id", "c")
	e.publishNATS("delay.a", []byte("y-nats"), "delay-after", "1h", "delay-target", "orders.a", "delay-id", "y")
	e.advanceUntil("3 delivered", func(ds []delivery) bool { return len(byValue(ds, "orders.a")) == 3 })
	waitStored(t, svc, 3, "delay", "x", "c", "y")
	stop()
	js, err := jetstream.New(e.nc)
	if err != nil {
		t.Fatal(err)
	}
	if err := js.DeleteStream(context.Background(), "delay"); err != nil {
		t.Fatal(err)
	}

	e.mutate = nil // Kafka topic "delay", NATS stream "DELAY"
	e.clk.Advance(time.Minute)
	svc, stop = e.start()
	e.publishKafka(0, time.Time{}, []byte("x"), []byte("x-kafka"), "delay-after", "30m", "delay-target", "nats:orders.a")
	e.publishKafka(0, time.Time{}, []byte("c"), nil)
	// Published (broker time) before the stream's y: older, it loses.
	e.publishKafka(0, e.clk.Now().Add(-2*time.Hour), []byte("y"), []byte("y-kafka-older"), "delay-after", "150m", "delay-target", "nats:orders.a")
	eventually(t, "the Kafka messages stored", func() bool { return e.committedOffset(0) >= 3 })
	e.advance(svc, time.Hour+time.Minute, time.Minute)
	got := e.advanceUntil("x-kafka and y-nats", func(ds []delivery) bool {
		return len(byValue(ds, "orders.a")["x-kafka"]) == 1 && len(byValue(ds, "orders.a")["y-nats"]) == 1
	})
	stop()
	for v, want := range map[string]int{"x-kafka": 1, "x-nats": 0, "c-nats": 0, "y-nats": 1, "y-kafka-older": 0} {
		if n := len(byValue(got, "orders.a")[v]); n != want {
			t.Errorf("%s delivered %d times, want %d", v, n, want)
		}
	}
}

// The other way round: the Kafka topic "delay" of one run, the NATS
// stream "delay" of the next, whose sequences start at 1, below the
// offsets of the topic's pending tasks.
func TestSourceNameMovesToNATS(t *testing.T) {
	e := newEnv(t, "")
	svc, stop := e.start()
	for i := range 5 {
		e.publishKafka(0, time.Time{}, []byte("now"+strconv.Itoa(i)), []byte("now"+strconv.Itoa(i)), "delay-after", "0s", "delay-target", "nats:orders.a")
	}
	e.publishKafka(0, time.Time{}, []byte("x"), []byte("x-kafka"), "delay-after", "1h", "delay-target", "nats:orders.a")
	e.publishKafka(0, time.Time{}, []byte("c"), []byte("c-kafka"), "delay-after", "1h", "delay-target", "nats:orders.a")
	e.advanceUntil("5 delivered", func(ds []delivery) bool { return len(byValue(ds, "orders.a")) == 5 })
	waitStored(t, svc, 2, kafkaDelay, "x", "c")
	stop()
	js, err := jetstream.New(e.nc)
	if err != nil {
		t.Fatal(err)
	}
	if err := js.DeleteStream(context.Background(), "DELAY"); err != nil {
		t.Fatal(err)
	}

	e.mutate = func(c *config.Config) { c.NATS.Stream, c.Kafka = "delay", nil }
	e.clk.Advance(time.Minute)
	svc, stop = e.start()
	eventually(t, "ready", func() bool { return svc.Ready() == nil })
	e.publishNATS("delay.a", []byte("x-nats"), "delay-after", "30m", "delay-target", "orders.a", "delay-id", "x")
	e.publishNATS("delay.a", nil, "delay-cancel", "true", "delay-id", "c")
	e.advance(svc, time.Hour+time.Minute, time.Minute)
	got := e.advanceUntil("x-nats", func(ds []delivery) bool { return len(byValue(ds, "orders.a")["x-nats"]) == 1 })
	e.advance(svc, 5*time.Second, time.Second)
	got = append(got[:0:0], e.deliveries()...)
	stop()
	for v, want := range map[string]int{"x-nats": 1, "x-kafka": 0, "c-kafka": 0} {
		if n := len(byValue(got, "orders.a")[v]); n != want {
			t.Errorf("%s delivered %d times, want %d", v, n, want)
		}
	}
}
