package shard

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/faultfs"
)

// TestOpenOnFullDisk: Open of a new store, and of one holding a task, on a
// disk that takes no writes returns an error (no panic, no store).
func TestOpenOnFullDisk(t *testing.T) {
	withTask := t.TempDir()
	e, err := Open(Options{Dir: withTask, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Ingest(context.Background(), []codec.Task{sched("a", time.Now().Add(time.Hour), 1)}, nil); err != nil {
		t.Fatal(err)
	}
	if err := e.CloseNoFlush(); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ name, dir string }{{"new", t.TempDir()}, {"with a task", withTask}} {
		t.Run(tc.name, func(t *testing.T) {
			tg := faultfs.FullDisk()
			tg.On()
			e, err := Open(Options{Dir: tc.dir, FS: errorfs.Wrap(vfs.Default, tg), Logger: zap.NewNop()})
			if err == nil {
				e.Close()
				t.Fatal("Open on a full disk succeeded")
			}
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatalf("Open: %v, want the ENOSPC named", err)
			}
		})
	}
}

// TestIngestStallReported: when the store cannot flush (ENOSPC on sstable
// and blob writes, the WAL still writing into a recycled file), Pebble
// holds every write once both memtables are full, and Ingest waits there.
// No write fails, so only the stall says why: Err reports it
// (ErrStoreStalled, readiness) until space is freed, and then the ingest
// completes and Err is nil again.
func TestIngestStallReported(t *testing.T) {
	tg := faultfs.FullDisk(".sst", ".blob")
	e, err := Open(Options{Dir: t.TempDir(), FS: errorfs.Wrap(vfs.Default, tg), Logger: zap.NewNop(),
		CacheBytes: 64 << 20, MemTableBytes: 4 << 20, stallGrace: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	defer tg.Off() // before the close, which waits for a stalled ingest
	tg.On()
	val := bytes.Repeat([]byte("x"), 32<<10)
	done := make(chan error, 1)
	go func() {
		for i := 0; i < 64; i++ { // 32 MB: past two 4 MB memtables
			tasks := make([]codec.Task, 16)
			for j := range tasks {
				tasks[j] = sched(fmt.Sprintf("id%d-%d", i, j), time.Now().Add(time.Hour), int64(i*16+j))
				tasks[j].Value = val
			}
			if err := e.Ingest(context.Background(), tasks, nil); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	deadline := time.After(60 * time.Second) // turns a hang into a failure
	for !errors.Is(e.Err(), ErrStoreStalled) {
		select {
		case err := <-done:
			t.Fatalf("ingest of 32 MB ended (%v) with every flush failing", err)
		case <-deadline:
			t.Fatalf("Err() = %v after a minute of failing flushes, want ErrStoreStalled", e.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
	if err := e.Err(); !strings.Contains(err.Error(), "no space left on device") {
		t.Fatalf("Err() = %v, want the flush's error named", err)
	}
	tg.Off() // space freed: the stall ends, the ingest completes
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := e.Err(); err != nil {
		t.Fatalf("Err() = %v after the stall ended", err)
	}
}
