package shard

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"

	"github.com/delaybridge/delaybridge/codec"
)

// TestStickyStoreError injects WAL write or sync errors: the failing Ingest
// and every later one return ErrStoreFailed, Err reports it, and after a
// reopen everything acknowledged before the failure is there.
func TestStickyStoreError(t *testing.T) {
	for _, tc := range []struct {
		name  string
		kinds []errorfs.OpKind
	}{
		{"wal-write", []errorfs.OpKind{errorfs.OpFileWrite, errorfs.OpFileWriteAt}},
		{"wal-sync", []errorfs.OpKind{errorfs.OpFileSync, errorfs.OpFileSyncData, errorfs.OpFileSyncTo}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			toggle := &errorfs.Toggle{Injector: errorfs.InjectorFunc(func(op errorfs.Op) error {
				if !strings.HasSuffix(op.Path, ".log") {
					return nil
				}
				for _, k := range tc.kinds {
					if op.Kind == k {
						return errorfs.ErrInjected
					}
				}
				return nil
			})}
			h := newHarness(t, func(o *Options) { o.FS = errorfs.Wrap(vfs.Default, toggle) })
			h.run()
			ctx := context.Background()
			acked := []codec.Task{sched("a", t0.Add(time.Hour), 1), sched("b", t0.Add(2*time.Hour), 2)}
			if err := h.e.Ingest(ctx, acked, []Checkpoint{{Key: "k", Offset: 2}}); err != nil {
				t.Fatal(err)
			}
			toggle.On()
			err := h.e.Ingest(ctx, []codec.Task{sched("c", t0.Add(time.Hour), 3)}, []Checkpoint{{Key: "k", Offset: 3}})
			if !errors.Is(err, ErrStoreFailed) {
				t.Fatalf("Ingest with failing WAL = %v, want ErrStoreFailed", err)
			}
			toggle.Off()
			if err := h.e.Ingest(ctx, []codec.Task{sched("d", t0.Add(time.Hour), 4)}, nil); !errors.Is(err, ErrStoreFailed) {
				t.Fatalf("Ingest after a failed write = %v, want sticky ErrStoreFailed", err)
			}
			if err := h.e.Cancel("src", "a"); !errors.Is(err, ErrStoreFailed) {
				t.Fatalf("Cancel after a failed write = %v", err)
			}
			if err := h.e.Err(); !errors.Is(err, ErrStoreFailed) {
				t.Fatalf("Err() = %v", err)
			}
			// The fire loops stop deleting: advancing past due delivers nothing
			// that could not be recorded.
			h.clk.Advance(3 * time.Hour)
			h.close()

			h.opts.FS = nil
			h.clk.Set(t0)
			h.open()
			for _, id := range []string{"a", "b"} {
				if _, err := h.e.Lookup("src", id); err != nil {
					t.Fatalf("acknowledged task %s lost: %v", id, err)
				}
			}
			if off, ok, _ := h.e.Checkpoint("k"); !ok || off < 2 {
				t.Fatalf("checkpoint %d,%v after reopen", off, ok)
			}
			if _, err := h.e.Lookup("src", "d"); !errors.Is(err, ErrNotFound) {
				t.Fatalf("task refused after the failure was stored: %v", err)
			}
			h.checkPending()
		})
	}
}
