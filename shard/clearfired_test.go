package shard

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// inFlightIngest starts an Ingest of tasks that stops after its decision,
// before it applies (testHookIngestDecided), and returns once it is
// there, with a func that lets it go on and one that waits for its end.
// gate must be the harness's installed gate.
func inFlightIngest(t *testing.T, h *harness, gate *atomic.Pointer[chan struct{}], entered chan struct{}, tasks []codec.Task) (release func(), wait func()) {
	t.Helper()
	g := make(chan struct{})
	gate.Store(&g)
	done := make(chan error, 1)
	go func() { done <- h.e.Ingest(context.Background(), tasks, nil) }()
	<-entered
	gate.Store(nil)
	var once atomic.Bool
	release = func() {
		if once.CompareAndSwap(false, true) {
			close(g)
		}
	}
	wait = func() {
		release()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	return release, wait
}

func gatedHarness(t *testing.T) (*harness, *atomic.Pointer[chan struct{}], chan struct{}) {
	h := newHarness(t, func(o *Options) { o.Shards = 1; o.Horizon = time.Minute })
	var gate atomic.Pointer[chan struct{}]
	entered := make(chan struct{}, 1)
	h.e.testHookIngestDecided = func() {
		if g := gate.Load(); g != nil {
			entered <- struct{}{}
			<-*g
		}
	}
	return h, &gate, entered
}

// waitHorizonMoved advances the clock by d and waits (real time) until
// the shard's horizon moved: the loop cannot settle while an ingest it
// must drain is held.
func waitHorizonMoved(t *testing.T, h *harness, d time.Duration) {
	t.Helper()
	s := h.e.shards[0]
	s.mu.Lock()
	before := s.horizonEnd
	s.mu.Unlock()
	h.clk.Advance(d)
	eventuallyTrue(t, "the horizon to move", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.horizonEnd != before
	})
}

// TestFiredTombstonesClearedUnderLoad (hunt H126): the range deletion of
// fired tasks' tombstones is tried when the loader moves the horizon. It
// used to be skipped whenever a batch of the shard was decided and not yet
// durable, which a source that never pauses always has: under steady load
// it never ran (0 clears for 4.6 M fired tasks). Here an ingest is in
// flight at each of 6 horizon moves; the range must be cleared each time,
// and the tasks of those ingests stay stored.
func TestFiredTombstonesClearedUnderLoad(t *testing.T) {
	h, gate, entered := gatedHarness(t)
	h.run()
	s := h.e.shards[0]
	n := int64(0)
	for round := range 6 {
		var batch []codec.Task
		for i := range 100 {
			n++
			batch = append(batch, sched(fmt.Sprintf("r%d-%d", round, i), h.clk.Now().Add(time.Second), n))
		}
		h.ingest(batch)
		h.advance(2 * time.Second) // they fire
		n++
		_, wait := inFlightIngest(t, h, gate, entered, []codec.Task{sched(fmt.Sprintf("far%d", round), h.clk.Now().Add(time.Hour), n)})
		waitHorizonMoved(t, h, 30*time.Second)
		wait()
		h.settle()
	}
	s.mu.Lock()
	clears := s.clears
	s.mu.Unlock()
	if clears < 6 {
		t.Fatalf("%d clears over 6 horizon moves with fired tasks, each with an ingest in flight; want 6", clears)
	}
	if got := countTaskKeys(t, h.e); got != 6 {
		t.Fatalf("%d tasks stored, want the 6 far ones", got)
	}
	h.checkPending()
}

// TestClearSparesBatchAppliedMeanwhile: an ingest decided before the
// clear and applied between its look at the shard's first stored task and
// its range deletion (which then has the higher sequence number) must not
// be deleted by it: the range ends before the first task key of any batch
// in flight. The task here is overdue (its key is below now, where the
// range would otherwise end) and must be delivered.
func TestClearSparesBatchAppliedMeanwhile(t *testing.T) {
	h, gate, entered := gatedHarness(t)
	h.run()
	h.ingest([]codec.Task{sched("fired", h.clk.Now().Add(time.Second), 1)})
	h.advance(2 * time.Second)
	release, wait := inFlightIngest(t, h, gate, entered, []codec.Task{sched("overdue", h.clk.Now().Add(-time.Second), 2)})
	var applied atomic.Bool
	h.e.testHookClear = func([]byte) {
		if applied.Swap(true) {
			return
		}
		release()
		eventuallyTrue(t, "the in-flight batch to apply", func() bool { return countTaskKeys(t, h.e) == 1 })
	}
	waitHorizonMoved(t, h, 30*time.Second)
	wait()
	h.settle()
	if !applied.Load() {
		t.Fatal("no clear ran: the test tests nothing")
	}
	h.advance(time.Second)
	if got := h.sink.acked(); len(got) != 2 || got[1] != "overdue" {
		t.Fatalf("delivered %v, want [fired overdue]: the range deletion took the task applied meanwhile", got)
	}
}
