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

// Tasks for a transport taken out of the config wait, without using
// their retry budget, as in an outage of that transport, and are
// delivered once it is back; before, they were dead-lettered
// publish-failed, and a NATS source's dead letter, whose DLQ is on NATS,
// could not be delivered at all.
func TestTransportRemovedTasksWait(t *testing.T) {
	e := newEnv(t, "")
	svc, stop := e.start()
	e.publishKafka(0, time.Time{}, []byte("k1"), []byte("k-to-nats"), "delay-after", "1h", "delay-target", "nats:orders.x")
	e.publishNATS("delay.a", []byte("n-to-nats"), "delay-after", "1h", "delay-target", "orders.y", "delay-id", "n1")
	eventually(t, "ingest", func() bool { return svc.Engine().Stats().Pending == 2 })
	stop()

	e.mutate = func(c *config.Config) { c.NATS = nil }
	svc, stop = e.start()
	// Far past the retry policy's 3 attempts (1 s to 4 s apart).
	e.clk.Advance(time.Hour)
	e.advance(svc, time.Minute, time.Second)
	eventually(t, "readiness names the missing transport", func() bool {
		err := svc.Ready()
		return err != nil && strings.Contains(err.Error(), "not in the config")
	})
	if n := countDest(e.deliveries(), func(d delivery) bool { return d.dest == kafkaDLQ || d.dest == "dlq.delay" }); n != 0 {
		t.Fatalf("%d dead letters while the nats transport was out of the config, want 0", n)
	}
	if p := svc.Engine().Stats().Pending; p != 2 {
		t.Fatalf("pending %d, want 2", p)
	}
	stop()

	e.mutate = nil
	svc, _ = e.start()
	e.advanceUntil("both tasks on their NATS targets", func(ds []delivery) bool {
		return len(byValue(ds, "orders.x")["k-to-nats"]) > 0 && len(byValue(ds, "orders.y")["n-to-nats"]) > 0
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
	tests := []struct {
		transport codec.Transport
		target    string
		why       string // "" = allowed
	}{
		{codec.TransportKafka, "orders", ""},
		{codec.TransportNATS, "orders.x", ""},
		{codec.TransportKafka, "payments", "no longer matched by targets.allow"},
		{codec.TransportNATS, "payments.x", "no longer matched by targets.allow"},
		// Allowed by the list, but now one of the bridge's delay sources.
		{codec.TransportKafka, "delay", "is now a delay source"},
		{codec.TransportNATS, "delay.x", "is now a delay source"},
	}
	for _, tt := range tests {
		err := checkStoredTarget(cfg, &codec.Task{Transport: tt.transport, Target: tt.target})
		if tt.why == "" {
			if err != nil {
				t.Errorf("%s:%s: %v, want allowed", tt.transport, tt.target, err)
			}
			continue
		}
		var rej *shard.RejectedError
		if !errors.As(err, &rej) || rej.Code != codec.CodeTargetNotAllowed || !strings.Contains(err.Error(), tt.why) {
			t.Errorf("%s:%s: %v, want a target-not-allowed rejection saying %q", tt.transport, tt.target, err, tt.why)
		}
	}
}
