package shard

import (
	"context"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"

	"github.com/delaybridge/delaybridge/codec"
)

// TestOperatorPauseLaneParkedTasksWait (review R224): tasks a stuck lane
// set aside (parked: claimed while its batch was in the sink) are not "a
// batch being published": once the operator's pause has answered, they
// must not reach the target when the lane's batch returns. They went out
// before 49cc76a: takeParkedLocked took every parked task of a free lane
// whether or not firing was paused, so a lane stuck at the pause (a hung
// broker, or one in an outage: its lane is passed at once and every due
// task of its transport parks) delivered its whole parked backlog during
// the pause, well over the "at most fire_batch per shard and transport"
// the README promises; now they go back to the wheel and wait.
func TestOperatorPauseLaneParkedTasksWait(t *testing.T) {
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.LaneGrace = 20 * time.Millisecond
	})
	sink, release := newLaneSink(h)
	defer release()
	h.ingest([]codec.Task{sched("k1", t0, 1),
		sched("k2", t0.Add(10*time.Second), 2), sched("k3", t0.Add(10*time.Second), 3)})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.e.Run(ctx, sink) }()
	defer func() { release(); cancel(); <-done }()

	waitSignal(t, sink.entered, "k1's produce") // held: the lane goes stuck
	h.clk.Advance(10 * time.Second)
	eventuallyTrue(t, "k2 and k3 set aside behind the stuck lane", func() bool { return h.e.parkedIn(codec.TransportKafka) == 2 })
	st, err := h.e.PauseFiringByOperator("target migration")
	if err != nil {
		t.Fatal(err)
	}
	if st.InFlight != 3 {
		t.Fatalf("InFlight at the pause = %d, want 3 (k1 in the sink, k2 and k3 parked)", st.InFlight)
	}
	release() // the broker answers k1

	// Once nothing is in flight, nothing more may reach the target.
	eventuallyTrue(t, "k1 delivered and nothing in flight", func() bool {
		return slices.Contains(h.sink.acked(), "k1") && h.e.Firing().InFlight == 0
	})
	h.settle()
	if got := h.sink.acked(); !slices.Equal(got, []string{"k1"}) {
		t.Fatalf("delivered %v after the operator's pause answered; want k1 only (its batch was in the sink), k2 and k3 waiting for the resume", got)
	}
	if _, _, err := h.e.ResumeFiringByOperator(); err != nil {
		t.Fatal(err)
	}
	eventuallyTrue(t, "k2 and k3 after the resume", func() bool { return h.e.Stats().Pending == 0 })
	got := h.sink.acked()
	slices.Sort(got)
	if !slices.Equal(got, []string{"k1", "k2", "k3"}) {
		t.Fatalf("delivered %v, want k1, k2, k3 once each", got)
	}
}

