package shard

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/faultfs"
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

// TestErrAnswersWhileClearWaitsForStall: the range deletion of fired
// tombstones waits, as every write does, through a write stall of the
// store (its flushes fail: a full disk). It used to wait with the shard's
// lock held, and Err (readiness and liveness) then waited for the lock
// until the stall ended, instead of reporting ErrStoreStalled; so did
// Stats, Lookup and every Ingest. Now it waits without the lock, and it
// is made once the stall ends.
func TestErrAnswersWhileClearWaitsForStall(t *testing.T) {
	tg := faultfs.FullDisk(".sst", ".blob")
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.FS = errorfs.Wrap(vfs.Default, tg)
		o.CacheBytes, o.MemTableBytes = 64<<20, 4<<20
		o.stallGrace = time.Millisecond
	})
	t.Cleanup(tg.Off) // before the harness closes
	h.run()
	h.ingest([]codec.Task{sched("fired", t0.Add(time.Second), 1)})
	h.advance(time.Second)
	if got := h.sink.acked(); !slices.Equal(got, []string{"fired"}) {
		t.Fatalf("fired %v, want [fired]", got)
	}
	clearing := make(chan struct{})
	var once sync.Once
	h.e.testHookClear = func([]byte) { once.Do(func() { close(clearing) }) }

	// Fill both memtables with every flush failing: Pebble holds writes.
	tg.On()
	val := bytes.Repeat([]byte("x"), 32<<10)
	ingested := make(chan error, 1)
	go func() {
		for i := range 64 { // 32 MB: past two 4 MB memtables
			tasks := make([]codec.Task, 16)
			for j := range tasks {
				tasks[j] = sched(fmt.Sprintf("id%d-%d", i, j), t0.Add(time.Hour), int64(10+i*16+j))
				tasks[j].Value = val
			}
			if err := h.e.Ingest(context.Background(), tasks, nil); err != nil {
				ingested <- err
				return
			}
		}
		ingested <- nil
	}()
	// The deadlines only turn a hang into a failure.
	deadline := time.After(30 * time.Second)
	for !errors.Is(h.e.health.err(), ErrStoreStalled) {
		select {
		case err := <-ingested:
			t.Fatalf("ingest of 32 MB ended (%v) with every flush failing", err)
		case <-deadline:
			t.Fatal("no write stall after a minute of failing flushes")
		case <-time.After(time.Millisecond):
		}
	}
	h.clk.Advance(6 * time.Minute) // the horizon is due to move: a clear too
	select {
	case <-clearing:
	case <-deadline:
		t.Fatal("the fire loop made no range deletion")
	}
	answered := make(chan error, 1)
	go func() {
		err := h.e.Err()
		h.e.Stats()
		answered <- err
	}()
	select {
	case err := <-answered:
		if !errors.Is(err, ErrStoreStalled) {
			t.Fatalf("Err() = %v during a write stall, want ErrStoreStalled", err)
		}
	case <-deadline:
		t.Fatal("Err and Stats did not return during a write stall while a range deletion waited for it")
	}
	s := h.e.shards[0]
	s.mu.Lock()
	clears := s.clears
	s.mu.Unlock()
	if clears != 0 {
		t.Fatalf("%d range deletions made during the write stall: the test tests nothing", clears)
	}

	tg.Off() // space freed: the stall ends
	if err := <-ingested; err != nil {
		t.Fatal(err)
	}
	eventuallyTrue(t, "the range deletion after the stall", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.clears == 1
	})
}

// TestClearOrdersBatchDecidedMeanwhile: a batch decided after a range
// deletion of fired tombstones was decided (the clear's look at the
// shard's first stored task made, its range ending at now), and before
// the deletion is applied, applies after it: an overdue task it stores
// below the range's end is not deleted with the range, and is delivered.
func TestClearOrdersBatchDecidedMeanwhile(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.Shards = 1; o.Horizon = time.Minute })
	h.run()
	h.ingest([]codec.Task{sched("fired", h.clk.Now().Add(time.Second), 1)})
	h.advance(2 * time.Second)
	s := h.e.shards[0]
	var ran atomic.Bool
	ingested := make(chan error, 1)
	h.e.testHookClear = func([]byte) {
		if ran.Swap(true) {
			return
		}
		decided := make(chan struct{})
		h.e.testHookIngestDecided = func() { close(decided) }
		go func() {
			ingested <- h.e.Ingest(context.Background(), []codec.Task{sched("overdue", h.clk.Now().Add(-time.Second), 2)}, nil)
		}()
		<-decided
		// It waits for the deletion, or, without that order, applies
		// before it: wait for either. (The deadline only turns a hang
		// into a failure.)
		for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(time.Millisecond) {
			s.mu.Lock()
			waits := slices.ContainsFunc(s.queue, func(pb *pendingBatch) bool { return slices.Contains(pb.tk.deps, s.clearing) })
			s.mu.Unlock()
			if waits || countTaskKeys(t, h.e) == 1 {
				return
			}
			if time.Now().After(deadline) {
				t.Error("the batch decided meanwhile neither applied nor waited for the range deletion")
				return
			}
		}
	}
	waitHorizonMoved(t, h, 30*time.Second)
	if err := <-ingested; err != nil {
		t.Fatal(err)
	}
	h.settle()
	if !ran.Load() {
		t.Fatal("no clear ran: the test tests nothing")
	}
	if got := h.sink.acked(); !slices.Equal(got, []string{"fired", "overdue"}) {
		t.Fatalf("delivered %v, want [fired overdue]: the range deletion took the task decided meanwhile", got)
	}
	h.checkPending()
}
