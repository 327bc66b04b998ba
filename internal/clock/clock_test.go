package clock

import (
	"testing"
	"time"
)

func TestFakeTimers(t *testing.T) {
	start := time.Date(2026, 11, 22, 0, 0, 0, 0, time.UTC)
	tests := []struct {
		name    string
		after   time.Duration
		advance time.Duration
		fired   bool
	}{
		{"before deadline", 10 * time.Second, 9 * time.Second, false},
		{"at deadline", 10 * time.Second, 10 * time.Second, true},
		{"past deadline", 10 * time.Second, time.Hour, true},
		{"zero duration", 0, 0, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := NewFake(start)
			tm := f.NewTimer(tc.after)
			f.Advance(tc.advance)
			checkFired(t, f, tm, tc.fired)
		})
	}
}

func TestFakeStopResetStepBack(t *testing.T) {
	start := time.Date(2026, 11, 22, 0, 0, 0, 0, time.UTC)
	f := NewFake(start)
	tm := f.NewTimer(time.Minute)
	if f.Timers() != 1 {
		t.Fatalf("armed timers = %d, want 1", f.Timers())
	}
	if !tm.Stop() {
		t.Fatal("Stop of armed timer returned false")
	}
	f.Advance(2 * time.Minute)
	select {
	case <-tm.C():
		t.Fatal("stopped timer fired")
	default:
	}
	tm.Reset(time.Minute)
	f.Set(start) // the wall clock steps back: nothing fires
	select {
	case <-tm.C():
		t.Fatal("timer fired after a step back")
	default:
	}
	f.Set(start.Add(4 * time.Minute))
	select {
	case <-tm.C():
	default:
		t.Fatal("timer did not fire after the clock passed its deadline")
	}
	if got := f.Now(); !got.Equal(start.Add(4 * time.Minute)) {
		t.Fatalf("Now = %v", got)
	}
}

// TestFakeStopResetListedOnce: a timer stopped and armed again while the
// clock stands still (a fire loop woken by a notify, then parked again)
// is one timer, fired once. It was listed again at each arming: a loop
// woken a thousand times a second piled up entries that every arming and
// every move of the clock scans under the clock's lock (TestForgetReviewRace
// saw 9 860 entries for a dozen timers when its settle timed out).
func TestFakeStopResetListedOnce(t *testing.T) {
	start := time.Date(2026, 11, 22, 0, 0, 0, 0, time.UTC)
	f := NewFake(start)
	tm := f.NewTimer(time.Minute)
	for range 1000 {
		tm.Stop()
		tm.Reset(time.Minute)
	}
	if n, d := f.Timers(), len(f.Deadlines()); n != 1 || d != 1 || len(f.timers) != 1 {
		t.Fatalf("one timer stopped and armed again 1000 times: %d armed, %d deadlines, %d listed; want 1 each", n, d, len(f.timers))
	}
	f.Advance(time.Minute)
	checkFired(t, f, tm, true)
	if len(f.timers) != 0 {
		t.Fatalf("%d listed after the only timer fired", len(f.timers))
	}
	// Stopped, then armed again after a move of the clock dropped it.
	tm.Reset(time.Minute)
	tm.Stop()
	f.Advance(time.Second)
	tm.Reset(time.Minute)
	if len(f.timers) != 1 || f.Timers() != 1 {
		t.Fatalf("armed again after being dropped: %d listed, %d armed; want 1", len(f.timers), f.Timers())
	}
	f.Advance(time.Minute)
	checkFired(t, f, tm, true)
}

// ResetAt arms for an absolute time: a clock that moved between the
// caller's Now and the arming does not push the deadline out, as Reset
// with a duration worked out from that Now does.
func TestFakeResetAt(t *testing.T) {
	start := time.Date(2026, 11, 22, 0, 0, 0, 0, time.UTC)
	tests := []struct {
		name    string
		moved   time.Duration // between the caller's Now and the arming
		advance time.Duration // after the arming
		fired   bool
	}{
		{"not yet", 0, 9 * time.Second, false},
		{"at deadline", 0, 10 * time.Second, true},
		{"clock moved, deadline kept", 3 * time.Second, 7 * time.Second, true},
		{"clock moved, before deadline", 3 * time.Second, 6 * time.Second, false},
		{"clock moved past it: fires on arming", 11 * time.Second, 0, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := NewFake(start)
			tm := f.NewTimer(time.Hour)
			at := f.Now().Add(10 * time.Second)
			f.Advance(tc.moved)
			tm.ResetAt(at)
			f.Advance(tc.advance)
			checkFired(t, f, tm, tc.fired)
		})
	}
	// The same race with Reset: the deadline moved out by the step.
	f := NewFake(start)
	tm := f.NewTimer(time.Hour)
	d := start.Add(10 * time.Second).Sub(f.Now())
	f.Advance(3 * time.Second)
	tm.Reset(d)
	f.Advance(7 * time.Second)
	select {
	case <-tm.C():
		t.Fatal("Reset fired at the caller's time: the case above tests nothing")
	default:
	}
}

func TestRealResetAt(t *testing.T) {
	tm := Real{}.NewTimer(time.Hour)
	tm.ResetAt(time.Now().Add(-time.Second)) // past: fires at once
	<-tm.C()
}

// checkFired fails t unless tm fired exactly when want says.
func checkFired(t *testing.T, f *Fake, tm Timer, want bool) {
	t.Helper()
	select {
	case <-tm.C():
		if !want {
			t.Fatal("timer fired early")
		}
	default:
		if want {
			t.Fatalf("timer did not fire at %v (deadlines %v)", f.Now(), f.Deadlines())
		}
	}
}
