// Package clock lets time be injected. Production code takes a Clock; tests
// pass a Fake and move it by hand, so no test sleeps on the wall clock.
package clock

import (
	"sync"
	"time"
)

// Clock is the source of wall time and timers.
type Clock interface {
	Now() time.Time
	NewTimer(d time.Duration) Timer
}

// Timer is the subset of *time.Timer the engine uses, and ResetAt.
type Timer interface {
	C() <-chan time.Time
	Stop() bool
	Reset(d time.Duration) bool
	// ResetAt arms the timer to fire when the clock reaches at. Unlike
	// Reset with a duration the caller worked out from an earlier Now,
	// it cannot fire late when the clock moved in between: a fake clock
	// advanced by a test between that Now and the Reset pushed the
	// deadline past the time the caller meant, and a test that waits for
	// the fire before it advances again waited forever.
	ResetAt(at time.Time) bool
}

// Real is the system clock.
type Real struct{}

// Now returns time.Now().
func (Real) Now() time.Time { return time.Now() }

// NewTimer returns a system timer.
func (Real) NewTimer(d time.Duration) Timer { return realTimer{time.NewTimer(d)} }

type realTimer struct{ t *time.Timer }

func (r realTimer) C() <-chan time.Time        { return r.t.C }
func (r realTimer) Stop() bool                 { return r.t.Stop() }
func (r realTimer) Reset(d time.Duration) bool { return r.t.Reset(d) }

// ResetAt resets the timer to the wall time left until at.
func (r realTimer) ResetAt(at time.Time) bool { return r.t.Reset(time.Until(at)) }

// Fake is a manually driven clock. Timers fire when Advance or Set moves the
// time to or past their deadline. Safe for concurrent use.
type Fake struct {
	mu     sync.Mutex
	now    time.Time
	timers []*fakeTimer
}

// NewFake returns a Fake clock set to t.
func NewFake(t time.Time) *Fake { return &Fake{now: t} }

// Now returns the fake time.
func (f *Fake) Now() time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.now
}

// Advance moves the clock forward by d and fires due timers.
func (f *Fake) Advance(d time.Duration) {
	f.mu.Lock()
	f.now = f.now.Add(d)
	f.fireLocked()
	f.mu.Unlock()
}

// Set moves the clock to t, forward or back (a wall-clock step), and fires
// due timers. A step back moves the armed timers' deadlines back with it,
// as the monotonic clock real timers run on does not step: each still
// fires after the rest of its duration. (A step forward fires what it
// passes, as a test wants of a jump in time.)
func (f *Fake) Set(t time.Time) {
	f.mu.Lock()
	if back := t.Sub(f.now); back < 0 {
		for _, tm := range f.timers {
			if tm.armed {
				tm.at = tm.at.Add(back)
			}
		}
	}
	f.now = t
	f.fireLocked()
	f.mu.Unlock()
}

// Deadlines returns the deadlines of the armed timers, for a test's
// failure message.
func (f *Fake) Deadlines() []time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []time.Time
	for _, t := range f.timers {
		if t.armed {
			out = append(out, t.at)
		}
	}
	return out
}

// Timers returns the number of armed timers, so a test can wait until the
// code under test is parked on one.
func (f *Fake) Timers() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, t := range f.timers {
		if t.armed {
			n++
		}
	}
	return n
}

func (f *Fake) fireLocked() {
	kept := f.timers[:0]
	for _, t := range f.timers {
		if !t.armed {
			t.listed = false
			continue
		}
		if !t.at.After(f.now) {
			t.armed, t.listed = false, false
			select {
			case t.c <- f.now:
			default:
			}
			continue
		}
		kept = append(kept, t)
	}
	for i := len(kept); i < len(f.timers); i++ {
		f.timers[i] = nil
	}
	f.timers = kept
}

// NewTimer returns a timer that fires when the fake time reaches now+d.
func (f *Fake) NewTimer(d time.Duration) Timer {
	t := &fakeTimer{f: f, c: make(chan time.Time, 1)}
	t.Reset(d)
	return t
}

type fakeTimer struct {
	f     *Fake
	c     chan time.Time
	at    time.Time
	armed bool
	// listed: in f.timers. A stopped timer stays listed until the next
	// fireLocked drops it, so one armed again before that is listed
	// already.
	listed bool
}

func (t *fakeTimer) C() <-chan time.Time { return t.c }

// Deadliner is a Timer that tells when it fires: a fake clock's, so a
// test can tell that the code under test is parked on it.
type Deadliner interface {
	// Deadline returns when the timer fires, ok false if it is not
	// armed (stopped, or fired).
	Deadline() (at time.Time, ok bool)
}

// Deadline implements Deadliner.
func (t *fakeTimer) Deadline() (time.Time, bool) {
	t.f.mu.Lock()
	defer t.f.mu.Unlock()
	return t.at, t.armed
}

func (t *fakeTimer) Stop() bool {
	t.f.mu.Lock()
	defer t.f.mu.Unlock()
	was := t.armed
	t.armed = false
	return was
}

func (t *fakeTimer) Reset(d time.Duration) bool {
	t.f.mu.Lock()
	defer t.f.mu.Unlock()
	return t.armLocked(t.f.now.Add(d))
}

// ResetAt arms the timer for the fake time at; one already past fires at
// once.
func (t *fakeTimer) ResetAt(at time.Time) bool {
	t.f.mu.Lock()
	defer t.f.mu.Unlock()
	return t.armLocked(at)
}

func (t *fakeTimer) armLocked(at time.Time) bool {
	was := t.armed
	t.at = at
	if !t.listed {
		t.f.timers = append(t.f.timers, t)
		t.listed = true
	}
	t.armed = true
	t.f.fireLocked()
	return was
}
