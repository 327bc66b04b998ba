package nats

import (
	"fmt"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// TestHandleFailLogThrottled (hunt H204): a store that refuses writes (a
// failed fsync, the volume's reserve) fails the source's batch at every
// retry. The NATS source logged each retry (10 lines a minute in the
// hunt, 6 a minute once the backoff reached 10 s, for as long as the
// store refuses) where the Kafka source logs once per 30 s; and neither
// said when the store took the batch. Now the line is logged once per
// 30 s per error shape, and the end once.
func TestHandleFailLogThrottled(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	_, _, js, src := createdSource(t, func(c *Config) { c.Logger = zap.New(core) })
	for range 3 {
		publish(t, js, "delay.a", "v", nil)
	}
	h := newRecorder()
	h.setFail(true)
	runSource(t, src, h)
	eventually(t, "the batch failed five times", func() bool { return h.numCalls() >= 5 })
	const msg = "nats source: handle batch failed; not acked, retrying"
	if n := logs.FilterMessage(msg).Len(); n != 1 {
		t.Fatalf("%d %q lines over %d failed attempts, want 1 (then one per 30 s)", n, msg, h.numCalls())
	}
	h.setFail(false)
	eventually(t, "the end logged", func() bool { return logs.FilterMessageSnippet("batches stored again").Len() > 0 })
	if n := logs.FilterMessageSnippet("batches stored again").Len(); n != 1 {
		t.Fatalf("the end of the failures logged %d times, want once", n)
	}
}

// TestHandleFailLoggedAgainAfterEnd (review R200): "batches stored again"
// ends a run of failures, but the throttle went on: a store failure just
// after it (within 30 s of the last line) was held back, and, if the
// store took the batch before the throttle let a line through, its end
// was not logged either. The end line starts the throttle again, so the
// next failure is logged at once. The interval is an hour here, so the
// test does not depend on how fast it runs.
func TestHandleFailLoggedAgainAfterEnd(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	_, _, js, src := createdSource(t, func(c *Config) { c.Logger = zap.New(core) })
	src.handleLog.Every = time.Hour
	h := newRecorder()
	h.setFail(true)
	publish(t, js, "delay.a", "v1", nil)
	runSource(t, src, h)
	const msg = "nats source: handle batch failed; not acked, retrying"
	for run := 1; run <= 2; run++ {
		calls := h.numCalls()
		eventually(t, "the batch failed twice", func() bool { return h.numCalls() >= calls+2 })
		if n := logs.FilterMessage(msg).Len(); n != run {
			t.Fatalf("run %d of failures: %d %q lines, want %d (each run's first failure logged at once)", run, n, msg, run)
		}
		h.setFail(false)
		eventually(t, "the end logged", func() bool { return logs.FilterMessageSnippet("batches stored again").Len() >= run })
		h.setFail(true)
		publish(t, js, "delay.a", fmt.Sprint("v", run+1), nil)
	}
	if n := logs.FilterMessageSnippet("batches stored again").Len(); n != 2 {
		t.Fatalf("%d end lines for two runs of failures, want 2", n)
	}
}

// TestHandleFailTriesOfTheRun (review F211): "batches stored again"
// counted in failed_tries the failed tries of the batch stored last
// only; a run of failures that outlived its first batch (given back when
// Run stopped, taken again by the next Run) lost the first batch's. It
// counts the run's.
func TestHandleFailTriesOfTheRun(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	_, _, js, src := createdSource(t, func(c *Config) { c.Logger = zap.New(core) })
	publish(t, js, "delay.a", "v", nil)
	h := newRecorder()
	h.setFail(true)
	stop := runSource(t, src, h)
	eventually(t, "the batch failed three times", func() bool { return h.numCalls() >= 3 })
	_ = stop()
	first := h.numCalls()
	runSource(t, src, h)
	eventually(t, "the batch failed twice more", func() bool { return h.numCalls() >= first+2 })
	h.setFail(false)
	eventually(t, "the end logged", func() bool { return logs.FilterMessageSnippet("batches stored again").Len() > 0 })
	failed := h.numCalls() - 1 // all but the one stored
	got, _ := logs.FilterMessageSnippet("batches stored again").All()[0].ContextMap()["failed_tries"].(int64)
	// The try under way when Run stopped may fail for the stop, not the
	// store: not counted.
	if int(got) < failed-1 || int(got) > failed {
		t.Fatalf("failed_tries %d, want %d (the run's failed tries over both Runs, %d in the first)", got, failed, first)
	}
}
