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
		info TaskInfo
		err  error
	}
	looked := make(chan result, 1)
	go func() {
		info, err := h.e.Lookup("src", "a")
		looked <- result{info, err}
	}()
	// The deadlines only turn a hang into a failure.
	deadline := time.After(10 * time.Second)
	select {
	case <-st.Held():
	case r := <-looked:
		t.Fatalf("Lookup returned (%+v, %v) without reading the blob file", r.info, r.err)
	case <-deadline:
		t.Fatal("Lookup did not read the blob file")
	}
	ingested := make(chan error, 1)
	go func() { ingested <- h.e.Ingest(context.Background(), []codec.Task{sched(id, t0, 2)}, nil) }()
	select {
	case err := <-ingested:
		if err != nil {
			t.Fatal(err)
		}
	case <-deadline:
		t.Fatalf("Ingest into shard %d did not return while a Lookup's read was stalled", sh)
	}
	for !slices.Contains(h.sink.acked(), id) {
		select {
		case <-deadline:
			t.Fatalf("shard %d's fire loop did not deliver a due task while a Lookup's read was stalled", sh)
		case <-time.After(time.Millisecond):
		}
	}
	select {
	case r := <-looked:
		t.Fatalf("Lookup returned (%+v, %v) while its read was held", r.info, r.err)
	default:
	}
	st.Release()
	r := <-looked
	if r.err != nil {
		t.Fatalf("Lookup: %v", r.err)
	}
	if !r.info.Due.Equal(t0.Add(time.Hour)) || r.info.Shard != sh || r.info.Target != a.Destination() {
		t.Fatalf("Lookup = %+v", r.info)
	}
}
