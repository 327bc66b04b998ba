package shard

import (
	"bytes"
	"context"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// TestClearHoldsNoIngestDueLater: a range deletion of fired tombstones
// looks for the shard's first stored task (stepping over the tombstones,
// which a slow disk may take long to read) and deletes (waiting through a
// write stall) without the shard's lock. An Ingest decided meanwhile of a
// task due later than the range can reach (it ends at now at the latest)
// does not wait for it: it returns while the clear is held on its way
// (testHookClear), and the clear is made after. Every Ingest into the
// shard used to apply after the clear, so it waited as long, and with it
// the source that called it.
func TestClearHoldsNoIngestDueLater(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.Shards = 1; o.Horizon = time.Minute })
	h.run()
	h.ingest([]codec.Task{sched("fired", t0.Add(time.Second), 1)})
	h.advance(2 * time.Second) // a tombstone to clear

	s := h.e.shards[0]
	inClear, resume := make(chan struct{}), make(chan struct{})
	var ran atomic.Bool
	h.e.testHookClear = func([]byte) {
		if !ran.Swap(true) {
			close(inClear)
			<-resume
		}
	}
	var once sync.Once
	release := func() { once.Do(func() { close(resume) }) }
	t.Cleanup(release) // before the harness closes

	h.clk.Advance(30 * time.Second) // the horizon is due to move: the loop clears
	// The deadlines only turn a hang into a failure.
	select {
	case <-inClear:
	case <-time.After(20 * time.Second):
		t.Fatal("the fire loop made no range deletion")
	}
	ingested := make(chan error, 1)
	go func() {
		ingested <- h.e.Ingest(context.Background(), []codec.Task{sched("later", h.clk.Now().Add(time.Hour), 2)}, nil)
	}()
	select {
	case err := <-ingested:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("Ingest of a task due in an hour did not return while a range deletion was on its way")
	}
	s.mu.Lock()
	clears := s.clears
	s.mu.Unlock()
	if clears != 0 {
		t.Fatalf("%d range deletions made while the hook held the clear: the test tests nothing", clears)
	}

	release()
	eventuallyTrue(t, "the range deletion", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.clears == 1
	})
	h.settle()
	if n := countTaskKeys(t, h.e); n != 1 {
		t.Fatalf("%d tasks stored, want 1 (later)", n)
	}
	h.checkPending()
	if _, err := h.e.Lookup("src", "later"); err != nil {
		t.Fatalf("Lookup(later): %v", err)
	}
	h.advance(time.Hour)
	if got := h.sink.acked(); len(got) != 2 || got[1] != "later" {
		t.Fatalf("delivered %v, want [fired later]", got)
	}
}

// TestTaskKeyBeforeMatchesKeys: taskKeyBefore, which decides whether a
// batch waits for a range deletion decided with end, orders as the store's
// keys do (end.seq 0: taskBound at end.fire, as clearFired ends a range
// at now), negative fire times included.
func TestTaskKeyBeforeMatchesKeys(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	pick := func() int64 { return int64(r.IntN(7)) - 2 }
	for range 20000 {
		fire, seq := pick(), uint64(r.IntN(3))
		end := wheelOp{fire: pick(), seq: uint64(r.IntN(3))}
		endKey := taskBound(0, end.fire)
		if end.seq != 0 {
			endKey = appendTaskKey(nil, 0, end.fire, end.seq)
		}
		want := bytes.Compare(appendTaskKey(nil, 0, fire, seq), endKey) < 0
		if got := taskKeyBefore(fire, seq, end); got != want {
			t.Fatalf("taskKeyBefore(%d, %d, %+v) = %v, keys say %v", fire, seq, end, got, want)
		}
	}
}
