package shard

import (
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/codec"
)

// outageLines are the observed lines of msg (a snippet), with their
// target and other_targets fields ("" and 0 when absent).
func outageLines(logs *observer.ObservedLogs, msg string) (targets []string, others []int64) {
	for _, l := range logs.FilterMessageSnippet(msg).All() {
		f := l.ContextMap()
		s, _ := f["target"].(string)
		n, _ := f["other_targets"].(int64)
		targets, others = append(targets, s), append(others, n)
	}
	return targets, others
}

// TestOutageLinesNameTarget: the lines of an outage's end name the
// target whose publish failed (target), and count the other targets of
// its group (a 12-bit hash bucket, the only thing they named before)
// that failed too (other_targets); an outage restored at Open says its
// target is not known.
func TestOutageLinesNameTarget(t *testing.T) {
	const back = "target back after an outage"
	t.Run("back", func(t *testing.T) {
		core, logs := observer.New(zap.InfoLevel)
		h := newHarness(t, func(o *Options) { o.Retry = defaultLikeRetry; o.Logger = zap.New(core) })
		h.sink.setFail(func(*codec.Task) error { return errDown })
		h.run()
		b, c := sched("b", t0, 2), sched("c", t0.Add(time.Second), 3)
		b.Target, c.Target = "orders", collidingTarget(transportSlot(codec.TransportKafka), "orders")
		d := sched("d", t0, 4)
		d.Target = "payments"
		h.ingest([]codec.Task{b, c, d})
		for range 10 * 60 {
			h.advance(time.Second)
		}
		h.sink.setFail(nil)
		secondsUntilAcked(h, 3, 301)
		targets, others := outageLines(logs, back)
		got := map[string]int64{}
		for i, name := range targets {
			got[name] = others[i]
		}
		if len(targets) != 2 || len(got) != 2 || got["orders"] != 1 || got["payments"] != 0 {
			t.Fatalf("%q lines name targets %q, other_targets %v; want orders (1 other) and payments", back, targets, others)
		}
	})
	t.Run("forgotten", func(t *testing.T) {
		core, logs := observer.New(zap.InfoLevel)
		h := newHarness(t, func(o *Options) { o.Retry = defaultLikeRetry; o.Logger = zap.New(core) })
		h.sink.setFail(func(*codec.Task) error { return errDown })
		h.run()
		h.ingest([]codec.Task{sched("a", t0, 1)})
		for range 10 * 60 {
			h.advance(time.Second)
		}
		h.ingest([]codec.Task{cancelTask("a", 100)})
		for range 10 * 60 {
			h.advance(time.Second)
		}
		const msg = "no task waits for a target group"
		if targets, _ := outageLines(logs, msg); len(targets) != 1 || targets[0] != "out" {
			t.Fatalf("%q lines name targets %q, want out", msg, targets)
		}
	})
	t.Run("restored at Open", func(t *testing.T) {
		h, _ := outageOfOne(t)
		core, logs := observer.New(zap.InfoLevel)
		h.close()
		h.opts.Logger = zap.New(core)
		h.open()
		h.sink.setFail(nil) // back before any task of it fails again (whose failure names it)
		h.run()
		secondsUntilAcked(h, 1, 301)
		targets, _ := outageLines(logs, back)
		if len(targets) != 1 || targets[0] != unknownRestoredTarget {
			t.Fatalf("%q lines name targets %q, want %q", back, targets, unknownRestoredTarget)
		}
	})
}
