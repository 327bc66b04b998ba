package shard

import (
	"context"
	"errors"
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

// TestOpenReplayFlushFailsReturns: a store whose WAL holds a task is
// reopened on a disk that takes no new sstable or blob file (full: the
// WAL and the manifest, already allocated, still write). Pebble flushes
// the replayed WAL before Open returns and retries that flush at once and
// forever, so pebble.Open never returns: the process would hang in its
// start, serving no /healthz, ignoring SIGTERM and leaking an empty blob
// file per try (hunt H151, on a real tmpfs and ext4). Open must instead
// give up once the flush keeps failing, with an error that names the
// cause and says what to do; once there is space the store opens with
// its task.
func TestOpenReplayFlushFailsReturns(t *testing.T) {
	dir := t.TempDir()
	opts := Options{Dir: dir, Logger: zap.NewNop(), CacheBytes: 64 << 20, MemTableBytes: 4 << 20}
	e, err := Open(opts)
	if err != nil {
		t.Fatal(err)
	}
	due := time.Now().Add(time.Hour)
	if err := e.Ingest(context.Background(), []codec.Task{sched("a", due, 1)}, nil); err != nil {
		t.Fatal(err)
	}
	if err := e.CloseNoFlush(); err != nil { // the task stays in the WAL only
		t.Fatal(err)
	}

	tg := faultfs.FullDisk(".sst", ".blob")
	tg.On()
	full := opts
	full.FS = errorfs.Wrap(vfs.Default, tg)
	full.openGrace = time.Millisecond
	done := make(chan error, 1)
	go func() {
		e, err := Open(full)
		if err == nil {
			_ = e.Close()
		}
		done <- err
	}()
	select {
	case err = <-done:
	case <-time.After(2 * time.Minute): // generous: without the fix Open never returns
		tg.Off()
		t.Fatal("Open hangs while the replayed WAL cannot be flushed")
	}
	if err == nil {
		t.Fatal("Open succeeded on a disk that takes no sstable")
	}
	if !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("Open: %v, want the ENOSPC named", err)
	}
	if !strings.Contains(err.Error(), "free space") {
		t.Fatalf("Open: %v, want it to say what to do", err)
	}

	// The abandoned open completes once there is space and closes its
	// store, releasing the lock; the task was not lost.
	tg.Off()
	abandonedOpens.Wait()
	e, err = Open(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if _, err := e.Lookup("src", "a"); err != nil {
		t.Fatalf("task after the failed open: %v", err)
	}
}
