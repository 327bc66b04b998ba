package logthrottle

import (
	"testing"
	"time"
)

// TestThrottle: the first of a run is logged, then one per DefaultEvery
// with the count held back; Reset starts a new run.
func TestThrottle(t *testing.T) {
	t0 := time.Date(2026, 11, 26, 0, 0, 0, 0, time.UTC)
	var th Throttle
	for i, c := range []struct {
		at         time.Duration
		reset      bool
		ok         bool
		suppressed int
	}{
		{at: 0, ok: true},
		{at: time.Second},
		{at: 10 * time.Second},
		{at: DefaultEvery - time.Millisecond},
		{at: DefaultEvery, ok: true, suppressed: 3},
		{at: DefaultEvery + time.Second},
		{at: DefaultEvery + 2*time.Second, reset: true, ok: true},
		{at: DefaultEvery + 3*time.Second},
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

// TestThrottleNewCause: a failure that differs from the one
// logged last is logged at once; only repeats of the same one are held
// back. With Allow alone, a join that first failed with "connection
// refused" and then with "GROUP_AUTHORIZATION_FAILED" (ACL removed while
// the cluster was down) showed only the first cause for up to DefaultEvery.
func TestThrottleNewCause(t *testing.T) {
	t0 := time.Date(2026, 11, 26, 0, 0, 0, 0, time.UTC)
	var th Throttle
	if _, ok := th.AllowKey(t0, "connection refused"); !ok {
		t.Fatal("first failure held back")
	}
	if _, ok := th.AllowKey(t0.Add(time.Second), "connection refused"); ok {
		t.Fatal("a repeat logged within DefaultEvery")
	}
	if n, ok := th.AllowKey(t0.Add(2*time.Second), "group authorization failed"); !ok || n != 1 {
		t.Fatalf("a new cause: Allow = %d, %v; want it logged at once with 1 held back", n, ok)
	}
	if _, ok := th.AllowKey(t0.Add(3*time.Second), "group authorization failed"); ok {
		t.Fatal("a repeat of the new cause logged within DefaultEvery")
	}
}
