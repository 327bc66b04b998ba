package shard

import (
	"errors"
	"fmt"
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
	h, logs := refusalHarness(t, 0)
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

// TestRefusedLogManyTargets (review R141): with more than 64 refusing
// targets (a publisher choosing targets) the log stays within about one
// line per target and 30 s. logthrottle forgot all its keys when a 65th
// came, so every attempt was logged (5754 lines for 100 targets).
func TestRefusedLogManyTargets(t *testing.T) {
	h, logs := refusalHarness(t, 0)
	h.sink.setFail(func(t *codec.Task) error {
		return fmt.Errorf(`kafka: publish to %q: [3] Unknown Topic Or Partition`, t.Target)
	})
	h.run()
	const targets = 100
	var tasks []codec.Task
	for i := range targets * 10 { // 10 tasks per target
		tk := sched(fmt.Sprintf("x%d", i), t0, int64(i+1))
		tk.Target = fmt.Sprintf("out-%d", i%targets)
		tasks = append(tasks, tk)
	}
	h.ingest(tasks)
	for range 70 {
		h.advance(time.Second)
	}
	attempts := len(h.sink.all())
	lines := logs.FilterMessageSnippet("target refused a publish").Len()
	// Per target: at 0, ~31.5 and ~63.5 s at most.
	if lines > 3*targets {
		t.Fatalf("%d refusal lines for %d targets (%d attempts) in 70 s, want at most %d (once per 30 s per target)",
			lines, targets, attempts, 3*targets)
	}
}

// TestRefusedLogSecondReason (review R141): two tasks to the same target
// refused for different reasons, retried in step: each reason is logged
// (keyed by the destination alone, the second showed only in its
// publish-failed line minutes later).
func TestRefusedLogSecondReason(t *testing.T) {
	h, logs := refusalHarness(t, 1)
	errA := errors.New(`kafka: publish to "out": [87] Invalid Record: policy violation A`)
	errB := errors.New(`kafka: publish to "out": [87] Invalid Record: policy violation B`)
	h.sink.setFail(func(t *codec.Task) error {
		if t.ID == "a" {
			return errA
		}
		return errB
	})
	h.run()
	h.ingest([]codec.Task{sched("a", t0, 1), sched("b", t0, 2)})
	for range 70 {
		h.advance(time.Second)
	}
	sawB := false
	for _, e := range logs.FilterMessageSnippet("target refused a publish").All() {
		if e.ContextMap()["error"] == errB.Error() {
			sawB = true
		}
	}
	if !sawB {
		t.Fatalf("in 70 s (%d attempts) the refusal of task b (%q) was never logged; only %q",
			len(h.sink.all()), errB, errA)
	}
}

// TestRefusedLogHeldBackCount (review R141): held_back on a target's line
// counts that target's held-back lines, not other targets'.
func TestRefusedLogHeldBackCount(t *testing.T) {
	h, logs := refusalHarness(t, 0)
	h.sink.setFail(func(t *codec.Task) error {
		if t.Target == "busy" {
			return errors.New("refused busy")
		}
		return errors.New("refused quiet")
	})
	h.run()
	var tasks []codec.Task
	for i := range 20 {
		tk := sched(fmt.Sprintf("b%d", i), t0, int64(i+1))
		tk.Target = "busy"
		tasks = append(tasks, tk)
	}
	h.ingest(tasks)
	h.advance(10 * time.Second) // busy: logged once, many held back
	q := sched("q", t0.Add(10*time.Second), 100)
	q.Target = "quiet"
	h.ingest([]codec.Task{q})
	h.advanceUntil("quiet refused", func() bool {
		for _, e := range logs.FilterMessageSnippet("target refused a publish").All() {
			if e.ContextMap()["target"] == "kafka:quiet" {
				return true
			}
		}
		return false
	})
	for _, e := range logs.FilterMessageSnippet("target refused a publish").All() {
		if m := e.ContextMap(); m["target"] == "kafka:quiet" && m["held_back"] != int64(0) {
			t.Fatalf("the first line for target quiet says held_back=%v: other targets' lines counted", m["held_back"])
		}
	}
}

// refusalHarness is a harness whose log is observed, with the default
// retry policy without jitter (500 ms doubling, 10 attempts) and shards
// shards (0: the default).
func refusalHarness(t *testing.T, shards int) (*harness, *observer.ObservedLogs) {
	core, logs := observer.New(zapcore.InfoLevel)
	h := newHarness(t, func(o *Options) {
		o.Logger = zap.New(core)
		if shards > 0 {
			o.Shards = shards
		}
		o.Retry = RetryPolicy{Initial: 500 * time.Millisecond, Max: 5 * time.Minute, Multiplier: 2, Jitter: -1, MaxAttempts: 10}
	})
	return h, logs
}