// TestOperatorPauseAgainKeepsDueOrder (review R224): tasks set aside by a
// pause fire in due order after the resume (README "Pausing deliveries").
// A pause asked for again while the resume is still taking the tasks set
// aside by the first (a resume that made things worse) sets the newly due
// ones aside behind the rest, and they must still go in due order: one
// ingested overdue (x, due before b and c) went last, as the list was
// marked sorted from the first resume's take (and pausedMin, Stats'
// oldest overdue, was then read from its unsorted head).
func TestOperatorPauseAgainKeepsDueOrder(t *testing.T) {
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.FireBatch = 1
		o.LaneGrace = time.Hour // the loop waits for the lane's batch
	})
	sink, release := newLaneSink(h)
	defer release()
	h.ingest([]codec.Task{sched("a", t0.Add(1*time.Second), 1), sched("b", t0.Add(2*time.Second), 2), sched("c", t0.Add(3*time.Second), 3)})
	if _, err := h.e.PauseFiringByOperator("first"); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.e.Run(ctx, sink) }()
	defer func() { release(); cancel(); <-done }()
	h.clk.Advance(5 * time.Second)
	eventuallyTrue(t, "a, b and c set aside", func() bool {
		s := h.e.shards[0]
		s.mu.Lock()
		defer s.mu.Unlock()
		return len(s.paused) == 3
	})
	if _, _, err := h.e.ResumeFiringByOperator(); err != nil {
		t.Fatal(err)
	}
	waitSignal(t, sink.entered, "a's produce") // held; b and c still wait aside
	if _, err := h.e.PauseFiringByOperator("second"); err != nil {
		t.Fatal(err)
	}
	h.ingest([]codec.Task{sched("x", t0.Add(1500*time.Millisecond), 4)}) // overdue: due before b
	release()
	eventuallyTrue(t, "x set aside behind b and c", func() bool {
		s := h.e.shards[0]
		s.mu.Lock()
		defer s.mu.Unlock()
		return len(s.paused) == 3
	})
	h.settle()
	if got := h.sink.acked(); !slices.Equal(got, []string{"a"}) {
		t.Fatalf("delivered %v while paused again, want a", got)
	}
	if _, _, err := h.e.ResumeFiringByOperator(); err != nil {
		t.Fatal(err)
	}
	eventuallyTrue(t, "all delivered", func() bool { return h.e.Stats().Pending == 0 })
	if got := h.sink.acked(); !slices.Equal(got, []string{"a", "x", "b", "c"}) {
		t.Fatalf("delivered %v, want a, x, b, c (due order)", got)
	}
}

// TestFiringAnswersWhilePauseWriteStalls (review R224): GET /v1/firing
// (Firing) and the catch-up's ResumeFiring must not wait for an
// operator's pause whose record is stuck in the store (a WAL fsync that
// does not return: a full or hung disk, when an operator is most likely
// to pause). They took pauseMu, which PauseFiringByOperator held across
// its synced Set.
func TestFiringAnswersWhilePauseWriteStalls(t *testing.T) {
	var stall atomic.Bool
	entered, unblock := make(chan struct{}, 1), make(chan struct{})
	var once sync.Once
	release := func() { once.Do(func() { close(unblock) }) }
	inj := errorfs.InjectorFunc(func(op errorfs.Op) error {
		if stall.Load() && strings.HasSuffix(op.Path, ".log") &&
			(op.Kind == errorfs.OpFileSync || op.Kind == errorfs.OpFileSyncData || op.Kind == errorfs.OpFileSyncTo) {
			select {
			case entered <- struct{}{}:
			default:
			}
			<-unblock
		}
		return nil
	})
	h := newHarness(t, func(o *Options) { o.FS = errorfs.Wrap(vfs.Default, inj) })
	t.Cleanup(release) // before the harness's close, registered earlier, waits for the sync
	h.e.PauseFiring()  // the catch-up at start
	stall.Store(true)
	paused := make(chan error, 1)
	go func() {
		_, err := h.e.PauseFiringByOperator("disk full")
		paused <- err
	}()
	select { // the pause's record waits for its fsync
	case <-entered:
	case err := <-paused:
		t.Fatalf("PauseFiringByOperator returned (%v) before its record's fsync reached the stalling injector", err)
	case <-time.After(20 * time.Second):
		t.Fatal("the pause's record never reached its fsync")
	}

	answered := make(chan FiringState, 1)
	go func() {
		h.e.ResumeFiring()
		answered <- h.e.Firing()
	}()
	select {
	case st := <-answered:
		// The catch-up ended, and the operator's pause holds from when it
		// is durable (its call returns), not before.
		if st.Paused || st.CatchingUp || st.Operator != nil {
			t.Errorf("Firing() while the operator's pause is being written = %+v; want not paused", st)
		}
	case <-time.After(20 * time.Second): // turns a hang into a failure
		t.Error("ResumeFiring and Firing wait for the operator's pause stuck in the store")
	}
	stall.Store(false)
	release()
	if err := <-paused; err != nil {
		t.Fatal(err)
	}
	if st := h.e.Firing(); !st.Paused || st.Operator == nil || st.Operator.Reason != "disk full" {
		t.Fatalf("Firing() after the write = %+v, want paused by the operator", st)
	}
}
