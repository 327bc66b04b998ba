package shard

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/faultfs"
)

// TestLookupStalledReadHoldsNoShard: Lookup reads the store without its
// shard's lock. While its read of the task's envelope (in a blob file,
// past a flush) is held by a disk that stopped answering reads, an
// Ingest into that shard returns and the shard's fire loop delivers a due
// task of it; once the read goes on, Lookup answers as before. Lookup
// used to read under the lock: the Ingest waited for the disk, holding
// ingestMu (every other Ingest) and the locks of the shards before it
// (their fire loops), and so did this shard's fire loop.
func TestLookupStalledReadHoldsNoShard(t *testing.T) {
	stalledReadHoldsNoShard(t, "Lookup", func(e *Engine) (any, error) { return e.Lookup("src", "a") },
		func(got any, a *codec.Task, sh int) bool {
			info := got.(TaskInfo)
			return info.Due.Equal(t0.Add(time.Hour)) && info.Shard == sh && info.Target == a.Destination()
		})
}

// TestListStalledReadHoldsNoShard: ListTasks reads the store without any
// shard lock, as Lookup does; once the read goes on, the page lists the
// task.
func TestListStalledReadHoldsNoShard(t *testing.T) {
	stalledReadHoldsNoShard(t, "ListTasks", func(e *Engine) (any, error) { return e.ListTasks("src", ListQuery{Prefix: "a"}) },
		func(got any, a *codec.Task, sh int) bool {
			l := got.(TaskList)
			return len(l.Tasks) == 1 && l.Tasks[0].ID == "a" && l.Tasks[0].Shard == sh && l.Tasks[0].Target == a.Destination()
		})
}

// stalledReadHoldsNoShard runs read (named op) of task "a" of source
// "src", due in an hour, while the disk holds its read of the task's
// envelope: an Ingest into a's shard must return and the shard's fire
// loop deliver a due task meanwhile, and once the read goes on, ok must
// accept what read returned.
func stalledReadHoldsNoShard(t *testing.T, op string, read func(*Engine) (any, error), ok func(got any, a *codec.Task, sh int) bool) {
	t.Helper()
	st := faultfs.StallReads(".blob")
	h := newHarness(t, func(o *Options) { o.FS = errorfs.Wrap(vfs.Default, st) })
	t.Cleanup(st.Release) // before the harness closes
	a := sched("a", t0.Add(time.Hour), 1)
	a.Value = bytes.Repeat([]byte("v"), 1024) // a blob once flushed
	h.ingest([]codec.Task{a})
	if err := h.e.db.Flush(); err != nil {
		t.Fatal(err)
	}
	h.run()
	sh := h.e.shardOf("src", "a")
	id := ""
	for i := 0; id == ""; i++ {
		if c := fmt.Sprintf("b%d", i); h.e.shardOf("src", c) == sh {
			id = c
		}
	}

	st.On()
	type result struct {
		got any
		err error
	}
	done := make(chan result, 1)
	go func() {
		got, err := read(h.e)
		done <- result{got, err}
	}()
	// The deadlines only turn a hang into a failure.
	deadline := time.After(10 * time.Second)
	select {
	case <-st.Held():
	case r := <-done:
		t.Fatalf("%s returned (%+v, %v) without reading the blob file", op, r.got, r.err)
	case <-deadline:
		t.Fatalf("%s did not read the blob file", op)
	}
	ingested := make(chan error, 1)
	go func() { ingested <- h.e.Ingest(context.Background(), []codec.Task{sched(id, t0, 2)}, nil) }()
	select {
	case err := <-ingested:
		if err != nil {
			t.Fatal(err)
		}
	case <-deadline:
		t.Fatalf("Ingest into shard %d did not return while a %s read was stalled", sh, op)
	}
	for !slices.Contains(h.sink.acked(), id) {
		select {
		case <-deadline:
			t.Fatalf("shard %d's fire loop did not deliver a due task while a %s read was stalled", sh, op)
		case <-time.After(time.Millisecond):
		}
	}
	select {
	case r := <-done:
		t.Fatalf("%s returned (%+v, %v) while its read was held", op, r.got, r.err)
	default:
	}
	st.Release()
	r := <-done
	if r.err != nil {
		t.Fatalf("%s: %v", op, r.err)
	}
	if !ok(r.got, &a, sh) {
		t.Fatalf("%s = %+v", op, r.got)
	}
}
