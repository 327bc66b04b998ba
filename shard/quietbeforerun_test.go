package shard

import (
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// TestQuietFlushOfWritesBeforeRun: the quiet-flush loop counted the
// store's writes from those it found when Run started it, so what was
// written between Open and Run (an ingest, the open's own clean-up) was
// flushed only after a later write: a store taking nothing after Run kept
// them in its memtable (and their deletions' space) for good.
func TestQuietFlushOfWritesBeforeRun(t *testing.T) {
	h := newHarness(t, nil)
	var flushes atomic.Int32
	h.e.testHookReclaimFlush = func(<-chan struct{}) { flushes.Add(1) }
	var tasks []codec.Task
	for i := range 16 {
		tasks = append(tasks, sched(fmt.Sprint("t", i), t0.Add(24*time.Hour), int64(i+1)))
	}
	h.ingest(tasks) // before Run
	h.run()
	deadline := time.Now().Add(30 * time.Second) // turns a hang into a failure
	var quiet time.Duration
	for flushes.Load() == 0 {
		if quiet > 10*quietFlushAfter || time.Now().After(deadline) {
			t.Fatalf("no quiet flush after %s of quiet (fake clock) of writes made before Run", quiet)
		}
		h.advance(quietFlushAfter / 4)
		quiet += quietFlushAfter / 4
		time.Sleep(5 * time.Millisecond)
	}
	t.Logf("flushed after %s of quiet (fake clock)", quiet)
}
