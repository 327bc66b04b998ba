package shard

import (
	"errors"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/codec"
)

// TestRefusedPublishLogged (hunt H138): a target that refuses a publish
// (a Kafka topic that does not exist, a NATS subject no stream captures,
// a typo in delay-target) spends the task's retries, with the default
// policy about 4 minutes before the publish-failed dead letter. The first
// refusal is logged at once, with the target and the broker's error, then
// one line per 30 s per target.
func TestRefusedPublishLogged(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	h := newHarness(t, func(o *Options) {
		o.Logger = zap.New(core)
		o.Retry = RetryPolicy{Initial: 500 * time.Millisecond, Max: 5 * time.Minute, Multiplier: 2, Jitter: -1, MaxAttempts: 10}
	})
	refused := errors.New(`kafka: publish to "out": [3] Unknown Topic Or Partition`)
	h.sink.setFail(func(t *codec.Task) error {
		if t.Target == "out" {
			return refused
		}
		return nil
	})
	h.run()
	h.ingest([]codec.Task{sched("x", t0, 1)})
	refusals := func() []observer.LoggedEntry {
		return logs.FilterMessageSnippet("target refused a publish").All()
	}
	h.advanceUntil("the first refusal logged", func() bool { return len(refusals()) > 0 })
	first := refusals()[0]
	if first.Level != zapcore.WarnLevel {
		t.Fatalf("logged at %v, want warn", first.Level)
	}
	f := first.ContextMap()
	if f["target"] != "kafka:out" || f["attempt"] != uint32(1) || f["error"] != refused.Error() {
		t.Fatalf("first refusal fields %v", f)
	}
	// The 8 attempts of the first 64 s: logged at 0, 31.5 and 63.5 s.
	for range 70 {
		h.advance(time.Second)
	}
	if n := len(h.sink.all()); n < 8 {
		t.Fatalf("only %d attempts so far", n)
	}
	if n := len(refusals()); n < 2 || n > 3 {
		t.Fatalf("%d refusal lines for %d attempts in 70 s, want 2-3 (one per 30 s)", n, len(h.sink.all()))
	}
}
