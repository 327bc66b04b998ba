package service

import (
	"context"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/delaybridge/delaybridge/config"
)

// TestRepublishedDelayMessage: delay messages reach the delay stream
// through a RePublish of another stream (EVENTS republishes events.> to
// delay.>), so the server added Nats-Stream, Nats-Subject, Nats-Sequence,
// Nats-Time-Stamp and Nats-Last-Sequence to each (describing the message in
// EVENTS). Forwarded to the target, they would come before the copies the
// target's own direct get (every KV bucket, any stream with allow_direct)
// and RePublish append, and a reader takes the first: EVENTS's. The bridge
// drops them.
func TestRepublishedDelayMessage(t *testing.T) {
	e := newEnv(t, "")
	js, err := jetstream.New(e.nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	// The target stream answers direct gets (as every KV bucket does).
	st, err := js.Stream(ctx, "ORDERS")
	if err != nil {
		t.Fatal(err)
	}
	cfg := st.CachedInfo().Config
	cfg.AllowDirect = true
	if _, err := js.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	startRepublishing(t, e, js)
	e.publishNATS("events.o", []byte("good"), "delay-after", "1s", "delay-target", "orders.o")
	e.advanceUntil("the delivery", func(ds []delivery) bool {
		return len(byValue(ds, "orders.o")["good"]) > 0
	})
	for _, d := range byValue(e.deliveries(), "orders.o")["good"] {
		t.Logf("delivered headers: %v", d.headers)
	}
	// The target's own view of the message, through direct get.
	st, err = js.Stream(ctx, "ORDERS")
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	m, err := st.GetLastMsgForSubject(ctx, "orders.o")
	if err != nil {
		t.Fatal(err)
	}
	if m.Subject != "orders.o" || m.Sequence != info.State.LastSeq {
		t.Fatalf("direct get of ORDERS's last orders.o message says subject %q sequence %d (stream last sequence %d): headers forwarded from EVENTS's republish win over the server's",
			m.Subject, m.Sequence, info.State.LastSeq)
	}
}

// TestRepublishedDelayMessageToKV: the same into a KV bucket (a
// documented target with "$KV.>" in targets.allow): with EVENTS's headers
// forwarded, kv.Get reported EVENTS's sequence as the entry's revision, so
// the compare-and-set every KV user does with it (kv.Update) failed.
func TestRepublishedDelayMessageToKV(t *testing.T) {
	e := newEnv(t, "")
	e.mutate = func(c *config.Config) { c.Targets.Allow = append(c.Targets.Allow, "$KV.>") }
	js, err := jetstream.New(e.nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "sess"})
	if err != nil {
		t.Fatal(err)
	}
	startRepublishing(t, e, js)
	e.publishNATS("events.o", []byte("expired"), "delay-after", "1s", "delay-target", "$KV.sess.user1")
	var ent jetstream.KeyValueEntry
	e.advanceUntil("the KV put", func([]delivery) bool {
		ent, err = kv.Get(ctx, "user1")
		return err == nil
	})
	st, err := kv.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("kv.Get: key %q value %q revision %d; bucket has %d values", ent.Key(), ent.Value(), ent.Revision(), st.Values())
	if _, err := kv.Update(ctx, "user1", []byte("next"), ent.Revision()); err != nil {
		t.Fatalf("kv.Update with the revision kv.Get returned (%d): %v", ent.Revision(), err)
	}
}

// startRepublishing starts the bridge, then a stream EVENTS that
// republishes events.> to the delay subjects, with some history, so that
// its sequences differ from the target's.
func startRepublishing(t *testing.T, e *env, js jetstream.JetStream) {
	t.Helper()
	svc, _ := e.start()
	eventually(t, "ready", func() bool { return svc.Ready() == nil })
	if _, err := js.CreateStream(context.Background(), jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"},
		RePublish: &jetstream.RePublish{Source: "events.>", Destination: "delay.>"}}); err != nil {
		t.Fatal(err)
	}
	for range 5 {
		e.publishNATS("events.noise", []byte("n"))
	}
}
