package service

import (
	"errors"
	"strings"
	"testing"
	"time"

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
