package shard

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/codec"
)

// readFault is an errorfs whose sstable reads fail, while armed, from a
// call whose stack holds every one of in; failed counts them.
type readFault struct {
	armed  atomic.Bool
	failed atomic.Int32
	fs     vfs.FS
}

func newReadFault(in ...string) *readFault {
	f := &readFault{}
	f.fs = errorfs.Wrap(vfs.Default, errorfs.InjectorFunc(func(op errorfs.Op) error {
		if !f.armed.Load() || op.Kind != errorfs.OpFileReadAt || !strings.HasSuffix(op.Path, ".sst") {
			return nil
		}
		buf := make([]byte, 64<<10)
		st := string(buf[:runtime.Stack(buf, false)])
		for _, s := range in {
			if !strings.Contains(st, s) {
				return nil
			}
		}
		f.failed.Add(1)
		return errors.New("injected read error")
	}))
	return f
}

// randomValues gives each task a value of n random bytes, so that the
// keys span several sstable blocks.
func randomValues(tasks []codec.Task, n int) {
	rng := rand.New(rand.NewChaCha8([32]byte{}))
	for i := range tasks {
		tasks[i].Value = make([]byte, n)
		for j := range tasks[i].Value {
			tasks[i].Value[j] = byte(rng.Uint32())
		}
	}
}

// TestFirstStoredReadErrorAtOpen (review R200): Open reads the shard's
// first stored task to start its wheel there; a read that failed was
// taken for no task at all, and Open went on. It fails Open, as the
// load's reads of the same range do.
func TestFirstStoredReadErrorAtOpen(t *testing.T) {
	f := newReadFault("firstStoredLocked")
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.FS = f.fs
	})
	tasks := make([]codec.Task, 50)
	for i := range tasks {
		tasks[i] = sched(fmt.Sprintf("t%02d", i), t0.Add(time.Minute), int64(i+1))
	}
	h.ingest(tasks)
	h.close()                  // flushes: the tasks are read from an sstable
	h.opts.noBlockCache = true // each read goes to the files
	f.armed.Store(true)
	e, err := Open(h.opts)
	if f.failed.Load() == 0 {
		if e != nil {
			e.Close()
		}
		t.Fatal("no read of the first stored task failed")
	}
	if err == nil {
		e.Close()
		t.Fatal("Open succeeded after the read of the first stored task failed")
	}
	if !strings.Contains(err.Error(), "injected read error") || !strings.Contains(err.Error(), "read the first task") {
		t.Fatalf("Open: %v, want the read error of the first task", err)
	}
	f.armed.Store(false)
	h.open()
	h.checkPending()
}

// TestStatsReadErrorKeepsLastValues (review R200): Stats read the oldest
// held due with one seek per target group and the next due with a step,
// and took a read that failed for the end: a seek failing at the group of
// the oldest held tasks reported another group's later due as the oldest
// overdue, a failed first step none at all, and nothing said why. Stats
// gives the values it last read without error, and the failure is logged
// once per engine (storeLines), and when it is over.
func TestStatsReadErrorKeepsLastValues(t *testing.T) {
	for _, c := range []struct {
		name string
		in   []string
		// check the Stats read while the fault is armed
		check func(st Stats) error
	}{
		{"held seek", []string{"heldOldestDue", "(*Iterator).SeekGE"}, func(st Stats) error {
			if got := st.OldestOverdue.UnixMilli(); got != ms(t0.Add(time.Second)) {
				return fmt.Errorf("oldest overdue %v, want %v (a's held tasks)", st.OldestOverdue.Time, t0.Add(time.Second))
			}
			return nil
		}},
		{"held first", []string{"heldOldestDue"}, func(st Stats) error {
			if got := st.OldestOverdue.UnixMilli(); got != ms(t0.Add(time.Second)) {
				return fmt.Errorf("oldest overdue %v, want %v (a's held tasks)", st.OldestOverdue.Time, t0.Add(time.Second))
			}
			return nil
		}},
		{"next due", []string{"firstFire", "Stats"}, func(st Stats) error {
			if got := st.NextDue.UnixMilli(); got != ms(t0.Add(time.Hour)) {
				return fmt.Errorf("next due %v, want %v (the task due then)", st.NextDue.Time, t0.Add(time.Hour))
			}
			return nil
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := newReadFault(c.in...)
			core, logs := observer.New(zap.InfoLevel)
			h := holdHarness(t, -1, func(o *Options) {
				o.FS = f.fs
				o.Logger = zap.New(core)
			})
			h.sink.setFail(func(*codec.Task) error { return errDown })
			// Held tasks of two targets, b's group first in the store
			// and due later (holdTwoTargets), 200 each so that each
			// group spans sstable blocks; and one task due in an hour.
			var batch []codec.Task
			for i := range 200 {
				a := sched(fmt.Sprintf("a%03d", i), t0.Add(time.Second), int64(i+1))
				a.Target = "a"
				b := sched(fmt.Sprintf("b%03d", i), t0.Add(20*time.Second), int64(1000+i))
				b.Target = "b"
				batch = append(batch, a, b)
			}
			randomValues(batch, 80)
			batch = append(batch, sched("later", t0.Add(time.Hour), 5000))
			h.ingest(batch)
			h.run()
			for range 30 {
				h.advance(time.Second)
			}
			want := func(st Stats) error {
				if st.Held != 400 || st.OldestOverdue.UnixMilli() != ms(t0.Add(time.Second)) || st.NextDue.UnixMilli() != ms(t0.Add(time.Hour)) {
					return fmt.Errorf("held %d, oldest overdue %v, next due %v; want 400, %v, %v", st.Held, st.OldestOverdue.Time, st.NextDue.Time, t0.Add(time.Second), t0.Add(time.Hour))
				}
				return nil
			}
			h.close()
			h.opts.noBlockCache = true // each read goes to the files
			h.open()
			waitFilterBuilds(t, h.e, 1) // its reads of the sstable done (see TestProbeHeldSeekErrorKeepsOutage)
			h.run()
			if err := want(h.e.Stats()); err != nil {
				t.Fatalf("before the fault: %v", err)
			}
			logs.TakeAll()
			f.armed.Store(true)
			st := h.e.Stats()
			f.armed.Store(false)
			if f.failed.Load() == 0 {
				t.Fatalf("no read from %v failed", c.in)
			}
			if err := c.check(st); err != nil {
				t.Fatalf("Stats with a read failing: %v", err)
			}
			if n := logs.FilterMessage(msgStatsReadFailed).FilterFieldKey("error").Len(); n != 1 {
				t.Fatalf("%d %q lines, want 1", n, msgStatsReadFailed)
			}
			if err := want(h.e.Stats()); err != nil {
				t.Fatalf("after the fault: %v", err)
			}
			if n := logs.FilterMessageSnippet("store failure over").Len(); n != 1 {
				t.Fatalf("%d 'store failure over' lines, want 1", n)
			}
		})
	}
}
