package shard

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// TestParkClockMovedBeforeArming: the clock moves between the parking
// loop's look at it and the arming of its timer. The loop armed a
// duration worked out from the earlier look, so the wake-up went out by
// the move, and a task due at the new time waited for a later move of the
// clock: a test that advances only once the loop settled waited forever
// (bridge/service TestTransportRemoved failed so in CI). The timer is now
// armed for a time (clock.Timer.ResetAt), which has passed: it fires.
func TestParkClockMovedBeforeArming(t *testing.T) {
	var move atomic.Bool
	h := newHarness(t, func(o *Options) { o.Shards = 1 })
	h.e.testHookPark = func() {
		if move.CompareAndSwap(true, false) {
			h.clk.Advance(9 * time.Second) // to the task's due time
		}
	}
	h.ingest([]codec.Task{sched("a", t0.Add(10*time.Second), 1)})
	h.run()
	move.Store(true)
	h.advance(time.Second) // the loop wakes (maxPark), parks again, and the hook moves the clock
	if move.Load() {
		t.Fatal("the hook did not run: the test tests nothing")
	}
	if got := h.sink.acked(); len(got) != 1 || got[0] != "a" {
		t.Fatalf("delivered %v at %v, want [a] (due at %v); loops: %s", got, h.clk.Now(), t0.Add(10*time.Second), h.e.loopStates())
	}
}
