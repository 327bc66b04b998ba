package service

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kmsg"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/config"
	"github.com/delaybridge/delaybridge/shard"
)

// Restarts with another config while tasks are pending: each task is
// checked against the config it is delivered under, not only the one it
// was taken in with.

// A pending task whose target targets.allow no longer matches after a
// restart is dead-lettered target-not-allowed at its due time, as it
// would have been at ingest under the new config: narrowing the list is
// how an operator revokes a target.
func TestAllowNarrowedAfterIngest(t *testing.T) {
	e := newEnv(t, "")
	svc, stop := e.start()
	e.publishKafka(0, time.Time{}, []byte("k1"), []byte("revoked"), "delay-after", "1h", "delay-target", "orders")
	e.publishKafka(0, time.Time{}, []byte("k2"), []byte("still-allowed"), "delay-after", "1h", "delay-target", "nats:orders.x")
	eventually(t, "ingest", func() bool { return svc.Engine().Stats().Pending == 2 })
	stop()

	e.mutate = func(c *config.Config) { c.Targets.Allow = []string{"nats:orders.>"} }
	svc, _ = e.start()
	e.clk.Advance(time.Hour + time.Second)
	got := e.advanceUntil("both tasks out of the store", func(ds []delivery) bool {
		revoked := len(byValue(ds, kafkaDLQ)["revoked"]) + len(byValue(ds, kafkaOut)["revoked"])
		return revoked > 0 && len(byValue(ds, "orders.x")["still-allowed"]) > 0
	})
	if n := len(byValue(got, kafkaOut)["revoked"]); n != 0 {
		t.Fatalf("delivered %d times to kafka:%s, which targets.allow no longer matches", n, kafkaOut)
	}
	dl := byValue(got, kafkaDLQ)["revoked"][0]
	if code := dl.header(codec.HeaderError); code != string(codec.CodeTargetNotAllowed) {
		t.Errorf("delay-error %q, want %s", code, codec.CodeTargetNotAllowed)
	}
	if d := dl.header(codec.HeaderErrorDetail); !strings.Contains(d, "kafka:orders is no longer matched by targets.allow") {
		t.Errorf("delay-error-detail %q does not say why", d)
	}
	eventually(t, "nothing pending", func() bool { return svc.Engine().Stats().Pending == 0 })
}

// A transport taken out of the config: a task for it whose DLQ is on a
// transport still configured is dead-lettered bad-target at its due time,
// as ingest would do under the new config; one whose DLQ left too (a NATS
// source's task for NATS) has nowhere to go, so it waits as in an outage,
// without using its retry budget, and is delivered once the transport is
// back. Before, both were dead-lettered publish-failed after their
// retries, and the NATS one's dead letter could not be delivered at all.
func TestTransportRemoved(t *testing.T) {
	e := newEnv(t, "")
	svc, stop := e.start()
	e.publishKafka(0, time.Time{}, []byte("k1"), []byte("k-to-nats"), "delay-after", "1h", "delay-target", "nats:orders.x")
	e.publishNATS("delay.a", []byte("n-to-nats"), "delay-after", "1h", "delay-target", "orders.y", "delay-id", "n1")
	eventually(t, "ingest", func() bool { return svc.Engine().Stats().Pending == 2 })
	stop()

	e.mutate = func(c *config.Config) { c.NATS = nil }
	svc, stop = e.start()
	e.clk.Advance(time.Hour)
	got := e.advanceUntil("the Kafka source's task dead-lettered", func(ds []delivery) bool {
		return len(byValue(ds, kafkaDLQ)["k-to-nats"]) > 0
	})
	dl := byValue(got, kafkaDLQ)["k-to-nats"][0]
	if code, detail := dl.header(codec.HeaderError), dl.header(codec.HeaderErrorDetail); code != string(codec.CodeBadTarget) || !strings.Contains(detail, "names transport nats, which is no longer configured") {
		t.Errorf("dead letter %s: %s, want bad-target naming the transport", code, detail)
	}
	// Far past the retry policy's 3 attempts (1 s to 4 s apart).
	e.advance(svc, time.Minute, time.Second)
	eventually(t, "readiness names the missing transport", func() bool {
		err := svc.Ready()
		return err != nil && strings.Contains(err.Error(), "not in the config")
	})
	if n := countDest(e.deliveries(), func(d delivery) bool { return d.value == "n-to-nats" }); n != 0 {
		t.Fatalf("the NATS source's task went out %d times while nats was out of the config, want 0", n)
	}
	if p := svc.Engine().Stats().Pending; p != 1 {
		t.Fatalf("pending %d, want 1 (the NATS source's task)", p)
	}
	stop()

	e.mutate = nil
	svc, _ = e.start()
	e.advanceUntil("the waiting task on its NATS target", func(ds []delivery) bool {
		return len(byValue(ds, "orders.y")["n-to-nats"]) > 0
	})
	eventually(t, "nothing pending", func() bool { return svc.Engine().Stats().Pending == 0 })
}

