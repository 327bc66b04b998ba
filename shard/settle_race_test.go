package shard

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// TestSettledSeesLaneReturn: a lane whose transport is in an outage is not
// waited for, so the fire loop parks while the lane's batch is in the
// sink. When the batch returns, the lane is free again before the loop is
// woken (lane.go: busy=false, unlock, then wake). If the loop still looks
// parked then, the harness's settled() takes the engine for idle while a
// held task is releasable: every check after h.settle() (holdprop's
// TestHeldReleaseProperty) then races the next release, and Stats, the
// store scan and the sink log are read at different moments (seed 19's
// "Stats pending 64 held 54; store t keys 39 held keys 28").
func TestSettledSeesLaneReturn(t *testing.T) {
	h := holdHarness(t, -1, func(o *Options) { o.FireBatch = 1 })
	// Two targets in two held groups, one task each.
	ta, tb := "out", "out-b"
	for i := 0; heldGroup(transportSlot(codec.TransportKafka), tb) == heldGroup(transportSlot(codec.TransportKafka), ta); i++ {
		tb = "out-b" + string(rune('a'+i))
	}
	a := sched("a", t0.Add(time.Second), 1)
	b := sched("b", t0.Add(time.Second), 2)
	a.Target, b.Target = ta, tb
	idle := make(chan bool, 1)
	var armed atomic.Bool
	h.e.testHookLaneDone = func() {
		if armed.CompareAndSwap(true, false) {
			idle <- h.e.settled()
		}
	}
	holdTasks(t, h, []codec.Task{a, b}, 2)

	s := h.e.shards[0]
	parked := func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.parked
	}
	// The next release's first batch (one task) waits in the sink until
	// the loop parked, then fails as unavailable again (no write: no
	// commit to drain); the other group's task is then releasable.
	first := true
	h.sink.setFail(func(*codec.Task) error {
		if !first {
			return nil
		}
		first = false
		deadline := time.Now().Add(10 * time.Second)
		for !parked() {
			if time.Now().After(deadline) {
				t.Errorf("fire loop did not park while its lane was in the sink")
				break
			}
			time.Sleep(50 * time.Microsecond)
		}
		return errDown
	})
	armed.Store(true)
	h.clk.Advance(20 * time.Second) // past every group's backoff
	select {
	case got := <-idle:
		if got {
			t.Fatalf("settled() = true right after a lane returned, with a held task releasable: the loop's wake-up is still to come")
		}
	case <-time.After(20 * time.Second):
		t.Fatal("no batch returned")
	}
	h.settle()
	if st := h.e.Stats(); st.Held != 1 || st.Pending != 1 || len(h.sink.acked()) != 1 {
		t.Fatalf("after settle: %+v, acked %v; want the other group's task delivered", st, h.sink.acked())
	}
	h.checkPending()
}
