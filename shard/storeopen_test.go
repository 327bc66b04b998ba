package shard

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
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
	opts := walOnlyStore(t)
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
	var err error
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
	reopenAfterAbandoned(t, tg, opts)
}

// walOnlyStore makes a store whose one task, "a", is in its WAL only, and
// returns the options that open it.
func walOnlyStore(t *testing.T) Options {
	t.Helper()
	opts := Options{Dir: t.TempDir(), Logger: zap.NewNop(), CacheBytes: 64 << 20, MemTableBytes: 4 << 20}
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
	return opts
}

// reopenAfterAbandoned turns the full disk tg off, waits for the open
// that was given up to complete and close its store, and checks that the
// store opens with its task "a".
func reopenAfterAbandoned(t *testing.T, tg *errorfs.Toggle, opts Options) {
	t.Helper()
	tg.Off()
	abandonedOpens.Wait()
	e, err := Open(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if _, err := e.Lookup("src", "a"); err != nil {
		t.Fatalf("task after the failed open: %v", err)
	}
}

// TestOpenReplayFlushFailsCancelled: SIGTERM while the store's open waits
// on a flush that keeps failing (a full volume) stopped the process only
// when the open gave up, 30 s later. OpenContext returns as soon as its
// context ends, with the cause, and the store is intact.
func TestOpenReplayFlushFailsCancelled(t *testing.T) {
	opts := walOnlyStore(t)
	full := faultfs.FullDisk(".sst", ".blob")
	var failed atomic.Int64
	tg := &errorfs.Toggle{Injector: errorfs.InjectorFunc(func(op errorfs.Op) error {
		err := full.MaybeError(op)
		if err != nil {
			failed.Add(1)
		}
		return err
	})}
	full.On()
	tg.On()
	hung := opts
	hung.FS = errorfs.Wrap(vfs.Default, tg)
	hung.openGrace = time.Hour // only the context can end this open
	ctx, cancel := context.WithCancelCause(context.Background())
	stop := errors.New("SIGTERM")
	done := make(chan error, 1)
	go func() {
		e, err := OpenContext(ctx, hung)
		if err == nil {
			_ = e.Close()
		}
		done <- err
	}()
	for failed.Load() == 0 { // the open is retrying a flush that fails
		select {
		case err := <-done:
			t.Fatalf("the open ended before its flush failed: %v", err)
		case <-time.After(time.Millisecond):
		}
	}
	cancel(stop)
	var err error
	select {
	case err = <-done:
	case <-time.After(time.Minute): // generous: without the fix it waits for openGrace
		tg.Off()
		t.Fatal("OpenContext still waits for the failing flush after its context ended")
	}
	if !errors.Is(err, stop) || !strings.Contains(err.Error(), "intact") {
		t.Fatalf("OpenContext: %v, want the context's cause and that the store is intact", err)
	}
	reopenAfterAbandoned(t, tg, opts)
}

// TestManifestBounded: the store's MANIFEST is rolled over at a few MiB,
// not at Pebble's default of 128 MiB: every flush and compaction adds to
// it, and a long-running store kept up to twice that (the current
// manifest and the one before) on its volume, for a log of a few dozen
// files (hunt H205). Pebble writes the option it was opened with to its
// OPTIONS file.
func TestManifestBounded(t *testing.T) {
	h := newHarness(t, nil)
	files, err := filepath.Glob(filepath.Join(h.opts.Dir, "OPTIONS-*"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no OPTIONS file in the store: %v", err)
	}
	b, err := os.ReadFile(files[len(files)-1])
	if err != nil {
		t.Fatal(err)
	}
	var size int64 = -1
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "max_manifest_file_size="); ok {
			size, err = strconv.ParseInt(v, 10, 64)
			if err != nil {
				t.Fatalf("max_manifest_file_size=%q: %v", v, err)
			}
		}
	}
	if size <= 0 || size > 16<<20 {
		t.Fatalf("the store's MANIFEST rolls over at %d bytes, want at most 16 MiB", size)
	}
}
