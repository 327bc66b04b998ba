package nats

import (
	"fmt"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// TestNoSourceSubjectLogThrottled (hunt H204): a durable consumer whose
// filter an operator widened while the bridge runs delivers messages on
// subjects no source reads; they are taken with the first source's rules,
// and each logged a Warn: a line per message, which the contract asks
// only of dead letters. Now once per 30 s, with the count held back:
// per subject (review R200), a subject per message made a line each.
func TestNoSourceSubjectLogThrottled(t *testing.T) {
	srv := startServer(t, jsOptions(t))
	cfg := testConfig(t, serverURL(srv))
	core, logs := observer.New(zap.InfoLevel)
	cfg.Logger = zap.New(core)
	cfg.Create = true
	cfg.Sources = []SourceConfig{{Subject: "delay.a.>"}}
	nc := connect(t, cfg)
	js := newJS(t, nc)
	if _, err := js.CreateStream(ctxT(t), jetstream.StreamConfig{Name: cfg.Stream, Subjects: []string{"delay.>"}}); err != nil {
		t.Fatal(err)
	}
	src, err := NewSource(nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	runSource(t, src, rec)
	publish(t, js, "delay.a.x", "first", delayHeader())
	eventually(t, "the first message taken", func() bool { return taken(rec, "first") })

	cons, err := js.Consumer(ctxT(t), cfg.Stream, cfg.Consumer)
	if err != nil {
		t.Fatal(err)
	}
	cc := cons.CachedInfo().Config
	cc.FilterSubject, cc.FilterSubjects = "", []string{"delay.>"}
	if _, err := js.UpdateConsumer(ctxT(t), cfg.Stream, cc); err != nil {
		t.Fatal(err)
	}
	const n = 20
	for i := range n {
		publish(t, js, fmt.Sprint("delay.b.x", i), fmt.Sprint("b", i), delayHeader())
	}
	eventually(t, "the messages of the widened filter taken", func() bool { return taken(rec, fmt.Sprint("b", n-1)) })
	const msg = "nats source: subject matches no configured source"
	if got := logs.FilterMessageSnippet(msg).Len(); got != 1 {
		t.Fatalf("%d %q lines for %d messages on as many subjects, want 1 (then one per 30 s)", got, msg, n)
	}
}
