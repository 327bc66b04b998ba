package shard

import (
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// outageOfOne: one task waiting through 30 min of outage (its backoff at
// Retry.Max), with probes counted by the hook.
func outageOfOne(t *testing.T) (*harness, *atomic.Int32) { return outageOf(t, dueAtT0(1), nil) }

// outageOf: tasks waiting through 30 min of outage of their target (their
// backoffs at Retry.Max, defaultLikeRetry), mod adjusting the options
// further, with probes counted by the hook.
func outageOf(t *testing.T, tasks []codec.Task, mod func(*Options)) (*harness, *atomic.Int32) {
	h := newHarness(t, func(o *Options) {
		o.Retry = defaultLikeRetry
		if mod != nil {
			mod(o)
		}
	})
	var probes atomic.Int32
	h.e.testHookProbe = func(int64, uint64) { probes.Add(1) }
	h.sink.setFail(func(*codec.Task) error { return errDown })
	h.run()
	h.ingest(tasks)
	for range 30 * 60 {
		h.advance(time.Second)
	}
	if len(h.sink.acked()) != 0 {
		t.Fatal("delivered during the outage")
	}
	return h, &probes
}

// backWithinProbe lets the target answer again and fails unless n waiting
// tasks are delivered within probeEvery (30 s) of its return.
func backWithinProbe(t *testing.T, h *harness, n int) {
	t.Helper()
	h.sink.setFail(nil)
	if steps := secondsUntilAcked(h, n, 301); steps > 31 {
		t.Fatalf("%d tasks delivered %ds after the return; want within probeEvery (30 s)", n, steps)
	}
}

// secondsUntilAcked advances a second at a time until n tasks are acked.
func secondsUntilAcked(h *harness, n, limit int) int {
	steps := 0
	for len(h.sink.acked()) < n && steps <= limit {
		steps++
		h.advance(time.Second)
	}
	return steps
}

// TestProbeAfterRestartFirstRound: a restart during an outage, the target
// back by then: the restored group is probed at the fire loops' first
// round (design.md), not at its task's own retry (review R189).
func TestProbeAfterRestartFirstRound(t *testing.T) {
	h, _ := outageOfOne(t)
	h.reopen()
	var probes atomic.Int32
	h.e.testHookProbe = func(int64, uint64) { probes.Add(1) }
	h.sink.setFail(nil)
	h.run()
	steps := secondsUntilAcked(h, 1, 301)
	t.Logf("delivered %ds after the restart, %d probes", steps, probes.Load())
	if steps > 2 {
		t.Fatalf("delivered %ds after a restart with the target back; want at the first probe round", steps)
	}
}

// TestProbeWhilePausedAtStart: firing paused at start, through the
// target's return, with a probe round due: the paused loops do not spin
// on a probeAt in the past, and the first round after the resume probes
// (review R189).
func TestProbeWhilePausedAtStart(t *testing.T) {
	h, _ := outageOfOne(t)
	h.stop()
	h.e.PauseFiring()
	var parks atomic.Int64
	h.e.testHookPark = func() { parks.Add(1) }
	h.sink.setFail(nil)
	h.run()
	for range 120 {
		h.advance(time.Second)
	}
	// 4 shards, at most a wake a second each, and some slack.
	if n := parks.Load(); n > 4*(120+5)*2 {
		t.Fatalf("%d parks in 120 s paused: a hot loop", n)
	}
	if len(h.sink.acked()) != 0 {
		t.Fatal("delivered while paused")
	}
	h.e.ResumeFiring()
	steps := secondsUntilAcked(h, 1, 301)
	t.Logf("delivered %ds after the resume, %d parks while paused", steps, parks.Load())
	if steps > 31 {
		t.Fatalf("delivered %ds after the resume; want within probeEvery", steps)
	}
}

// TestProbeAfterClockStep: the clock steps during an outage of a target
// with one waiting task. A step back past the task's due time must not
// have it probed before its due time comes again: pulled forward, it
// failed with its outage backoff from a negative overdue, Retry.Initial,
// and was tried every second against the down target (review R189: 599
// tries in the 10 min after a 1 h step back). A step back of less than
// its overdue, or one forward, keeps the probes at one per probeEvery.
// Either way the target's return is found within probeEvery once the
// task is due by the clock.
func TestProbeAfterClockStep(t *testing.T) {
	for _, tc := range []struct {
		step      time.Duration
		minProbes int32 // in the 10 min after the step
	}{
		{-time.Hour, 0},
		{-5 * time.Minute, 10*60/30 - 2},
		{time.Hour, 10*60/30 - 2},
	} {
		t.Run(tc.step.String(), func(t *testing.T) {
			h, probes := outageOfOne(t)
			before := len(h.sink.all())
			p0 := probes.Load()
			h.set(h.clk.Now().Add(tc.step))
			for range 10 * 60 {
				h.advance(time.Second)
			}
			tries, np := len(h.sink.all())-before, probes.Load()-p0
			t.Logf("step %v: %d tries, %d probes in 10 min after it", tc.step, tries, np)
			// One probe per 30 s, an own try or two of the task, slack.
			if tries > 10*60/30+5 || np < tc.minProbes {
				t.Fatalf("step %v: %d tries and %d probes in the 10 min after it; want at most %d tries, at least %d probes",
					tc.step, tries, np, 10*60/30+5, tc.minProbes)
			}
			for h.clk.Now().Before(t0) {
				h.advance(time.Minute) // the task due again by the clock
			}
			backWithinProbe(t, h, 1)
		})
	}
}

// downGroups lists the groups the engine's outage map has down.
func downGroups(e *Engine) []int64 {
	o := &e.outages
	o.mu.Lock()
	defer o.mu.Unlock()
	var gs []int64
	for g, st := range o.m {
		if st.down {
			gs = append(gs, g)
		}
	}
	return gs
}

// TestCancelledGroupOutageForgotten: a group whose only waiting task is
// cancelled stayed down in the engine's outage map for good, so the probe
// rounds (a scan of every shard's waiting tasks every probeEvery) went on
// for as long as the process ran (review R189). Now two probes in a row
// that find nothing waiting forget it, and the rounds stop. A task of the
// group that fails again later puts it down again, and its probes find
// the target's return as before.
func TestCancelledGroupOutageForgotten(t *testing.T) {
	h, probes := outageOfOne(t)
	if gs := downGroups(h.e); len(gs) != 1 {
		t.Fatalf("%d groups down after 30 min of outage, want 1", len(gs))
	}
	h.ingest([]codec.Task{cancelTask("t000", 100)})
	if got := waitingRecords(t, h.e); got != 0 {
		t.Fatalf("%d waiting records after the cancel", got)
	}
	for range 2 * 60 {
		h.advance(time.Second)
	}
	if gs := downGroups(h.e); len(gs) != 0 {
		t.Fatalf("%d groups down 2 min after the last waiting task was cancelled, want 0", len(gs))
	}
	h.e.outages.mu.Lock()
	n := len(h.e.outages.m)
	h.e.outages.mu.Unlock()
	if n != 0 {
		t.Fatalf("%d entries in the outage map 2 min after the cancel, want 0", n)
	}
	if at := h.e.outages.probeAt.Load(); at != 0 {
		t.Fatalf("probe rounds still scheduled (next at %d, now %d) 2 min after the cancel", at, h.e.nowMs())
	}
	before := probes.Load()

	// Down again: a new task fails, its group is down, and once the
	// target is back a probe finds it within probeEvery.
	h.ingest([]codec.Task{sched("t001", h.clk.Now(), 200)})
	for range 10 * 60 {
		h.advance(time.Second)
	}
	if gs := downGroups(h.e); len(gs) != 1 {
		t.Fatalf("%d groups down after a new task failed for 10 min, want 1", len(gs))
	}
	backWithinProbe(t, h, 1)
	if probes.Load() == before {
		t.Fatal("no probe after the group went down again")
	}
}

// TestHeldGroupOutageNotForgotten: a group whose waiting tasks are all
// held (none in memory) stays down: a held delivery in one shard must
// still release the rest in every shard. Its probe rounds find no waiting
// task in memory, but its held tasks on disk count as waiting. (Through the
// outage its held probes, failing at most heldProbeMax apart, also mark
// it down again; the direct probes below have no such failure between.)
func TestHeldGroupOutageNotForgotten(t *testing.T) {
	h := holdHarness(t, -1, func(o *Options) { o.Retry = defaultLikeRetry; o.Retry.Jitter = -1 })
	var batch []codec.Task
	for i := range 40 {
		batch = append(batch, sched(fmt.Sprintf("t%03d", i), t0.Add(time.Second), int64(i+1)))
	}
	holdTasks(t, h, batch, 40)
	// Two probes in a row right after the hold, no held probe failing
	// between them (it would mark the group down again anyway): the held
	// tasks count as waiting, so the group is not forgotten.
	gs := downGroups(h.e)
	if len(gs) != 1 {
		t.Fatalf("%d groups down with every task held, want 1", len(gs))
	}
	for range unseenToForget {
		h.e.probe(gs, h.e.nowMs())
	}
	if got := downGroups(h.e); len(got) != 1 {
		t.Fatalf("%d groups down after %d probes of a held group, want 1", len(got), unseenToForget)
	}
	for range 10 * 60 {
		h.advance(time.Second)
		if gs := downGroups(h.e); len(gs) != 1 {
			t.Fatalf("at %v: %d groups down while every task is held, want 1", h.clk.Now().Sub(t0), len(gs))
		}
	}
	backWithinProbe(t, h, 40) // heldProbeMax is 30 s too
	checkDeliveredOnce(t, h, 40)
}
