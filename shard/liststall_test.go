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

// TestListStalledReadHoldsNoShard: ListTasks reads the store without any
// shard lock. While its read of a task's envelope (in a blob file, past a
// flush) is held by a disk that stopped answering reads, an Ingest into
// that task's shard returns and the shard's fire loop delivers a due task
// of it; once the read goes on, the page lists the task.
func TestListStalledReadHoldsNoShard(t *testing.T) {
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
		list TaskList
		err  error
	}
	listed := make(chan result, 1)
	go func() {
		l, err := h.e.ListTasks("src", ListQuery{Prefix: "a"})
		listed <- result{l, err}
	}()
	// The deadlines only turn a hang into a failure.
	deadline := time.After(10 * time.Second)
	select {
	case <-st.Held():
	case r := <-listed:
		t.Fatalf("ListTasks returned (%+v, %v) without reading the blob file", r.list, r.err)
	case <-deadline:
		t.Fatal("ListTasks did not read the blob file")
	}
	ingested := make(chan error, 1)
	go func() { ingested <- h.e.Ingest(context.Background(), []codec.Task{sched(id, t0, 2)}, nil) }()
	select {
	case err := <-ingested:
		if err != nil {
			t.Fatal(err)
		}
	case <-deadline:
		t.Fatalf("Ingest into shard %d did not return while a ListTasks read was stalled", sh)
	}
	for !slices.Contains(h.sink.acked(), id) {
		select {
		case <-deadline:
			t.Fatalf("shard %d's fire loop did not deliver a due task while a ListTasks read was stalled", sh)
		case <-time.After(time.Millisecond):
		}
	}
	select {
	case r := <-listed:
		t.Fatalf("ListTasks returned (%+v, %v) while its read was held", r.list, r.err)
	default:
	}
	st.Release()
	r := <-listed
	if r.err != nil {
		t.Fatalf("ListTasks: %v", r.err)
	}
	if len(r.list.Tasks) != 1 || r.list.Tasks[0].ID != "a" || r.list.Tasks[0].Shard != sh || r.list.Tasks[0].Target != a.Destination() {
		t.Fatalf("ListTasks = %+v", r.list)
	}
}
