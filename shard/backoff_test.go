package shard

import (
	"math"
	"testing"
	"time"
)

// TestJitterDuration: the jittered wait stays within +-jitter of d, is at
// least 1 ms, and one past the Duration range (a Retry.Max of centuries
// raised by the jitter) is clamped rather than wrapped to a negative wait.
func TestJitterDuration(t *testing.T) {
	const day = 24 * time.Hour
	huge := float64(100000 * day) // 274 years: 15% more is past the Duration range
	for _, c := range []struct {
		name      string
		d, jitter float64
		u         float64
		want      time.Duration
	}{
		{"no jitter", float64(time.Second), 0, 0.9, time.Second},
		{"lowest draw", float64(time.Second), 0.2, 0, 800 * time.Millisecond},
		{"middle draw", float64(time.Second), 0.2, 0.5, time.Second},
		{"highest draw", float64(time.Second), 0.2, 0.75, 1100 * time.Millisecond},
		{"under 1 ms", float64(100 * time.Microsecond), 0, 0, time.Millisecond},
		{"huge, lowest draw", huge, 0.15, 0, time.Duration(huge * 0.85)},
		{"huge, raised past the range", huge, 0.15, 0.99, math.MaxInt64},
		{"NaN", math.NaN(), 0, 0, math.MaxInt64},
		{"+Inf", math.Inf(1), 0.2, 0.3, math.MaxInt64},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := jitterDuration(c.d, c.jitter, c.u); got != c.want {
				t.Errorf("jitterDuration(%g, %g, %g) = %v, want %v", c.d, c.jitter, c.u, got, c.want)
			}
		})
	}
}

// TestBackoffCappedAtMax: a retry's wait, after a failed publish or in an
// outage, never exceeds Retry.Max, jitter included (the README promises
// delivery at most retry.max after the broker is back); below the cap the
// jitter still spreads the waits.
func TestBackoffCappedAtMax(t *testing.T) {
	r := RetryPolicy{Initial: 100 * time.Millisecond, Max: time.Second, Multiplier: 2, Jitter: 0.2, MaxAttempts: 50}
	h := newHarness(t, func(o *Options) { o.Shards, o.Retry = 1, r })
	s := h.e.shards[0] // the fire loop does not run: its rng is ours
	for _, c := range []struct {
		name     string
		wait     func() time.Duration
		min, max time.Duration
	}{
		{"first retry", func() time.Duration { return s.backoff(1) }, 80 * time.Millisecond, 120 * time.Millisecond},
		{"capped retry", func() time.Duration { return s.backoff(20) }, 800 * time.Millisecond, time.Second},
		{"short outage", func() time.Duration { return s.outageBackoff(200) }, 160 * time.Millisecond, 240 * time.Millisecond},
		{"long outage", func() time.Duration { return s.outageBackoff(3_600_000) }, 800 * time.Millisecond, time.Second},
	} {
		t.Run(c.name, func(t *testing.T) {
			lo, hi := time.Duration(math.MaxInt64), time.Duration(0)
			for range 1000 {
				d := c.wait()
				lo, hi = min(lo, d), max(hi, d)
			}
			if lo < c.min || hi > c.max || lo == hi {
				t.Fatalf("waits %v..%v, want spread within %v..%v", lo, hi, c.min, c.max)
			}
		})
	}
}
