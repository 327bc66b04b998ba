package nats

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/bridge"
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

// errSwitch is a recorder whose message batches fail with err while it
// is not nil.
type errSwitch struct {
	*recorder
	mu  sync.Mutex
	err error
	n   int // failed tries
}

func (e *errSwitch) Handle(ctx context.Context, b *bridge.Batch) error {
	if len(b.Items) > 0 {
		e.mu.Lock()
		err := e.err
		if err != nil {
			e.n++
		}
		e.mu.Unlock()
		if err != nil {
			return err
		}
	}
	return e.recorder.Handle(ctx, b)
}

func (e *errSwitch) set(err error) {
	e.mu.Lock()
	e.err = err
	e.mu.Unlock()
}

func (e *errSwitch) fails() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.n
}

// TestHandleFailLoggedAgainAfterEnd (reviews R200, R210): a failure line
// is always followed by "batches stored again" once the store takes the
// batch, but the end line does not restart the throttle (88b29ae did, so
// a store refusing each batch once logged two lines per batch): a run of
// failures just after the end line is held back with its end; a failure
// of another shape is logged at once, and so its end, naming the end held
// back. The interval is an hour here, so the test does not depend on how
// fast it runs.
func TestHandleFailLoggedAgainAfterEnd(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	_, _, js, src := createdSource(t, func(c *Config) { c.Logger = zap.New(core) })
	src.handleLog.Every = time.Hour
	src.handleEp.Every = time.Hour
	h := &errSwitch{recorder: newRecorder()}
	h.set(errHandle)
	publish(t, js, "delay.a", "v1", nil)
	runSource(t, src, h)
	const msg = "nats source: handle batch failed; not acked, retrying"
	fails := func() int { return logs.FilterMessage(msg).Len() }
	ends := func() int { return logs.FilterMessageSnippet("batches stored again").Len() }
	for i, c := range []struct {
		err         error
		fails, ends int
	}{
		{errHandle, 1, 1}, // the first run: both logged
		{errHandle, 1, 1}, // the same failure again within the interval: held back, and its end
		{errors.New("store: volume low on space: 9 MiB free, reserve 10 MiB"), 2, 2}, // another shape: logged, and its end
	} {
		v := fmt.Sprint("v", i+1)
		if i > 0 {
			h.set(c.err)
			publish(t, js, "delay.a", v, nil)
		}
		n := h.fails()
		eventually(t, "the batch failed twice", func() bool { return h.fails() >= n+2 })
		h.set(nil)
		eventually(t, "message "+v+" stored", func() bool { return taken(h.recorder, v) })
		// The end line follows the store's answer: wait for those due (the
		// second run's, held back, is counted in the third's held_back).
		eventually(t, "the end lines", func() bool { return ends() >= c.ends })
		if fails() != c.fails || ends() != c.ends {
			t.Fatalf("run %d of failures: %d %q and %d end lines, want %d and %d", i+1, fails(), msg, ends(), c.fails, c.ends)
		}
	}
	if held := logs.FilterMessageSnippet("batches stored again").All()[1].ContextMap()["held_back"]; held != int64(1) {
		t.Fatalf("the second end line: held_back %v, want 1 (the second run's)", held)
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