func TestCheckStoredTarget(t *testing.T) {
	cfg, err := config.LoadBytes([]byte(`
data_dir: /unused
kafka:
  brokers: ["127.0.0.1:1"]
  sources: [{topic: delay, dlq: delay.dlq}]
nats:
  url: nats://127.0.0.1:1
  sources: [{subject: "delay.>", dlq: dlq.delay}]
targets:
  allow: ["kafka:orders", "nats:orders.>"]
`), nil)
	if err != nil {
		t.Fatal(err)
	}
	// As if the delay sources were added after the tasks were stored.
	cfg.Targets.Allow = append(cfg.Targets.Allow, "kafka:delay", "nats:delay.>")
	kafkaOnly := *cfg
	kafkaOnly.NATS = nil
	tests := []struct {
		cfg       *config.Config
		transport codec.Transport
		target    string
		dlq       codec.Transport
		code      codec.Code // "" = allowed
		why       string
	}{
		{cfg, codec.TransportKafka, "orders", codec.TransportKafka, "", ""},
		{cfg, codec.TransportNATS, "orders.x", codec.TransportKafka, "", ""},
		{cfg, codec.TransportKafka, "payments", codec.TransportKafka, codec.CodeTargetNotAllowed, "no longer matched by targets.allow"},
		{cfg, codec.TransportNATS, "payments.x", codec.TransportNATS, codec.CodeTargetNotAllowed, "no longer matched by targets.allow"},
		// Allowed by the list, but now one of the bridge's delay sources.
		{cfg, codec.TransportKafka, "delay", codec.TransportKafka, codec.CodeTargetNotAllowed, "is now a delay source"},
		{cfg, codec.TransportNATS, "delay.x", codec.TransportNATS, codec.CodeTargetNotAllowed, "is now a delay source"},
		// The transport left the config: a dead letter if its DLQ can
		// take one; else let through, to wait (bridge.ErrNoTransport).
		{&kafkaOnly, codec.TransportNATS, "orders.x", codec.TransportKafka, codec.CodeBadTarget, "names transport nats, which is no longer configured"},
		{&kafkaOnly, codec.TransportNATS, "orders.x", codec.TransportNATS, "", ""},
	}
	for _, tt := range tests {
		err := checkStoredTarget(tt.cfg, &codec.Task{Transport: tt.transport, Target: tt.target, DLQTransport: tt.dlq})
		if tt.code == "" {
			if err != nil {
				t.Errorf("%s:%s (DLQ on %s): %v, want it let through", tt.transport, tt.target, tt.dlq, err)
			}
			continue
		}
		var rej *shard.RejectedError
		if !errors.As(err, &rej) || rej.Code != tt.code || !strings.Contains(err.Error(), tt.why) {
			t.Errorf("%s:%s (DLQ on %s): %v, want a %s rejection saying %q", tt.transport, tt.target, tt.dlq, err, tt.code, tt.why)
		}
	}
}

// A restart with an empty targets.allow (deny all: the Helm chart's
// default, or a list lost in an upgrade) while tasks are pending says at
// start that each of them will be dead-lettered when it comes due, rather
// than only one Warn per task at its due time.
func TestEmptyAllowWithPendingWarns(t *testing.T) {
	e := newEnv(t, "")
	svc, stop := e.start()
	e.publishKafka(0, time.Time{}, []byte("k1"), []byte("v"), "delay-after", "1h", "delay-target", "orders")
	eventually(t, "ingest", func() bool { return svc.Engine().Stats().Pending == 1 })
	stop()

	e.mutate = func(c *config.Config) { c.Targets.Allow = nil }
	core, logs := observer.New(zap.WarnLevel)
	svc, err := New(context.Background(), e.config(), Options{Logger: zap.New(core), Clock: e.clk})
	if err != nil {
		t.Fatal(err)
	}
	svc.closeAll()
	l := logs.FilterMessageSnippet("targets.allow is empty").All()
	if len(l) != 1 || l[0].ContextMap()["pending"] != int64(1) {
		t.Fatalf("logged %+v, want one warning with pending 1", l)
	}
}

