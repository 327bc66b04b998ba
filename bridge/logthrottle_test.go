package bridge

import (
	"testing"
	"time"
)

// TestLogThrottle: the first of a run is logged, then one per LogEvery
// with the count held back; Reset starts a new run.
func TestLogThrottle(t *testing.T) {
	t0 := time.Date(2026, 11, 26, 0, 0, 0, 0, time.UTC)
	var th LogThrottle
	for i, c := range []struct {
		at         time.Duration
		reset      bool
		ok         bool
		suppressed int
	}{
		{at: 0, ok: true},
		{at: time.Second},
		{at: 10 * time.Second},
		{at: LogEvery - time.Millisecond},
		{at: LogEvery, ok: true, suppressed: 3},
		{at: LogEvery + time.Second},
		{at: LogEvery + 2*time.Second, reset: true, ok: true},
		{at: LogEvery + 3*time.Second},
	} {
		if c.reset {
			th.Reset()
		}
		n, ok := th.Allow(t0.Add(c.at))
		if ok != c.ok || n != c.suppressed {
			t.Fatalf("step %d at %v: Allow = %d, %v; want %d, %v", i, c.at, n, ok, c.suppressed, c.ok)
		}
	}
}
