package shard

import (
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"

	"github.com/delaybridge/delaybridge/codec"
)

// TestReleaseBeyondByteBudget: a release claims a group's waiting tasks
// by count; those past the round's byte budget (FireBatchBytes) go back
// to the wheel. They must stay released (taken next round), not wait
// out their own retry (up to Retry.Max) as if no release had happened.
func TestReleaseBeyondByteBudget(t *testing.T) {
	for _, tc := range []struct {
		name    string
		horizon time.Duration
	}{
		{"in the wheel", 0},
		{"past the horizon", time.Minute},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, func(o *Options) {
				o.Shards = 1
				o.Retry = defaultLikeRetry
				o.Horizon = tc.horizon
				o.FireBatchBytes = 8 << 10 // about 7 of the 1 KiB tasks a round
			})
			down := fmt.Errorf("broker down: %w", ErrUnavailable)
			h.sink.setFail(func(*codec.Task) error { return down })
			h.run()
			const n = 40
			tasks := dueAtT0(n)
			for i := range tasks {
				tasks[i].Value = []byte(strings.Repeat("v", 1024))
			}
			h.ingest(tasks)
			for range 30 { // the outage, a minute at a time
				h.advance(time.Minute)
			}
			steps := h.backUntilFirstDelivery()
			for range 10 {
				h.advance(time.Second)
			}
			if got := len(h.sink.acked()); got != n {
				t.Fatalf("%d of %d tasks delivered 10 s after the first one was, %ds after the broker came back; want all (released)", got, n, steps)
			}
			h.checkPending()
		})
	}
}

// TestReleaseMeetsUndurableRetry: a batch fails as unavailable at the
// very end of an outage, and the next delivery to the target, moments
// later, releases the group before that batch's retries are durable (the
// lane's next batch does not wait for the previous one's fsync). The
// release skips them ("not in the wheel yet") and consumes the group's
// outage: they waited out their own backoff (up to Retry.Max) with the
// target back (review R174: 3m43s). They stay queued until durable.
func TestReleaseMeetsUndurableRetry(t *testing.T) {
	var block atomic.Bool
	gate := make(chan struct{})
	inj := errorfs.InjectorFunc(func(op errorfs.Op) error {
		if block.Load() && strings.HasSuffix(op.Path, ".log") {
			switch op.Kind {
			case errorfs.OpFileSync, errorfs.OpFileSyncData, errorfs.OpFileSyncTo:
				<-gate
			}
		}
		return nil
	})
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.Retry = RetryPolicy{Initial: 500 * time.Millisecond, Max: 5 * time.Minute, Multiplier: 2, Jitter: -1, MaxAttempts: 10}
		o.FS = errorfs.Wrap(vfs.Default, inj)
	})
	var releases atomic.Int32
	h.e.testHookRelease = func([]int64) { releases.Add(1) }
	down := fmt.Errorf("broker down: %w", ErrUnavailable)
	h.sink.setFail(func(*codec.Task) error { return down })
	h.run()
	h.ingest([]codec.Task{sched("a", t0, 1)})
	h.advance(30 * time.Second)
	h.ingest([]codec.Task{sched("b", t0.Add(30*time.Second), 2)})
	for range 20 * 60 / 7 { // the outage
		h.advance(7 * time.Second)
	}
	s := h.e.shards[0]
	s.mu.Lock()
	la, lb := s.late[1], s.late[2]
	s.mu.Unlock()
	if la.fire == lb.fire || la.group() == 0 || lb.group() == 0 {
		t.Fatalf("a at %d group %d, b at %d group %d: want two retries apart", la.fire, la.group(), lb.fire, lb.group())
	}
	type waiting struct {
		id  string
		seq uint64
		lt  lateTask
	}
	first, second := waiting{"a", 1, la}, waiting{"b", 2, lb}
	if lb.fire < la.fire {
		first, second = second, first
	}
	// The first retry fails, its retry not durable yet.
	block.Store(true)
	h.clk.Set(time.UnixMilli(first.lt.fire))
	eventuallyTrue(t, first.id+" failed again", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		lt, ok := s.late[first.seq]
		return ok && lt.fire > first.lt.fire && !s.lanes[transportSlot(codec.TransportKafka)].busy
	})
	// The broker is back: the second retry is delivered and releases
	// the group.
	h.sink.setFail(nil)
	h.clk.Set(time.UnixMilli(second.lt.fire))
	eventuallyTrue(t, second.id+" delivered", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return h.sink.deliveriesOf(second.id) > 0 && !s.lanes[transportSlot(codec.TransportKafka)].busy && releases.Load() > 0
	})
	block.Store(false)
	close(gate)
	h.settle()
	for range 30 {
		h.advance(time.Second)
	}
	if n := len(h.sink.acked()); n != 2 {
		s.mu.Lock()
		lt := s.late[first.seq]
		s.mu.Unlock()
		t.Fatalf("%d delivered 30 s after the release (%d releases); %s waits for its retry %v after the release, with its target back",
			n, releases.Load(), first.id, time.Duration(lt.fire-second.lt.fire)*time.Millisecond)
	}
}