// kafka.group renamed: the new group has no committed offsets, and each
// partition resumes after the store's checkpoint, which is kept per topic
// and partition: what was delivered is not read (and delivered) again.
func TestKafkaGroupRenamed(t *testing.T) {
	e := newEnv(t, "")
	svc, stop := e.start()
	for i := range 3 {
		s := strconv.Itoa(i)
		e.publishKafka(int32(i), time.Time{}, []byte("now"+s), []byte("now"+s), "delay-after", "0s", "delay-target", "orders")
	}
	e.advanceUntil("3 delivered", func(ds []delivery) bool { return len(byValue(ds, kafkaOut)) == 3 })
	eventually(t, "nothing pending", func() bool { return svc.Engine().Stats().Pending == 0 })
	stop()

	e.mutate = func(c *config.Config) { c.Kafka.Group = "bridge2" }
	svc, stop = e.start()
	for i := range 3 {
		s := strconv.Itoa(i)
		e.publishKafka(int32(i), time.Time{}, []byte("after"+s), []byte("after"+s), "delay-after", "0s", "delay-target", "orders")
	}
	e.advanceUntil("the new messages delivered", func(ds []delivery) bool { return len(byValue(ds, kafkaOut)) == 6 })
	e.advance(svc, 5*time.Second, time.Second)
	got := e.deliveries()
	stop()
	// Each new message is behind an old one on its partition, due later:
	// an old one read again would be delivered by now.
	for v, ds := range byValue(got, kafkaOut) {
		if len(ds) != 1 {
			t.Errorf("%s delivered %d times, want 1", v, len(ds))
		}
	}
}

// A Kafka delay topic taken out of kafka.sources and added back: its
// pending tasks fire meanwhile, and what was published to it meanwhile is
// read once it is a source again, from the stored checkpoint: nothing
// delivered before is read again.
func TestKafkaSourceRemovedAndBack(t *testing.T) {
	e := newEnv(t, "")
	req := kmsg.NewPtrCreateTopicsRequest()
	rt := kmsg.NewCreateTopicsRequestTopic()
	rt.Topic, rt.NumPartitions, rt.ReplicationFactor = "delay2", 1, 1
	req.Topics = append(req.Topics, rt)
	if resp, err := req.RequestWith(context.Background(), e.kcl); err != nil || resp.Topics[0].ErrorCode != 0 {
		t.Fatalf("create topic delay2: %v %+v", err, resp)
	}
	svc, stop := e.start()
	for i := range 3 {
		s := strconv.Itoa(i)
		e.publishKafka(int32(i), time.Time{}, []byte("now"+s), []byte("now"+s), "delay-after", "0s", "delay-target", "orders")
	}
	e.publishKafka(0, time.Time{}, []byte("soon"), []byte("soon"), "delay-after", "30s", "delay-target", "orders")
	e.publishKafka(1, time.Time{}, []byte("later"), []byte("later"), "delay-after", "2h", "delay-target", "orders")
	e.advanceUntil("3 delivered", func(ds []delivery) bool { return len(byValue(ds, kafkaOut)) == 3 })
	waitStored(t, svc, 2, kafkaDelay, "soon", "later")
	stop()

	e.mutate = func(c *config.Config) { c.Kafka.Sources = []config.KafkaSource{{Topic: "delay2", DLQ: kafkaDLQ}} }
	_, stop = e.start()
	e.publishKafka(2, time.Time{}, []byte("meanwhile"), []byte("meanwhile"), "delay-after", "10s", "delay-target", "orders")
	e.advanceUntil("the pending task of the removed source", func(ds []delivery) bool { return len(byValue(ds, kafkaOut)["soon"]) == 1 })
	stop()

	e.mutate = nil
	svc, stop = e.start()
	e.advanceUntil("what was published meanwhile", func(ds []delivery) bool { return len(byValue(ds, kafkaOut)["meanwhile"]) == 1 })
	e.advance(svc, 2*time.Hour+time.Minute, time.Minute)
	got := e.advanceUntil("the later task", func(ds []delivery) bool { return len(byValue(ds, kafkaOut)["later"]) == 1 })
	stop()
	for _, v := range []string{"now0", "now1", "now2", "soon", "meanwhile", "later"} {
		if n := len(byValue(got, kafkaOut)[v]); n != 1 {
			t.Errorf("%s delivered %d times, want 1", v, n)
		}
	}
}

// TestTaskSources: the admin API's hint for a 404 names the sources as
// tasks name them: each Kafka delay topic, and the NATS stream (not its
// subjects).
func TestTaskSources(t *testing.T) {
	cfg, err := config.LoadBytes([]byte(`
data_dir: /unused
kafka:
  brokers: ["127.0.0.1:1"]
  sources: [{topic: delay, dlq: delay.dlq}, {topic: later, dlq: delay.dlq}]
nats:
  url: nats://127.0.0.1:1
  stream: JOBS
  sources: [{subject: "delay.>", dlq: dlq.delay}]
`), nil)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := taskSources(cfg), []string{"delay", "later", "JOBS"}; !slices.Equal(got, want) {
		t.Errorf("taskSources = %q, want %q", got, want)
	}
	cfg.Kafka = nil
	if got, want := taskSources(cfg), []string{"JOBS"}; !slices.Equal(got, want) {
		t.Errorf("taskSources without Kafka = %q, want %q", got, want)
	}
}
