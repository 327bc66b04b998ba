package shard

import (
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// TestSweepStalledReadHoldsNoShard: the sweep of expired cancel markers
// reads their expiry keys and index entries from the disk before it takes
// the shard's lock. While those reads are held by a disk that stopped
// answering them, Err (readiness) answers and an Ingest into the shard
// returns; once the reads go on, every marker is swept. The sweep used to
// make its first reads of the disk under the lock: Err and Ingest waited
// for them.
func TestSweepStalledReadHoldsNoShard(t *testing.T) {
	h, st := stallingShard(t, func(o *Options) { o.CancelRetention = time.Hour })
	// Markers of ids spread over the index (in many blocks), each batch
	// expiring a ms after the one before.
	const markers = 5000
	for i := range markers / 100 {
		var batch []codec.Task
		for j := range 100 {
			n := int64(i*100 + j + 1)
			batch = append(batch, cancelTask(spreadID(n), n))
		}
		h.ingest(batch)
		h.clk.Advance(time.Millisecond)
	}
	flushTables(t, h.e)
	h.run()

	st.On()
	h.clk.Advance(2 * time.Hour) // every marker expired: the fire loop sweeps
	// The deadlines only turn a hang into a failure.
	deadline := time.After(10 * time.Second)
	select {
	case <-st.Held():
	case <-deadline:
		t.Fatal("the sweep did not read the disk")
	}
	shardAnswers(t, deadline, h, "the sweep's read", sched("new", h.clk.Now().Add(time.Hour), markers+1))

	st.Release()
	h.settle()
	if n := countPrefix(t, h.e, prefixExpiry); n != 0 {
		t.Fatalf("%d expiry keys left after the sweep, want 0", n)
	}
	if n := countPrefix(t, h.e, prefixIndex); n != 1 {
		t.Fatalf("%d index entries after the sweep, want 1 (the new task's)", n)
	}
}
