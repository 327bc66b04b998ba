//go:build linux

package shard

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/metrics"
)

// TestStatVolume: statfs of a real directory gives plausible numbers.
func TestStatVolume(t *testing.T) {
	st, err := statVolume(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if st.Free == 0 || st.Size < st.Free || st.Inodes < st.FreeInodes {
		t.Fatalf("statVolume = %+v: want 0 < free <= size, free inodes <= inodes", st)
	}
	if _, err := statVolume(t.TempDir() + "/missing"); err == nil {
		t.Fatal("statVolume of a missing directory: no error")
	}
}

// TestStoreBytesAllocated: delaybridge_store_bytes is the space the
// store's files take on the volume (du), the write-ahead log Pebble
// preallocated included, which Pebble's own count of the files' lengths
// misses (on a file system that preallocates: 440 MiB against 22 on a
// tmpfs).
func TestStoreBytesAllocated(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := metrics.New(reg)
	h := newHarness(t, func(o *Options) { o.Metrics = m; o.MemTableBytes = 8 << 20 })
	h.ingest([]codec.Task{sched("a", t0.Add(time.Hour), 1)})
	var blocks, lengths uint64
	ents, err := os.ReadDir(h.opts.Dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, de := range ents {
		var st syscall.Stat_t
		if err := syscall.Stat(filepath.Join(h.opts.Dir, de.Name()), &st); err != nil || de.IsDir() {
			continue
		}
		blocks += uint64(st.Blocks) * 512
		lengths += uint64(st.Size)
	}
	got := uint64(gatherGauges(t, reg)["delaybridge_store_bytes"])
	if got+1<<20 < blocks || got > blocks+1<<20 {
		t.Fatalf("delaybridge_store_bytes %d, the store's files take %d (their lengths %d, Pebble counts %d)",
			got, blocks, lengths, h.e.db.Metrics().DiskSpaceUsage())
	}
	if blocks > lengths+1<<20 {
		t.Logf("the file system preallocates: %d allocated, %d written", blocks, lengths)
	}
}
