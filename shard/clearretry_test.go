package shard

import (
	"bytes"
	"errors"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"

	"github.com/delaybridge/delaybridge/codec"
)

// TestClearOrdersRetryDecidedMeanwhile: a fire commit decided after a
// range deletion of fired tombstones was decided, and before the deletion
// is applied, applies after it. After a clock step back the retry it
// stores lands below the range's end (the key of the task being
// published, then the shard's first stored task), and must not be
// deleted with the range: the retry is delivered. (TestClearOrdersBatch-
// DecidedMeanwhile checks the same of Ingest.)
func TestClearOrdersRetryDecidedMeanwhile(t *testing.T) {
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.Horizon = time.Minute
		// The loop goes on while "late" is in the sink, and parks.
		o.LaneGrace = time.Millisecond
	})
	h.run()
	h.ingest([]codec.Task{sched("fired", t0.Add(time.Second), 1)})
	h.advance(2 * time.Second) // a tombstone to clear

	// The first publish of "late" waits in the sink until the clear's
	// look is made, then fails: a retry, at the clock's time then.
	publishing, fail := make(chan struct{}), make(chan struct{})
	var calls atomic.Int32
	h.sink.setFail(func(tk *codec.Task) error {
		if tk.ID != "late" || calls.Add(1) > 1 {
			return nil
		}
		close(publishing)
		<-fail
		return errors.New("refused once")
	})
	h.ingest([]codec.Task{sched("late", t0.Add(20*time.Second), 2)})
	h.clk.Set(t0.Add(20 * time.Second)) // "late" is due (the horizon not yet)
	// The deadlines only turn a hang into a failure.
	select {
	case <-publishing:
	case <-time.After(20 * time.Second):
		t.Fatal("late was not published")
	}

	s := h.e.shards[0]
	var ran atomic.Bool
	errc := make(chan error, 1)
	h.e.testHookClear = func(end []byte) {
		if ran.Swap(true) {
			return
		}
		errc <- func() error {
			// The range ends at late's key, the first stored task.
			if want := appendTaskKey(nil, 0, ms(t0.Add(20*time.Second)), 2); !bytes.Equal(end, want) {
				return errors.New("the range does not end at late's key")
			}
			// NTP steps the clock back: the retry is stored below it.
			h.clk.Set(t0.Add(5 * time.Second))
			close(fail)
			// It waits for the deletion, or, without that order, is
			// applied before it: wait for either.
			for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(time.Millisecond) {
				s.mu.Lock()
				waits := s.clearing != nil && slices.ContainsFunc(s.queue, func(pb *pendingBatch) bool {
					return len(pb.ops) > 0 && slices.Contains(pb.tk.deps, s.clearing)
				})
				s.mu.Unlock()
				if waits || countRange(t, h.e, taskBound(0, 0), end) > 0 {
					return nil
				}
				if time.Now().After(deadline) {
					return errors.New("the retry neither applied nor waited for the range deletion")
				}
			}
		}()
	}
	// The horizon is due to move: the loop clears.
	h.clk.Set(t0.Add(31 * time.Second))
	select {
	case err := <-errc:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("no clear ran")
	}
	eventuallyTrue(t, "the range deletion", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.clears == 1 && len(s.queue) == 0
	})
	h.settle()
	h.advance(time.Minute) // past the retry, however the clock stood
	if got := h.sink.acked(); !slices.Equal(got, []string{"fired", "late"}) {
		t.Fatalf("delivered %v, want [fired late]: the range deletion took the retry decided meanwhile", got)
	}
	h.checkPending()
}

// countRange counts the store's keys in [lo, hi).
func countRange(t testing.TB, e *Engine, lo, hi []byte) int {
	t.Helper()
	it, err := e.db.NewIter(&pebble.IterOptions{LowerBound: lo, UpperBound: hi})
	if err != nil {
		t.Fatal(err)
	}
	defer it.Close()
	n := 0
	for ok := it.First(); ok; ok = it.Next() {
		n++
	}
	return n
}
