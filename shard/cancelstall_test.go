package shard

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/faultfs"
)

// TestCancelStalledReadHoldsNoShard: Engine.Cancel reads the task's index
// entry from the disk before it takes the shard's lock. While that read is
// held by a disk that stopped answering reads, Err (readiness) answers and
// an Ingest into the shard returns; once it goes on, the task is
// cancelled. Cancel used to make its read under the lock: Err and Ingest
// waited for it.
func TestCancelStalledReadHoldsNoShard(t *testing.T) {
	st := faultfs.StallReads(".sst")
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.FS = errorfs.Wrap(vfs.Default, st)
		o.filterMinKeys = 1 << 20 // no rebuild, whose scan would read the disk
	})
	t.Cleanup(st.Release) // before the harness closes
	waitFilterBuilds(t, h.e, 1)
	// Ids spread over the index, in many blocks.
	const tasks = 5000
	for i := range tasks / 500 {
		var batch []codec.Task
		for j := range 500 {
			n := int64(i*500 + j + 1)
			batch = append(batch, sched(spreadID(n), t0.Add(time.Hour), n))
		}
		h.ingest(batch)
	}
	flushTables(t, h.e)
	h.run()

	st.On()
	cancelled := make(chan error, 1)
	go func() { cancelled <- h.e.Cancel("src", spreadID(tasks/2)) }()
	// The deadlines only turn a hang into a failure.
	deadline := time.After(10 * time.Second)
	select {
	case <-st.Held():
	case err := <-cancelled:
		t.Fatalf("Cancel returned (%v) without reading the disk", err)
	case <-deadline:
		t.Fatal("Cancel did not read the disk")
	}
	answered := make(chan error, 1)
	go func() { answered <- h.e.Err() }()
	select {
	case err := <-answered:
		if err != nil {
			t.Fatalf("Err() = %v", err)
		}
	case <-deadline:
		t.Fatal("Err() did not return while Cancel's read was stalled")
	}
	ingested := make(chan error, 1)
	go func() {
		ingested <- h.e.Ingest(context.Background(), []codec.Task{sched("new", t0.Add(time.Hour), tasks+1)}, nil)
	}()
	select {
	case err := <-ingested:
		if err != nil {
			t.Fatal(err)
		}
	case <-deadline:
		t.Fatal("Ingest did not return while Cancel's read was stalled")
	}

	st.Release()
	if err := <-cancelled; err != nil {
		t.Fatalf("Cancel: %v", err)
	}
	if _, err := h.e.Lookup("src", spreadID(tasks/2)); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Lookup of the cancelled task: %v, want ErrNotFound", err)
	}
	if st := h.e.Stats(); st.Pending != tasks {
		t.Fatalf("%d pending, want %d (one cancelled, one new)", st.Pending, tasks)
	}
}

// spreadID is the id of the n-th of many tasks, spread over the index by
// a hash, as real ids are.
func spreadID(n int64) string { return fmt.Sprintf("c%016x", xxhash.Sum64String(fmt.Sprint(n))) }

// flushTables flushes the memtable to a table whose blocks are not cached
// and waits for Pebble's own reads of it (its statistics), so that a
// stalled read after it is the engine's.
func flushTables(t *testing.T, e *Engine) {
	t.Helper()
	if err := e.db.Flush(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second) // only turns a hang into a failure
	for m := e.db.Metrics(); !m.Table.InitialStatsCollectionComplete || m.Table.PendingStatsCollectionCount > 0; m = e.db.Metrics() {
		if time.Now().After(deadline) {
			t.Fatal("Pebble did not collect the new table's statistics")
		}
		time.Sleep(time.Millisecond)
	}
}
