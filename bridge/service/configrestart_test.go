package service

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/config"
)

// kafka.brokers pointed at another cluster whose delay topic has the same
// name: the store's checkpoints (per topic and partition) belong to the
// old cluster's logs. Each partition of the new one is read from its
// start, whether its log ends before the stored offset or holds another
// record there: nothing of the new cluster is skipped, and the old
// cluster's pending task still fires.
func TestKafkaClusterReplaced(t *testing.T) {
	e := newEnv(t, "")
	svc, stop := e.start()
	for i := range 10 {
		s := strconv.Itoa(i)
		e.publishKafka(0, time.Time{}, []byte("a0-"+s), []byte("a0-"+s), "delay-after", "0s", "delay-target", "nats:orders.a")
	}
	for i := range 5 {
		s := strconv.Itoa(i)
		e.publishKafka(1, time.Time{}, []byte("a1-"+s), []byte("a1-"+s), "delay-after", "0s", "delay-target", "nats:orders.a")
	}
	e.publishKafka(2, time.Time{}, []byte("pend"), []byte("pend"), "delay-after", "1h", "delay-target", "nats:orders.a")
	e.advanceUntil("15 delivered", func(ds []delivery) bool { return len(byValue(ds, "orders.a")) == 15 })
	waitStored(t, svc, 1, kafkaDelay, "pend")
	stop()

	kb, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(3, kafkaDelay, kafkaDLQ, kafkaOut))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kb.Close)
	cl, err := kgo.NewClient(kgo.SeedBrokers(kb.ListenAddrs()...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	pub := func(p int32, v string, headers ...string) {
		r := &kgo.Record{Topic: kafkaDelay, Partition: p, Key: []byte(v), Value: []byte(v), Timestamp: e.clk.Now()}
		for i := 0; i+1 < len(headers); i += 2 {
			r.Headers = append(r.Headers, kgo.RecordHeader{Key: headers[i], Value: []byte(headers[i+1])})
		}
		if err := cl.ProduceSync(context.Background(), r).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	var want []string
	for i := range 3 { // below the stored offset 9
		v := "b0-" + strconv.Itoa(i)
		pub(0, v, "delay-after", "0s", "delay-target", "nats:orders.b")
		want = append(want, v)
	}
	for i := range 8 { // past the stored offset 4, another record there
		v := "b1-" + strconv.Itoa(i)
		pub(1, v, "delay-after", "0s", "delay-target", "nats:orders.b")
		want = append(want, v)
	}
	pub(2, "b2-0", "delay-after", "0s", "delay-target", "nats:orders.b")
	want = append(want, "b2-0")

	e.kafkaAddr = kb.ListenAddrs()[0]
	svc, stop = e.start()
	got := e.advanceUntil("the new cluster's records", func(ds []delivery) bool {
		return len(byValue(ds, "orders.b")) >= len(want)
	})
	for _, v := range want {
		if n := len(byValue(got, "orders.b")[v]); n != 1 {
			t.Errorf("%s delivered %d times", v, n)
		}
	}
	e.advance(svc, time.Hour+time.Minute, time.Minute)
	e.advanceUntil("the old cluster's pending task", func(ds []delivery) bool { return len(byValue(ds, "orders.a")["pend"]) == 1 })
	stop()
}

// The delay stream deleted while the bridge is down (nats.create makes it
// again at start): its sequences start again at 1, below the stored floor,
// and are read; a cancel on the new stream reaches a task the old one left
// pending (same stream name, later message).
func TestNATSStreamRecreatedWhileDown(t *testing.T) {
	e := newEnv(t, "")
	svc, stop := e.start()
	for i := range 5 {
		e.publishNATS("delay.a", []byte("a-"+strconv.Itoa(i)), "delay-after", "0s", "delay-target", "orders.a")
	}
	e.publishNATS("delay.a", []byte("pend-cancel"), "delay-after", "1h", "delay-target", "orders.a", "delay-id", "p1")
	e.publishNATS("delay.a", []byte("pend-keep"), "delay-after", "1h", "delay-target", "orders.a", "delay-id", "p2")
	e.advanceUntil("5 delivered", func(ds []delivery) bool { return len(byValue(ds, "orders.a")) == 5 })
	waitStored(t, svc, 2, "DELAY", "p1", "p2")
	stop()

	js, err := jetstream.New(e.nc)
	if err != nil {
		t.Fatal(err)
	}
	if err := js.DeleteStream(context.Background(), "DELAY"); err != nil {
		t.Fatal(err)
	}
	svc, stop = e.start()
	eventually(t, "ready", func() bool { return svc.Ready() == nil })
	for i := range 3 {
		e.publishNATS("delay.b", []byte("b-"+strconv.Itoa(i)), "delay-after", "0s", "delay-target", "orders.b")
	}
	e.publishNATS("delay.b", nil, "delay-cancel", "true", "delay-id", "p1")
	got := e.advanceUntil("the new stream's messages", func(ds []delivery) bool { return len(byValue(ds, "orders.b")) >= 3 })
	for i := range 3 {
		if n := len(byValue(got, "orders.b")["b-"+strconv.Itoa(i)]); n != 1 {
			t.Errorf("b-%d delivered %d times", i, n)
		}
	}
	e.advance(svc, time.Hour+time.Minute, time.Minute)
	got = e.advanceUntil("pend-keep", func(ds []delivery) bool { return len(byValue(ds, "orders.a")["pend-keep"]) == 1 })
	if n := len(byValue(got, "orders.a")["pend-cancel"]); n != 0 {
		t.Errorf("pend-cancel delivered %d times after its cancel on the new stream", n)
	}
	stop()
}

// max_message_bytes lowered below the size of pending tasks: it is checked
// when a message is taken in, so they are delivered as they are (the
// brokers' own limits decide), not dead-lettered too-large.
func TestMaxMessageBytesLowered(t *testing.T) {
	e := newEnv(t, "")
	svc, stop := e.start()
	big := strings.Repeat("x", 50_000)
	kv, nv := []byte("k-"+big), []byte("n-"+big)
	e.publishKafka(0, time.Time{}, []byte("k1"), kv, "delay-after", "1h", "delay-target", "orders")
	e.publishNATS("delay.a", nv, "delay-after", "1h", "delay-target", "orders.a", "delay-id", "n1")
	eventually(t, "2 pending", func() bool { return svc.Engine().Stats().Pending == 2 })
	stop()

	e.mutate = func(c *config.Config) { c.MaxMessageBytes = 1000 }
	svc, stop = e.start()
	e.advance(svc, time.Hour+time.Minute, time.Minute)
	got := e.advanceUntil("both big tasks out", func(ds []delivery) bool {
		return countDest(ds, func(d delivery) bool { return len(d.value) > 1000 }) >= 2
	})
	for _, d := range got {
		if len(d.value) > 1000 && (d.dest == kafkaDLQ || d.dest == "dlq.delay") {
			t.Errorf("the big %s task was dead-lettered %s: %s", d.value[:2], d.header("delay-error"), d.header("delay-error-detail"))
		}
	}
	eventually(t, "nothing pending", func() bool { return svc.Engine().Stats().Pending == 0 })
	stop()
}

// horizon shortened, then lengthened, across restarts with tasks pending
// inside and beyond both: the wheels are filled from the store at each
// start, so each task is delivered once and not before its due time.
func TestHorizonChanged(t *testing.T) {
	e := newEnv(t, "")
	svc, stop := e.start()
	dues := []time.Duration{20 * time.Second, 50 * time.Second, 3 * time.Minute, 30 * time.Minute, 3 * time.Hour}
	for i, d := range dues {
		s := strconv.Itoa(i)
		e.publishKafka(int32(i%3), time.Time{}, []byte("k"+s), []byte("k"+s), "delay-after", d.String(), "delay-target", "orders")
		e.publishNATS("delay.h", []byte("n"+s), "delay-after", d.String(), "delay-target", "orders.h", "delay-id", "n"+s)
	}
	eventually(t, "all pending", func() bool { return svc.Engine().Stats().Pending == int64(2*len(dues)) })
	e.advance(svc, 10*time.Second, time.Second)
	stop()

	e.mutate = func(c *config.Config) { c.Horizon = config.Duration(time.Second) }
	svc, stop = e.start()
	e.advance(svc, 2*time.Minute, time.Second)
	stop()
	e.mutate = func(c *config.Config) { c.Horizon = config.Duration(24 * time.Hour) }
	svc, stop = e.start()
	e.advance(svc, 3*time.Hour+time.Minute, time.Minute)
	got := e.advanceUntil("all", func(ds []delivery) bool { return len(byValue(ds, "")) >= 2*len(dues) })
	for v, ds := range byValue(got, "") {
		if len(ds) != 1 {
			t.Errorf("%s delivered %d times", v, len(ds))
		}
		due, _ := time.Parse(time.RFC3339Nano, ds[0].header("delay-due"))
		if ds[0].at.Before(due) {
			t.Errorf("%s early", v)
		}
	}
	eventually(t, "nothing pending", func() bool { return svc.Engine().Stats().Pending == 0 })
	stop()
}

// cancel_retention changed (here to 0, "not at all") while a cancel is
// remembered: it keeps the expiry it was stored with, so the older
// schedule that arrives after the restart is still dropped.
func TestCancelRetentionChanged(t *testing.T) {
	e := newEnv(t, "cancel_retention: 24h\n")
	_, stop := e.start()
	now := e.clk.Now()
	// Cancels read before their (older) schedules: remembered.
	e.publishKafka(2, now.Add(time.Second), []byte("c1"), []byte("x"), "delay-cancel", "true")
	eventually(t, "ingest", func() bool { return e.committedOffset(2) >= 1 })
	stop()

	e.mutate = func(c *config.Config) { c.CancelRetention = 0 }
	svc, stop := e.start()
	e.publishKafka(1, now, []byte("c1"), []byte("c1-sched"), "delay-after", "10s", "delay-target", "orders")
	e.publishKafka(1, now, []byte("marker"), []byte("marker"), "delay-after", "20s", "delay-target", "orders")
	e.advance(svc, 30*time.Second, time.Second)
	got := e.advanceUntil("marker", func(ds []delivery) bool { return len(byValue(ds, kafkaOut)["marker"]) == 1 })
	if n := len(byValue(got, kafkaOut)["c1-sched"]); n != 0 {
		t.Errorf("the schedule older than a cancel remembered before the restart was delivered %d times", n)
	}
	stop()
}

// nats.stream pointed at another stream (other subjects), then back. The
// old stream's pending task fires meanwhile, and what was published to it
// while it was not read is read once it is the stream again. Task ids are
// scoped to their stream, so a cancel sent to the new stream does not
// reach the old stream's task.
func TestNATSStreamSwitchedAndBack(t *testing.T) {
	e := newEnv(t, "")
	svc, stop := e.start()
	e.publishNATS("delay.a", []byte("a-now"), "delay-after", "0s", "delay-target", "orders.a")
	e.publishNATS("delay.a", []byte("a-pend"), "delay-after", "1h", "delay-target", "orders.a", "delay-id", "p")
	e.advanceUntil("a-now", func(ds []delivery) bool { return len(byValue(ds, "orders.a")) == 1 })
	waitStored(t, svc, 1, "DELAY", "p")
	stop()
	// Published while the bridge is down, to the old stream.
	e.publishNATS("delay.a", []byte("a-meanwhile"), "delay-after", "0s", "delay-target", "orders.a")

	e.mutate = func(c *config.Config) {
		c.NATS.Stream = "DELAY2"
		c.NATS.Sources = []config.NATSSource{{Subject: "delay2.>", DLQ: "dlq.delay2"}}
	}
	svc, stop = e.start()
	e.publishNATS("delay2.b", []byte("b-now"), "delay-after", "0s", "delay-target", "orders.b")
	// A cancel of the old stream's pending task, sent to the new stream.
	e.publishNATS("delay2.b", nil, "delay-cancel", "true", "delay-id", "p")
	e.advance(svc, time.Hour+time.Minute, time.Minute)
	// Delivered although cancelled on the new stream: another scope.
	e.advanceUntil("b-now and a-pend", func(ds []delivery) bool {
		return len(byValue(ds, "orders.b")) == 1 && len(byValue(ds, "orders.a")["a-pend"]) == 1
	})
	stop()

	e.mutate = nil
	svc, stop = e.start()
	e.advanceUntil("a-meanwhile", func(ds []delivery) bool { return len(byValue(ds, "orders.a")["a-meanwhile"]) == 1 })
	e.advance(svc, 10*time.Second, time.Second)
	got := e.deliveries()
	for v, ds := range byValue(got, "") {
		if len(ds) != 1 {
			t.Errorf("%s delivered %d times", v, len(ds))
		}
	}
	stop()
}

// targets.allow narrowed while tasks for a target are held on disk (its
// broker unavailable): they are dead-lettered target-not-allowed once
// released, without waiting for the broker.
func TestAllowNarrowedHeldTasks(t *testing.T) {
	e := newEnv(t, "retry: {initial: 1s, max: 2s, multiplier: 2, jitter: 0, max_attempts: 2, waiting_in_memory: 0}\n")
	svc, stop := e.start()
	fail := e.failProduceTo(kafkaOut)
	fail.Store(true)
	for i := range 5 {
		s := strconv.Itoa(i)
		e.publishKafka(int32(i%3), time.Time{}, []byte("h"+s), []byte("h"+s), "delay-after", "1s", "delay-target", "orders")
	}
	eventually(t, "5 held", func() bool {
		e.clk.Advance(time.Second)
		return svc.Engine().Stats().Held == 5
	})
	stop()

	e.mutate = func(c *config.Config) { c.Targets.Allow = []string{"nats:orders.>"} }
	svc, stop = e.start()
	got := e.advanceUntil("5 dead letters", func(ds []delivery) bool { return len(byValue(ds, kafkaDLQ)) == 5 })
	for _, d := range got {
		if d.dest == kafkaDLQ && d.header("delay-error") != "target-not-allowed" {
			t.Errorf("%s: %s", d.value, d.header("delay-error"))
		}
	}
	eventually(t, "nothing pending", func() bool { return svc.Engine().Stats().Pending == 0 })
	stop()
}

// data_dir changed (or its volume replaced) between two runs: the tasks
// pending in the old store are not in the new one, and both sources read
// on from the broker's positions, past what the old store took in. The
// start says so, an error line per Kafka partition the group has read and
// one for the NATS stream its consumer has acked; a restart on the same
// store, old or new, says nothing.
func TestDataDirChangedLogged(t *testing.T) {
	e := newEnv(t, "")
	const kafkaMsg, natsMsg = "the store holds no checkpoint of it", "the store holds no floor of it"
	run := func(what string, publish func()) *observer.ObservedLogs {
		t.Helper()
		core, logs := observer.New(zap.InfoLevel)
		svc, cancel, done := e.runWith(Options{Logger: zap.New(core)})
		before := svc.Engine().Stats().Pending
		publish()
		eventually(t, what, func() bool { return svc.Engine().Stats().Pending == before+2 })
		cancel()
		if err := <-done; err != nil {
			t.Fatalf("%s: Run: %v", what, err)
		}
		return logs
	}
	pending := func(v string) func() {
		return func() {
			e.publishKafka(0, time.Time{}, []byte(v), []byte(v), "delay-after", "1h", "delay-target", "orders")
			e.publishNATS("delay.a", []byte(v), "delay-after", "1h", "delay-target", "orders.a")
		}
	}
	count := func(logs *observer.ObservedLogs) (kafka, nats int) {
		return logs.FilterMessageSnippet(kafkaMsg).FilterLevelExact(zap.ErrorLevel).Len(),
			logs.FilterMessageSnippet(natsMsg).FilterLevelExact(zap.ErrorLevel).Len()
	}
	for i, step := range []struct {
		what       string
		newDir     bool
		kafka, nat int
	}{
		{"first start", false, 0, 0},
		{"restart", false, 0, 0},
		{"data_dir changed", true, 1, 1}, // partition 0 read; 1 and 2 never committed
		{"restart on the new dir", false, 0, 0},
	} {
		if step.newDir {
			dir := t.TempDir()
			e.mutate = func(c *config.Config) { c.DataDir = dir }
		}
		k, n := count(run(step.what, pending("v"+strconv.Itoa(i))))
		if k != step.kafka || n != step.nat {
			t.Errorf("%s: %d Kafka and %d NATS error lines, want %d and %d", step.what, k, n, step.kafka, step.nat)
		}
	}
}
