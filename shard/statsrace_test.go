package shard

import (
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"

	"github.com/delaybridge/delaybridge/codec"
)

// TestStatsLastGoodMonotonic: Stats keeps the last values it read
// without error for a read that fails; two Stats calls racing stored
// theirs in the order they finished, so the slower one's older read
// replaced the newer one's, and a read failing then reported a next due
// that was no longer true. Each read is numbered when its iterator is
// made (under the shard lock) and only a later one replaces the kept
// values.
func TestStatsLastGoodMonotonic(t *testing.T) {
	var failing atomic.Bool
	fs := errorfs.Wrap(vfs.Default, errorfs.InjectorFunc(func(op errorfs.Op) error {
		if !failing.Load() || op.Kind != errorfs.OpFileReadAt || !strings.HasSuffix(op.Path, ".sst") {
			return nil
		}
		buf := make([]byte, 64<<10)
		if st := string(buf[:runtime.Stack(buf, false)]); !strings.Contains(st, "firstFire") || !strings.Contains(st, "Stats") {
			return nil
		}
		return errors.New("injected read error")
	}))
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.FS = fs
	})
	var tasks []codec.Task
	for i := range 50 {
		tasks = append(tasks, sched(fmt.Sprintf("t%02d", i), t0.Add(time.Hour), int64(i+1)))
	}
	randomValues(tasks, 80)
	h.ingest(tasks)
	h.close()                  // flushes: the tasks are read from an sstable
	h.opts.noBlockCache = true // each read goes to the files
	h.open()
	waitFilterBuilds(t, h.e, 1)
	if got := h.e.Stats().NextDue.Time; !got.Equal(t0.Add(time.Hour)) {
		t.Fatalf("next due %v, want %v", got, t0.Add(time.Hour))
	}
	// A: reads the store as it is (next due in an hour), and is held
	// after its read, before it keeps what it read.
	var holdOnce atomic.Bool
	holdOnce.Store(true)
	blocked, release := make(chan struct{}), make(chan struct{})
	h.e.testHookStatsRead = func() {
		if holdOnce.CompareAndSwap(true, false) {
			close(blocked)
			<-release
		}
	}
	slow := make(chan Stats, 1)
	go func() { slow <- h.e.Stats() }()
	<-blocked
	// Meanwhile a task due sooner comes, and B reads it.
	h.ingest([]codec.Task{sched("sooner", t0.Add(30*time.Minute), 100)})
	if got := h.e.Stats().NextDue.Time; !got.Equal(t0.Add(30 * time.Minute)) {
		t.Fatalf("B: next due %v, want %v", got, t0.Add(30*time.Minute))
	}
	close(release)
	<-slow
	// C: its read fails; it reports the last good values, B's.
	failing.Store(true)
	st := h.e.Stats()
	failing.Store(false)
	if got := st.NextDue.Time; !got.Equal(t0.Add(30 * time.Minute)) {
		t.Fatalf("Stats with its read failing: next due %v, want %v (the newest read, not the slower older one)", got, t0.Add(30*time.Minute))
	}
}
