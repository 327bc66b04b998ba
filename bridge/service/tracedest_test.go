package service

import (
	"encoding/json"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
)

// TestNATSTraceDestNotForwarded: a publisher may name only targets that
// targets.allow matches ("secret.events" is not). A Nats-Trace-Dest header
// on its delay message, forwarded with the delivery to an allowed NATS
// target, made the NATS server publish a trace event, carrying every header
// of the message, on the Nats-Trace-Dest subject with the bridge's own
// permissions: a subject outside targets.allow (found by a security
// review). Nats-Trace-* headers are not forwarded.
func TestNATSTraceDestNotForwarded(t *testing.T) {
	e := newEnv(t, "")
	sub, err := e.nc.SubscribeSync("secret.events")
	if err != nil {
		t.Fatal(err)
	}
	if err := e.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	e.start()
	now := e.clk.Now()
	e.publishKafka(0, now, []byte("k1"), []byte("from-kafka"),
		"delay-after", "1s", "delay-target", "nats:orders.a",
		"Nats-Trace-Dest", "secret.events", "x-attacker", "chosen-by-publisher")
	e.advanceUntil("the delivery", func(ds []delivery) bool {
		return len(byValue(ds, "")["from-kafka"]) > 0
	})

	// Barrier: the test's own client (which may publish to secret.events)
	// traces one message; the server sends trace events in order, so
	// whatever the bridge's deliveries made it send came before this one.
	m := natsgo.NewMsg("barrier.x")
	m.Header.Set("Nats-Trace-Dest", "secret.events")
	if err := e.nc.PublishMsg(m); err != nil {
		t.Fatal(err)
	}
	for {
		msg, err := sub.NextMsg(30 * time.Second)
		if err != nil {
			t.Fatalf("barrier trace not seen: %v", err)
		}
		var ev struct {
			Events []struct {
				Name string `json:"name"`
				Subj string `json:"subj"`
			} `json:"events"`
		}
		if err := json.Unmarshal(msg.Data, &ev); err != nil {
			t.Fatalf("trace event %.300s: %v", msg.Data, err)
		}
		if len(ev.Events) > 0 && ev.Events[0].Subj == "barrier.x" {
			return
		}
		t.Errorf("the bridge's delivery to %v made the server publish on secret.events, which targets.allow does not match: %.300s", ev.Events, msg.Data)
	}
}
