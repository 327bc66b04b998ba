package nats

import (
	"context"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// TestStoreWithoutConsumersFloorLogged: a bridge started on a new store
// (data_dir changed, its volume replaced or wiped) while its consumer had
// acked messages read on in silence, though the tasks the old store held
// were not in the new one. It is now an error line naming the consumer's
// ack floor; the source still reads on. A first start (the consumer new)
// and restarts on the same store, one with narrowed subjects (whose floor
// is under another key), log nothing.
func TestStoreWithoutConsumersFloorLogged(t *testing.T) {
	const msg = "the store holds no floor of it"
	s := startServer(t, jsOptions(t))
	js := newJS(t, connect(t, testConfig(t, serverURL(s))))
	core, logs := observer.New(zap.InfoLevel)
	old := newRecorder()
	run := func(h *recorder, subject string, values ...string) {
		t.Helper()
		stop := runSource(t, subjectSource(t, s, core, subject), h)
		before := len(h.handledValues())
		for _, v := range values {
			publish(t, js, "delay.a", v, nil)
		}
		eventually(t, "handled", func() bool { return len(h.handledValues()) == before+len(values) })
		eventually(t, "acked", func() bool {
			ci := consumerInfo(t, js, "DELAY", "bridge")
			return ci.AckFloor.Stream == ci.Delivered.Stream
		})
		if err := stop(); err != nil {
			t.Fatal(err)
		}
	}
	run(old, "delay.>", "a", "b", "c")
	run(old, "delay.>", "d")
	run(old, "delay.a", "e")
	if n := logs.FilterMessageSnippet(msg).Len(); n != 0 {
		t.Fatalf("a first start and restarts on the same store logged %d %q lines, want none", n, msg)
	}

	fresh := newRecorder()
	run(fresh, "delay.a", "f")
	if got := fresh.handledValues(); len(got) != 1 || got[0] != "f" {
		t.Fatalf("the new store took in %v, want only f (read on from the consumer)", got)
	}
	l := logs.FilterMessageSnippet(msg).All()
	if len(l) != 1 || l[0].Level != zap.ErrorLevel || l[0].ContextMap()["ack_floor"] != uint64(5) {
		t.Fatalf("logged %+v, want one error at ack floor 5", l)
	}
}

// TestFirstStartOnPurgedStreamNotLogged: a first start (new store, the
// consumer created now) on a delay stream whose first sequence is past 1
// (purged, or its messages aged out by max_age) logged the "no floor"
// error: the server starts a new consumer's stream ack floor at the
// stream's first sequence - 1. Nothing was acked: no line.
func TestFirstStartOnPurgedStreamNotLogged(t *testing.T) {
	const msg = "the store holds no floor of it"
	s := startServer(t, jsOptions(t))
	js := newJS(t, connect(t, testConfig(t, serverURL(s))))
	ctx := context.Background()
	str, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "DELAY", Subjects: []string{"delay.>"}})
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range []string{"a", "b", "c"} {
		publish(t, js, "delay.a", v, nil)
	}
	if err := str.Purge(ctx); err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.InfoLevel)
	h := newRecorder()
	stop := runSource(t, subjectSource(t, s, core, "delay.>"), h)
	publish(t, js, "delay.a", "d", nil)
	eventually(t, "handled", func() bool { return len(h.handledValues()) == 1 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if l := logs.FilterMessageSnippet(msg).All(); len(l) != 0 {
		t.Fatalf("a first start on a purged stream logged %+v", l)
	}
}
