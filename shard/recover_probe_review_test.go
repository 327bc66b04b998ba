package shard

import (
	"fmt"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// outageOfOne: one task waiting through 30 min of outage (its backoff at
// Retry.Max), with probes counted by the hook.
func outageOfOne(t *testing.T) (*harness, *atomic.Int32) {
	h := newHarness(t, func(o *Options) { o.Retry = defaultLikeRetry })
	var probes atomic.Int32
	h.e.testHookProbe = func(int64, uint64) { probes.Add(1) }
	down := fmt.Errorf("broker down: %w", ErrUnavailable)
	h.sink.setFail(func(*codec.Task) error { return down })
	h.run()
	h.ingest(dueAtT0(1))
	for range 30 * 60 {
		h.advance(time.Second)
	}
	if len(h.sink.acked()) != 0 {
		t.Fatal("delivered during the outage")
	}
	return h, &probes
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
			h.sink.setFail(nil)
			if steps := secondsUntilAcked(h, 1, 301); steps > 31 {
				t.Fatalf("step %v: delivered %ds after the return; want within probeEvery", tc.step, steps)
			}
		})
	}
}

// TestReviewR189CancelledGroupRounds (a repro, skipped unless
// DELAYBRIDGE_REVIEW_R189=1): a group whose only waiting task is
// cancelled stays down in the engine's outage map for good, so probe
// rounds (every probeEvery/2, a scan of every shard's waiting tasks every
// probeEvery) go on for as long as the process runs. Cheap, not fixed.
func TestReviewR189CancelledGroupRounds(t *testing.T) {
	if os.Getenv("DELAYBRIDGE_REVIEW_R189") != "1" {
		t.Skip("repro of a known cost; set DELAYBRIDGE_REVIEW_R189=1")
	}
	h, _ := outageOfOne(t)
	h.ingest([]codec.Task{cancelTask("t000", 100)})
	if got := waitingRecords(t, h.e); got != 0 {
		t.Fatalf("%d waiting records after the cancel", got)
	}
	for range 60 {
		h.advance(time.Minute)
	}
	h.e.outages.mu.Lock()
	n := len(h.e.outages.m)
	h.e.outages.mu.Unlock()
	t.Logf("an hour after the cancel: %d groups in the outage map, probeAt %d (now %d), outageErr %v", n, h.e.outages.probeAt.Load(), h.e.nowMs(), h.e.outageErr())
	if h.e.outages.probeAt.Load() != 0 {
		t.Errorf("probe rounds still scheduled an hour after the group's last task was cancelled")
	}
}
