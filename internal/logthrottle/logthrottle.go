// Package logthrottle keeps a failure that repeats on every retry (a
// broker outage, a flush Pebble retries) from flooding the log: the first
// of a run is logged, then one line per interval with the count held back.
package logthrottle

import (
	"sync"
	"time"

	"go.uber.org/zap"
)

// Forgotten is the field of a throttled line that counts the lines held
// back for keys its throttle forgot before their next line
// (AllowEachForgotten): held_back_forgotten, or no field when there were
// none.
func Forgotten(n int) zap.Field {
	if n <= 0 {
		return zap.Skip()
	}
	return zap.Int("held_back_forgotten", n)
}

// DefaultEvery is a Throttle's interval when Every is zero.
const DefaultEvery = 30 * time.Second

// Throttle lets the first of a run of repeated failures through and then
// one per Every, counting those it holds back. The zero value is ready; it
// is safe for concurrent use.
type Throttle struct {
	Every time.Duration // 0: DefaultEvery

	mu         sync.Mutex
	keys       map[string]*keyState
	suppressed int // held back since the last line, all keys
	forgotten  int // held back for keys forgotten before their next line (AllowEach)
}

// keyState is a key's last line and the lines held back since.
type keyState struct {
	at   time.Time
	held int
}

// maxKeys bounds the keys a Throttle remembers. Past it, the keys not
// logged within Every are forgotten (their held-back counts kept in one
// sum, see AllowEachForgotten); if all are recent, further new keys
// share one overflow entry (one line per Every for all of them) rather
// than wiping the others, which would let every line through (review
// R141: a publisher naming 100 refusing targets).
const maxKeys = 64

const overflowKey = "\x00overflow"

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
	t.mu.Lock()
	defer t.mu.Unlock()
	k, ok := t.allowLocked(now, key)
	if !ok {
		t.suppressed++
		return 0, false
	}
	k.held = 0
	suppressed, t.suppressed = t.suppressed, 0
	return suppressed, true
}

// AllowEach is AllowKey with the count of lines held back for key alone
// (or, past maxKeys, for the keys that share the overflow entry), for a
// line that names what key stands for (a target): another key's count
// would be read as its own.
//
// A key forgotten to make room for others (not logged within Every)
// takes its count with it: AllowEachForgotten reports those counts.
func (t *Throttle) AllowEach(now time.Time, key string) (suppressed int, ok bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.allowEachLocked(now, key)
}

// AllowEachForgotten is AllowEach that also returns, with a line, the
// lines held back for keys forgotten since the last such line before
// their next line came (the key was not seen within Every and maxKeys
// others took its place): their count in no key's line, to log beside
// the key's own (review F211: a key forgotten with a held-back count
// came back with 0, its held lines never reported). The forgetting call
// usually is the line itself: a new key, logged at once.
func (t *Throttle) AllowEachForgotten(now time.Time, key string) (held, forgotten int, ok bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	held, ok = t.allowEachLocked(now, key)
	if !ok {
		return 0, 0, false
	}
	forgotten, t.forgotten = t.forgotten, 0
	return held, forgotten, true
}

func (t *Throttle) allowEachLocked(now time.Time, key string) (held int, ok bool) {
	k, ok := t.allowLocked(now, key)
	if !ok {
		k.held++
		return 0, false
	}
	held, k.held = k.held, 0
	return held, true
}

// allowLocked returns key's state (the overflow entry's once maxKeys
// recent keys are held) and whether a line is due, noting it if so.
func (t *Throttle) allowLocked(now time.Time, key string) (*keyState, bool) {
	every := t.Every
	if every <= 0 {
		every = DefaultEvery
	}
	if t.keys == nil {
		t.keys = map[string]*keyState{}
	}
	if _, seen := t.keys[key]; !seen && len(t.keys) >= maxKeys {
		for k, st := range t.keys {
			if now.Sub(st.at) >= every {
				t.forgotten += st.held
				delete(t.keys, k)
			}
		}
		if len(t.keys) >= maxKeys {
			key = overflowKey
		}
	}
	k, seen := t.keys[key]
	if !seen {
		k = &keyState{}
		t.keys[key] = k
	}
	if seen && now.Sub(k.at) < every {
		return k, false
	}
	k.at = now
	return k, true
}

// Reset ends a run of failures: the next one is logged at once.
func (t *Throttle) Reset() {
	t.mu.Lock()
	t.keys, t.suppressed, t.forgotten = nil, 0, 0
	t.mu.Unlock()
}

// Shape is s with each run of digits as one '#': the key of a failure
// whose text names a number that changes from one try or partition to the
// next (an offset, a batch size, a port), so that its repeats are one
// failure to throttle.
func Shape(s string) string {
	b := make([]byte, 0, len(s))
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < '0' || c > '9' {
			b = append(b, c)
			continue
		}
		if i == 0 || s[i-1] < '0' || s[i-1] > '9' {
			b = append(b, '#') // the first digit of a run
		}
	}
	return string(b)
}

// Episode decides the end line of a run of throttled failures ("batches
// stored again" after "handle failed"), for failures that come and go by
// turns (a store hovering at its free-space reserve, a flapping leader).
// The end line is logged at once when a failure line was logged since the
// last end line, so a failure line is always followed by an end line once
// the failures stop; a run whose failure lines were all held back (it
// began within the failure throttle's interval) counts as logged too, but
// its end is itself throttled: one per Every, with the count held back.
// The failure throttle is not reset by the end line (review R210: a
// Reset there let a failure and an end line through at every turn of a
// flapping cause, 200 lines for 100 turns in 10 s). The zero value is
// ready; it is safe for concurrent use.
type Episode struct {
	Every time.Duration // 0: DefaultEvery

	mu      sync.Mutex
	pending bool      // a failure line was logged, its end line not yet
	last    time.Time // the last end line
	held    int       // end lines held back since the last one
}

// Logged notes that a failure line was logged: the next End is let
// through.
func (e *Episode) Logged() {
	e.mu.Lock()
	e.pending = true
	e.mu.Unlock()
}

// End reports whether to log the end of a run of failures at now and how
// many end lines were held back since the last one.
func (e *Episode) End(now time.Time) (held int, ok bool) {
	every := e.Every
	if every <= 0 {
		every = DefaultEvery
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if !e.pending && !e.last.IsZero() && now.Sub(e.last) < every {
		e.held++
		return 0, false
	}
	held, e.held = e.held, 0
	e.pending, e.last = false, now
	return held, true
}

// Owed reports whether the end lines held back are owed at now, their
// interval over: the caller logs its end line on its next success, after
// the failures stopped, standing for the last of them, with held the
// count held back before it (as End's held). Without it a second short
// outage within the interval of a logged one showed nowhere: its failure
// and end lines were held back and their counts waited for a next line
// of the same kind that might never come (review R212). Cheap while
// nothing is held back: callers call it on every success.
func (e *Episode) Owed(now time.Time) (held int, ok bool) {
	every := e.Every
	if every <= 0 {
		every = DefaultEvery
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.held == 0 || now.Sub(e.last) < every {
		return 0, false
	}
	held, e.held = e.held-1, 0
	e.last = now
	return held, true
}