// TestReleaseThenStragglerFailure: a produce that began while the broker
// was down fails only after another shard's delivery released the group
// (kafka-go retries a produce for seconds). Its outcome marks the group
// down again, as a flapping one, and nothing waited for the group any
// more to release it: the task waited out its own backoff (up to
// Retry.Max) with the target back (review R174). It is tried again within
// Retry.Initial (TestFailureBegunBeforeReleaseRetriedSoon).
func TestReleaseThenStragglerFailure(t *testing.T) {
	h := newHarness(t, func(o *Options) {
		o.Shards = 2
		o.Retry = RetryPolicy{Initial: 500 * time.Millisecond, Max: 5 * time.Minute, Multiplier: 2, Jitter: -1, MaxAttempts: 10}
	})
	var releases atomic.Int32
	h.e.testHookRelease = func([]int64) { releases.Add(1) }
	ids := [2]string{}
	for i := 0; ids[0] == "" || ids[1] == ""; i++ {
		id := fmt.Sprintf("x%d", i)
		if sh := h.e.shardOf("src", id); ids[sh] == "" {
			ids[sh] = id
		}
	}
	sink, down := h.runGatedDown()
	h.ingest([]codec.Task{sched(ids[0], t0, 1)})
	h.advance(30 * time.Second)
	h.ingest([]codec.Task{sched(ids[1], t0.Add(30*time.Second), 2)})
	for range 20 * 60 / 7 {
		h.advance(7 * time.Second)
	}
	fire := func(sh int) int64 {
		s := h.e.shards[sh]
		s.mu.Lock()
		defer s.mu.Unlock()
		for _, lt := range s.late {
			return lt.fire
		}
		t.Fatalf("shard %d: nothing waiting", sh)
		return 0
	}
	f0, f1 := fire(0), fire(1)
	a, b, fa, fb := ids[0], ids[1], f0, f1
	if f1 < f0 {
		a, b, fa, fb = ids[1], ids[0], f1, f0
	}
	if fa == fb {
		t.Fatal("same retry time")
	}
	sink.gate.Store(&a)
	h.clk.Set(time.UnixMilli(fa))
	<-sink.entered // a's produce started while the broker was down...
	h.sink.setFail(func(t *codec.Task) error {
		if t.ID == a {
			return down // ...and fails after it is back
		}
		return nil
	})
	h.clk.Set(time.UnixMilli(fb))
	eventuallyTrue(t, b+" delivered", func() bool { return len(h.sink.acked()) == 1 && releases.Load() > 0 })
	close(sink.release)
	h.settle()
	h.sink.setFail(nil)
	for range 30 {
		h.advance(time.Second)
	}
	if n := len(h.sink.acked()); n != 2 {
		t.Fatalf("%s not delivered 30 s after the release (%d releases), its produce failed once just after the broker's return", a, releases.Load())
	}
}
