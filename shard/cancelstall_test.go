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
	h, st := stallingShard(t, nil)
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
	shardAnswers(t, deadline, h, "Cancel's read", sched("new", t0.Add(time.Hour), tasks+1))

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

// stallingShard opens a one-shard engine on a disk whose reads of tables
// st holds once st.On() (its filter built, and never rebuilt: that scan
// would read the disk); mod adjusts the options further.
func stallingShard(t *testing.T, mod func(*Options)) (*harness, *faultfs.Stall) {
	t.Helper()
	st := faultfs.StallReads(".sst")
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.FS = errorfs.Wrap(vfs.Default, st)
		o.filterMinKeys = 1 << 20
		if mod != nil {
			mod(o)
		}
	})
	t.Cleanup(st.Release) // before the harness closes
	waitFilterBuilds(t, h.e, 1)
	return h, st
}

// shardAnswers checks, while what holds a read of the disk, that Err
// (readiness) answers nil and that an Ingest of task into the shard
// returns, by deadline (which only turns a hang into a failure).
func shardAnswers(t *testing.T, deadline <-chan time.Time, h *harness, what string, task codec.Task) {
	t.Helper()
	answered := make(chan error, 1)
	go func() { answered <- h.e.Err() }()
	select {
	case err := <-answered:
		if err != nil {
			t.Fatalf("Err() = %v", err)
		}
	case <-deadline:
		t.Fatalf("Err() did not return while %s was stalled", what)
	}
	ingested := make(chan error, 1)
	go func() { ingested <- h.e.Ingest(context.Background(), []codec.Task{task}, nil) }()
	select {
	case err := <-ingested:
		if err != nil {
			t.Fatal(err)
		}
	case <-deadline:
		t.Fatalf("Ingest did not return while %s was stalled", what)
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
