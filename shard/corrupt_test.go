package shard

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"

	"github.com/delaybridge/delaybridge/codec"
)

// TestCorruptValueAtFire: a task whose stored value fails its checksum (a
// flipped byte in the blob file that holds it) can never be read. It is
// left in the store and reported like an undecodable envelope (Err,
// StuckEntries) until an operator drops it, rather than put back in the
// wheel and read again every round in silence; the other tasks deliver.
func TestCorruptValueAtFire(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.Shards = 1 })
	a := sched("a", t0.Add(time.Hour), 1)
	a.Value = bytes.Repeat([]byte("A"), 4096) // separated into a blob file
	b := sched("b", t0.Add(time.Hour), 2)
	h.ingest([]codec.Task{a, b})
	h.close() // flushes: a's envelope goes to a blob file
	corruptOnlyBlob(t, h.opts.Dir)
	h.open()
	h.run()
	h.advance(2 * time.Hour)
	if got := h.sink.acked(); !slices.Equal(got, []string{"b"}) {
		t.Fatalf("delivered %v, want b only", got)
	}
	l := stuckOf(t, h.e)
	if len(l) != 1 || l[0].State != StuckUndecodable || l[0].Seq != 1 || !strings.Contains(l[0].Error, "checksum") {
		t.Fatalf("stuck entries %+v, want task a undecodable with its checksum error", l)
	}
	if err := h.e.Err(); err == nil || !strings.Contains(err.Error(), "1 stored entries cannot be decoded") {
		t.Fatalf("Err = %v, want the unreadable entry", err)
	}
	dropLastStuck(t, h.e, l[0].Seq)
	if got := h.sink.acked(); !slices.Equal(got, []string{"b"}) {
		t.Fatalf("delivered %v after the drop, want b only", got)
	}
}

// TestReadErrorAtFire: a task whose read fails once (an I/O error on the
// blob file holding its value) goes
// back to the wheel for the next round, and the tasks after it in the same
// batch are still read and delivered: Pebble's iterator answered the
// seeks after a failed read with no key and no error, and they were taken
// as deleted (gone from the wheel, left in the store until a restart).
func TestReadErrorAtFire(t *testing.T) {
	for _, file := range []string{".blob"} { // the sstable blocks of the keys are cached by the recovery scan
		t.Run(file, func(t *testing.T) {
			var fail atomic.Bool
			fs := errorfs.Wrap(vfs.Default, errorfs.InjectorFunc(func(op errorfs.Op) error {
				if op.Kind == errorfs.OpFileReadAt && strings.HasSuffix(op.Path, file) && fail.CompareAndSwap(true, false) {
					return errors.New("injected read error")
				}
				return nil
			}))
			h := newHarness(t, func(o *Options) {
				o.Shards = 1
				o.FS = fs
			})
			a := sched("a", t0.Add(time.Hour), 1)
			a.Value = bytes.Repeat([]byte("A"), 4096) // separated into a blob file
			h.ingest([]codec.Task{a, sched("b", t0.Add(time.Hour), 2), sched("c", t0.Add(time.Hour), 3)})
			h.close() // flushes: a's envelope goes to a blob file
			h.open()
			h.run()
			fail.Store(true)
			h.advance(time.Hour)
			if fail.Load() {
				t.Fatalf("no read of a %s file failed", file)
			}
			// a goes back to the wheel, already due: the next round reads it.
			if got := h.sink.acked(); !slices.Equal(got, []string{"b", "c", "a"}) {
				t.Fatalf("delivered %v, want b and c, then a (its first read failed)", got)
			}
			if st := h.e.Stats(); st.Pending != 0 {
				t.Fatalf("%d pending", st.Pending)
			}
		})
	}
}

// dropLastStuck drops the stuck entry seq of shard 0, the last pending
// task: the engine is then ready, with nothing pending.
func dropLastStuck(t *testing.T, e *Engine, seq uint64) {
	t.Helper()
	if err := e.DropStuck(0, seq); err != nil {
		t.Fatalf("DropStuck: %v", err)
	}
	if err := e.Err(); err != nil {
		t.Fatalf("Err after the drop = %v", err)
	}
	if st := e.Stats(); st.Pending != 0 {
		t.Fatalf("%d pending after the drop", st.Pending)
	}
}

// corruptOnlyBlob flips a byte inside the one value block of the store's
// only blob file, so the value stored there fails its checksum.
func corruptOnlyBlob(t *testing.T, dir string) {
	t.Helper()
	blobs, err := filepath.Glob(filepath.Join(dir, "*.blob"))
	if err != nil || len(blobs) != 1 {
		t.Fatalf("blob files %v, %v; want one", blobs, err)
	}
	data, err := os.ReadFile(blobs[0])
	if err != nil {
		t.Fatal(err)
	}
	data[8] ^= 0xff
	if err := os.WriteFile(blobs[0], data, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestFailingDeadLetterTurnedUndecodable: a dead letter whose DLQ failed,
// and whose stored envelope then no longer reads, is reported once, as
// undecodable (it will not be delivered), not also as a dead letter whose
// delivery fails (Err counted it in both); an operator's drop takes it
// out of both, and no index scan is needed for it.
func TestFailingDeadLetterTurnedUndecodable(t *testing.T) {
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.Retry = RetryPolicy{Initial: 5 * time.Second, Max: 5 * time.Second, Multiplier: 2, Jitter: -1, MaxAttempts: 3}
	})
	h.sink.setFail(func(*codec.Task) error { return errors.New(`kafka: publish to "dlq": TOPIC_AUTHORIZATION_FAILED`) })
	dl := deadLetter("dl", 1)
	dl.Value = bytes.Repeat([]byte("D"), 4096) // separated into a blob file
	h.ingest([]codec.Task{dl})
	h.run()
	h.advanceUntil("the dead letter failing", func() bool {
		err := h.e.Err()
		return err != nil && strings.Contains(err.Error(), "dead-letter delivery failing (1 dead letters")
	})
	h.close() // flushes: its envelope, stored again with its retry, goes to a blob file
	corruptOnlyBlob(t, h.opts.Dir)
	h.sink.reset()
	h.open()
	h.run()
	h.advanceUntil("the dead letter found undecodable", func() bool {
		err := h.e.Err()
		return err != nil && strings.Contains(err.Error(), "1 stored entries cannot be decoded")
	})
	if err := h.e.Err(); strings.Contains(err.Error(), "dead-letter delivery failing") {
		t.Fatalf("Err = %v, want the dead letter reported as undecodable only", err)
	}
	l := stuckOf(t, h.e)
	if len(l) != 1 || l[0].State != StuckUndecodable {
		t.Fatalf("stuck entries %+v, want the dead letter undecodable", l)
	}
	dropLastStuck(t, h.e, l[0].Seq)
}
