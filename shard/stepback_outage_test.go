package shard

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// TestOutageAfterClockStepBack (review R179): the engine's record of a
// group's last release (groupOutage.released) was not moved back with the
// clock as rebaseLocked moves the shards' waits. After a step back, every
// failure of the group looked older than its last release (outcome skipped
// it, releasedSince said stale), so the group was not put down and each
// task waiting for the outage was retried every Retry.Initial instead of
// at its outage backoff, for as long as the step (60 tries in a minute
// after a step of an hour, not 6).
func TestOutageAfterClockStepBack(t *testing.T) {
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.Retry = RetryPolicy{Initial: 500 * time.Millisecond, Max: 5 * time.Minute, Multiplier: 2, Jitter: -1, MaxAttempts: 3}
	})
	down := fmt.Errorf("broker down: %w", ErrUnavailable)
	h.sink.setFail(func(*codec.Task) error { return down })
	h.run()
	h.ingest([]codec.Task{sched("a", t0, 1)})
	h.advance(2 * time.Minute)
	h.sink.setFail(func(t *codec.Task) error {
		if t.ID == "a" {
			return nil
		}
		return down
	})
	for !slices.Contains(h.sink.acked(), "a") { // a finds the target back: a release
		h.advance(time.Second)
	}
	h.sink.setFail(func(*codec.Task) error { return down }) // down again
	h.advance(10 * time.Second)
	back := h.e.clk.Now().Add(-time.Hour) // NTP steps the clock back an hour
	h.set(back)
	h.ingest([]codec.Task{sched("c", back, 3)})
	before := h.sink.deliveriesOf("c")
	for range 60 {
		h.advance(time.Second)
	}
	// At its outage backoff (doubling from 0.5 s as long as it is overdue)
	// c is tried about 7 times in a minute; every 0.5 s, 120.
	n := h.sink.deliveriesOf("c") - before
	if n > 20 {
		t.Fatalf("c tried %d times in the minute after a clock step back, a down target hammered at Retry.Initial", n)
	}
}
