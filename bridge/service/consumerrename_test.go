package service

import (
	"context"
	"strconv"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/config"
	"github.com/delaybridge/delaybridge/internal/testlog"
)

// nats.consumer renamed on a delay stream an operator made with interest
// retention: the server takes the new consumer (a work queue would refuse
// it, TestConsumerRenamedOnWorkQueue), and the old one, which no bridge
// reads any more, keeps every message stored (5 here, and growing with
// each one published) until the stream's limits, where a stream with
// discard new refuses the publishers. The start says so, naming the old
// consumer; on a limits stream, where it keeps nothing, only at Info.
func TestConsumerRenamedOnOtherStreamsLogged(t *testing.T) {
	for _, retention := range []jetstream.RetentionPolicy{jetstream.InterestPolicy, jetstream.LimitsPolicy} {
		t.Run(retention.String(), func(t *testing.T) {
			e := newEnv(t, "")
			js, err := jetstream.New(e.nc)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := js.CreateStream(context.Background(), jetstream.StreamConfig{Name: "DELAY", Subjects: []string{"delay.>"}, Retention: retention}); err != nil {
				t.Fatal(err)
			}
			svc, stop := e.start()
			eventually(t, "ready", func() bool { return svc.Ready() == nil }) // interest: nothing is kept before the consumer
			for i := range 3 {
				e.publishNATS("delay.a", []byte("a"+strconv.Itoa(i)), "delay-after", "0s", "delay-target", "orders.a")
			}
			e.advanceUntil("3 delivered", func(ds []delivery) bool { return len(byValue(ds, "orders.a")) == 3 })
			stop()

			e.mutate = func(c *config.Config) { c.NATS.Consumer = "bridge2" }
			core, logs := observer.New(zap.InfoLevel)
			o := Options{Logger: zap.New(zapcore.NewTee(core, testlog.New(t, zaptest.Level(testLogLevel())).Core()))}
			svc, cancel, done := e.runWith(o)
			eventually(t, "ready", func() bool { return svc.Ready() == nil })
			for i := range 5 {
				e.publishNATS("delay.a", []byte("b"+strconv.Itoa(i)), "delay-after", "0s", "delay-target", "orders.a")
			}
			e.advanceUntil("5 more delivered", func(ds []delivery) bool { return len(byValue(ds, "orders.a")) == 8 })
			cancel()
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			st, err := js.Stream(context.Background(), "DELAY")
			if err != nil {
				t.Fatal(err)
			}
			info, err := st.Info(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%s stream: %d messages kept, %d consumers", retention, info.State.Msgs, info.State.Consumers)
			level := zapcore.InfoLevel
			if retention == jetstream.InterestPolicy {
				level = zapcore.WarnLevel
			}
			// Looked for beside consuming, which Run waited for.
			found := logs.FilterMessageSnippet("consumers made by delaybridge").All()
			if len(found) != 1 || found[0].Level != level || !slicesEqual(found[0].ContextMap()["consumers"], []string{"bridge"}) {
				t.Fatalf("logged %+v, want one %s line naming the old consumer bridge", found, level)
			}
		})
	}
}

func slicesEqual(v any, want []string) bool {
	got, ok := v.([]any)
	if !ok {
		if s, ok := v.([]string); ok {
			got = make([]any, len(s))
			for i := range s {
				got[i] = s[i]
			}
		} else {
			return false
		}
	}
	if len(got) != len(want) {
		return false
	}
	for i := range want {
		if got[i] != want[i] {
			return false
		}
	}
	return true
}

// Two bridges with their own consumers on one limits stream (a second
// release pointed at the same stream): each takes in every message. The
// second one's start says that another client pulls from the first one's
// consumer.
func TestOtherBridgeOnTheStreamLogged(t *testing.T) {
	e := newEnv(t, "")
	js, err := jetstream.New(e.nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(context.Background(), jetstream.StreamConfig{Name: "DELAY", Subjects: []string{"delay.>"}}); err != nil {
		t.Fatal(err)
	}
	svc, _ := e.start()
	eventually(t, "ready", func() bool { return svc.Ready() == nil })
	e.publishNATS("delay.a", []byte("a"), "delay-after", "0s", "delay-target", "orders.a")
	e.advanceUntil("a delivered", func(ds []delivery) bool { return len(byValue(ds, "orders.a")) == 1 })

	e.dataDir = t.TempDir()
	e.mutate = func(c *config.Config) { c.NATS.Consumer, c.Kafka = "bridge2", nil }
	core, logs := observer.New(zap.WarnLevel)
	o := Options{Logger: zap.New(zapcore.NewTee(core, testlog.New(t, zaptest.Level(testLogLevel())).Core()))}
	svc2, _, _ := e.runWith(o)
	eventually(t, "the second bridge ready", func() bool { return svc2.Ready() == nil })
	// Looked for beside consuming.
	eventually(t, "the warning", func() bool { return logs.FilterMessageSnippet("another client pulls").Len() > 0 })
	found := logs.FilterMessageSnippet("another client pulls").All()
	if len(found) != 1 || !slicesEqual(found[0].ContextMap()["consumers"], []string{"bridge"}) {
		t.Fatalf("logged %+v, want one warning naming the first bridge's consumer", found)
	}
}
