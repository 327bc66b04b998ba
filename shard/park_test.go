package shard

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/clock"
)

// TestPark drives a fire loop's park by hand on the fake clock. A wake
// time that has passed (the clock moved on between the loop's look and
// park; or due tasks in the wheel) returns at once, without waiting for the
// clock to move again; with hold, park waits for its own wake time even
// though the wheel holds due tasks (the pause after a failed store read).
func TestPark(t *testing.T) {
	due, soon := t0.Add(time.Second), t0.Add(10*time.Millisecond)
	cases := []struct {
		name     string
		tasks    []codec.Task
		now      time.Time // clock when park is called
		wake     time.Time
		hold     bool
		waitsFor time.Duration // 0: returns at once; else returns once the clock moved this far
	}{
		// Within the wheel's first level, where its next due is exact (the
		// loop passes that as wake).
		{"wake passed while looking", []codec.Task{sched("a", soon, 1)}, soon.Add(10 * time.Second), soon, false, 0},
		{"horizon wake passed, wheel empty", nil, t0.Add(time.Hour), t0.Add(time.Minute), false, 0},
		{"due task before wake", []codec.Task{sched("a", due, 1)}, due, due.Add(time.Minute), false, 0},
		{"nothing due yet", []codec.Task{sched("a", due, 1)}, t0, due.Add(time.Minute), false, time.Second},
		{"hold despite due task", []codec.Task{sched("a", due, 1)}, due, due.Add(time.Second), true, time.Second},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, func(o *Options) { o.Shards = 1 })
			if len(tc.tasks) > 0 {
				h.ingest(tc.tasks)
			}
			h.clk.Set(tc.now)
			s := h.e.shards[0]
			timer := h.e.clk.NewTimer(time.Hour)
			defer timer.Stop()
			done := make(chan struct{})
			go func() {
				defer close(done)
				s.park(context.Background(), timer, ms(tc.wake), tc.hold)
			}()
			// The deadlines only turn a hang into a failure.
			if tc.waitsFor == 0 {
				select {
				case <-done:
				case <-time.After(20 * time.Second):
					t.Fatal("park waited although its wake time had come")
				}
				return
			}
			for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Microsecond) {
				s.mu.Lock()
				parked := s.parked
				s.mu.Unlock()
				if parked {
					break
				}
				select {
				case <-done:
					t.Fatal("park returned before its wake time")
				default:
				}
				if time.Now().After(deadline) {
					t.Fatal("park neither parked nor returned")
				}
			}
			h.clk.Advance(tc.waitsFor)
			select {
			case <-done:
			case <-time.After(20 * time.Second):
				t.Fatal("park did not return when the clock reached its wake time")
			}
		})
	}
}

// monoClock is clock.Real's two clocks apart: Now is the wall clock, the
// timers run on a monotonic one. Step moves the wall clock only (an NTP
// step, a VM resumed from suspend); Advance moves both.
type monoClock struct {
	mono *clock.Fake
	mu   sync.Mutex
	off  time.Duration
}

func (c *monoClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.mono.Now().Add(c.off)
}

func (c *monoClock) NewTimer(d time.Duration) clock.Timer { return c.mono.NewTimer(d) }

func (c *monoClock) Step(d time.Duration) {
	c.mu.Lock()
	c.off += d
	c.mu.Unlock()
}

func (c *monoClock) Advance(d time.Duration) { c.mono.Advance(d) }

// TestWallStepForwardWhileParked: a fire loop parked until its next due
// sees the wall clock step forward within a second of monotonic time, and
// fires what the wall clock says is due; before, it slept on until its
// monotonic timer ended (up to horizon/2: 30 min here).
func TestWallStepForwardWhileParked(t *testing.T) {
	mc := &monoClock{mono: clock.NewFake(t0)}
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.Clock = mc
		o.Horizon = time.Hour
	})
	h.run()
	h.ingest([]codec.Task{sched("a", t0.Add(20*time.Minute), 1)})
	mc.Step(time.Hour) // "a" is 40 minutes overdue by the wall clock
	mc.Advance(maxPark)
	h.settle()
	if got := h.sink.acked(); !slices.Equal(got, []string{"a"}) {
		t.Fatalf("delivered %v a second after the wall clock passed a's due by 40 minutes, want a", got)
	}
}

// TestParkSeesHeldReleaseOfReturnedLane: the loop computes its wake time
// while a lane has a batch in the sink (nextReleaseLocked skips a busy
// lane, so that lane's held release is not in it); the batch returns
// before the loop is in park (busy cleared, then a wake-up), and park
// drains that wake-up as stale. park must still see that the returned
// lane may release held tasks now and return, not sleep until maxPark
// (found by a hunt: one such stall per lost wake-up, up to 1 s each).
// The two goroutines' steps are played by hand, as they run.
func TestParkSeesHeldReleaseOfReturnedLane(t *testing.T) {
	h := holdHarness(t, -1)
	var batch []codec.Task
	for i := range 4 {
		batch = append(batch, sched(fmt.Sprintf("t%d", i), t0.Add(time.Second), int64(i+1)))
	}
	holdTasks(t, h, batch, 4)
	h.stop()
	h.sink.setFail(nil)
	h.clk.Advance(20 * time.Second) // past every held group's backoff
	s := h.e.shards[0]
	l := transportSlot(codec.TransportKafka)

	// The loop looks while the lane is busy.
	s.mu.Lock()
	if !s.releasableLocked(l, h.e.nowMs()) {
		s.mu.Unlock()
		t.Fatal("setup: no held release due")
	}
	s.lanes[l].busy = true
	wake := s.horizonEnd - s.e.horizonMs()/2
	if at, ok := s.nextReleaseLocked(); ok && at < wake {
		wake = at
	}
	s.mu.Unlock()
	// The lane's batch returns (lane.go) before the loop parks.
	s.mu.Lock()
	s.lanes[l].busy, s.parked = false, false
	s.mu.Unlock()
	s.wake()

	timer := h.e.clk.NewTimer(time.Hour)
	defer timer.Stop()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.park(ctx, timer, wake, false)
	}()
	for {
		select {
		case <-done:
			return
		default:
		}
		s.mu.Lock()
		asleep := s.parked
		s.mu.Unlock()
		if asleep {
			cancel()
			<-done
			t.Fatalf("park went to sleep (wake %v ahead) although the returned lane may release held tasks now",
				time.Duration(wake-h.e.nowMs())*time.Millisecond)
		}
		time.Sleep(time.Millisecond)
	}
}
