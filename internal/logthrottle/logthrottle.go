// Package logthrottle keeps a failure that repeats on every retry (a
// broker outage, a flush Pebble retries) from flooding the log: the first
// of a run is logged, then one line per interval with the count held back.
package logthrottle

import (
	"sync"
	"time"
)

// DefaultEvery is a Throttle's interval when Every is zero.
const DefaultEvery = 30 * time.Second

// Throttle lets the first of a run of repeated failures through and then
// one per Every, counting those it holds back. The zero value is ready; it
// is safe for concurrent use.
type Throttle struct {
	Every time.Duration // 0: DefaultEvery

	mu         sync.Mutex
	keys       map[string]time.Time // when each failure text was last logged
	suppressed int
}

// Allow reports whether to log now and how many lines were held back
// since the last one.
func (t *Throttle) Allow(now time.Time) (suppressed int, ok bool) {
	return t.AllowKey(now, "")
}

// AllowKey is Allow for a failure described by key (its error text): each
// distinct failure is logged at once and then once per Every, so a new
// cause is not hidden behind the throttle of the previous one, and
// failures that take turns (the servers of a cluster, each with its own
// address in the error) are each throttled.
func (t *Throttle) AllowKey(now time.Time, key string) (suppressed int, ok bool) {
	every := t.Every
	if every <= 0 {
		every = DefaultEvery
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if at, seen := t.keys[key]; seen && now.Sub(at) < every {
		t.suppressed++
		return 0, false
	}
	if t.keys == nil || len(t.keys) >= 64 {
		t.keys = map[string]time.Time{} // bounded: forget older causes
	}
	t.keys[key] = now
	suppressed, t.suppressed = t.suppressed, 0
	return suppressed, true
}

// Reset ends a run of failures: the next one is logged at once.
func (t *Throttle) Reset() {
	t.mu.Lock()
	t.keys, t.suppressed = nil, 0
	t.mu.Unlock()
}
