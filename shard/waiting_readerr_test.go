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

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/codec"
)

// TestWaitingSeekErrorAtOpen: a seek of loadWaitingLocked for the task of
// a waiting record that fails (an I/O error on an sstable block) is not a
// task gone. It was taken as one: the record was queued for deletion and
// deleted by the next batch of tasks held past a lowered
// retry.waiting_in_memory, and the error, cleared by Pebble at the next
// seek, was never seen; Open succeeded and the task went at its own retry
// time, not with its group's release. Open now fails with the read
// error, and every task keeps its waiting record or is held. So for a
// read of the value of a task to hold (holdAtOpen): its record was
// deleted and the task left at its retry time.
func TestWaitingSeekErrorAtOpen(t *testing.T) {
	injected := errors.New("injected read error")
	t.Run("seek", func(t *testing.T) { waitingReadErrorAtOpen(t, ".sst", 80, seekOfLoadWaiting, injected) })
	t.Run("held-value", func(t *testing.T) { waitingReadErrorAtOpen(t, ".blob", 4096, readOfHoldAtOpen, injected) })
}

// TestWaitingCorruptHeldValueAtOpen: a task to hold at Open whose value
// fails as corrupt (it never reads) is left where it is, for the fire
// loop to report, and its record deleted; the tasks after it are read
// through a new iterator. The one that failed kept its error for every
// value read after it: each was taken as corrupt too, its record deleted
// and the task left at its retry time.
func TestWaitingCorruptHeldValueAtOpen(t *testing.T) {
	waitingReadErrorAtOpen(t, ".blob", 4096, readOfHoldAtOpen, fmt.Errorf("injected corruption: %w", pebble.ErrCorruption))
}

// waitingReadErrorAtOpen fails once with injected, after the first batch
// loadWaitingLocked commits, a read of a file ending in suffix from a call
// where at is true; the tasks' values are value bytes (not compressible).
// Open fails, unless injected is a corruption: then it leaves that one
// task, and only it, neither held nor waiting.
func waitingReadErrorAtOpen(t *testing.T, suffix string, value int, at func() bool, injected error) {
	corrupt := pebble.IsCorruptionError(injected)
	oldLimit, oldHook := holdAtOpenBatchBytes, testHookHoldAtOpenCommit
	t.Cleanup(func() { holdAtOpenBatchBytes, testHookHoldAtOpenCommit = oldLimit, oldHook })
	holdAtOpenBatchBytes = 4 << 10
	var armed, failed atomic.Bool
	testHookHoldAtOpenCommit = func(int) { armed.Store(true) }
	fs := errorfs.Wrap(vfs.Default, errorfs.InjectorFunc(func(op errorfs.Op) error {
		if op.Kind != errorfs.OpFileReadAt || !strings.HasSuffix(op.Path, suffix) || !armed.Load() || !at() {
			return nil
		}
		if failed.CompareAndSwap(false, true) {
			return injected
		}
		return nil
	}))
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.Retry = defaultLikeRetry
		o.OutageMemory = 1000
		o.FS = fs
	})
	down := fmt.Errorf("broker down: %w", ErrUnavailable)
	h.sink.setFail(func(*codec.Task) error { return down })
	h.run()
	// Seek: envelopes kept in the sstable (below the blob files' 256
	// bytes) and not compressible, so the task keys span several data
	// blocks and the seeks after a commit read one.
	const n = 400
	tasks := dueAtT0(n)
	rng := rand.New(rand.NewChaCha8([32]byte{}))
	for i := range tasks {
		tasks[i].Value = make([]byte, value)
		for j := range tasks[i].Value {
			tasks[i].Value[j] = byte(rng.Uint32())
		}
	}
	h.ingest(tasks)
	for range 30 { // the outage, a minute at a time
		h.advance(time.Minute)
	}
	if got := waitingRecords(t, h.e); got != n {
		t.Fatalf("%d waiting records before the restart, want %d", got, n)
	}
	h.close()
	h.opts.OutageMemory = 8
	h.opts.noBlockCache = true // each seek reads its block from the file
	e, err := Open(h.opts)
	if !failed.Load() {
		if e != nil {
			e.Close()
		}
		t.Fatalf("no read of a %s file failed after a commit", suffix)
	}
	if corrupt {
		if err != nil {
			t.Fatalf("Open: %v", err)
		}
		h.e = e
		held, all := heldKeys(t, h.e)
		if w := waitingRecords(t, h.e); w+held != n-1 || all != n {
			t.Fatalf("after a corrupt value at Open: %d waiting records and %d held of %d tasks (%d stored); want all but the corrupt one with its record or held", w, held, n, all)
		}
		checkWaitingRecords(t, h.e)
		h.checkPending()
		return
	}
	if err == nil {
		h.e = e
		held, _ := heldKeys(t, h.e)
		t.Fatalf("Open succeeded after a failed read: %d waiting records and %d held of %d tasks", waitingRecords(t, h.e), held, n)
	}
	if !strings.Contains(err.Error(), injected.Error()) || !strings.Contains(err.Error(), "load waiting tasks of shard 0") {
		t.Fatalf("Open: %v, want the read error of the waiting tasks' load", err)
	}
	t.Logf("Open: %v", err)
	armed.Store(false)
	h.opts.noBlockCache = false
	h.open()
	held, all := heldKeys(t, h.e)
	if w := waitingRecords(t, h.e); w+held != n || all != n {
		t.Fatalf("after the failed Open and another: %d waiting records and %d held of %d tasks (%d stored); want each task with its record or held", w, held, n, all)
	}
	checkWaitingRecords(t, h.e)
	h.checkPending()
}

// seekOfLoadWaiting tells whether the caller runs in a seek of
// loadWaitingLocked for a waiting record's task (not a read of
// holdAtOpen).
func seekOfLoadWaiting() bool {
	buf := make([]byte, 64<<10)
	st := string(buf[:runtime.Stack(buf, false)])
	return strings.Contains(st, "loadWaitingLocked") && strings.Contains(st, "(*Iterator).SeekGE") && !strings.Contains(st, "holdAtOpen")
}

// readOfHoldAtOpen tells whether the caller runs in holdAtOpen.
func readOfHoldAtOpen() bool {
	buf := make([]byte, 64<<10)
	return strings.Contains(string(buf[:runtime.Stack(buf, false)]), "holdAtOpen")
}

// TestLoadReadErrorAtHorizon: a read that fails in the middle of the
// loader's scan (an I/O error on an sstable block) leaves the horizon
// where it was, for the next round to load the range again, but the
// tasks read before the failure were in the wheel already: the next
// round added them a second time, and each was claimed, published and
// settled twice.
func TestLoadReadErrorAtHorizon(t *testing.T) {
	var armed, failed atomic.Bool
	fs := errorfs.Wrap(vfs.Default, errorfs.InjectorFunc(func(op errorfs.Op) error {
		if op.Kind != errorfs.OpFileReadAt || !strings.HasSuffix(op.Path, ".sst") || !armed.Load() || !nextOfLoad() {
			return nil
		}
		if failed.CompareAndSwap(false, true) {
			return errors.New("injected read error")
		}
		return nil
	}))
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.FS = fs
	})
	// Envelopes kept in the sstable and not compressible: the task keys
	// span several data blocks, so the loader's scan reads more than one.
	const n = 400
	tasks := make([]codec.Task, n)
	rng := rand.New(rand.NewChaCha8([32]byte{}))
	for i := range tasks {
		tasks[i] = sched(fmt.Sprintf("t%03d", i), t0.Add(time.Hour), int64(i+1))
		tasks[i].Value = make([]byte, 80)
		for j := range tasks[i].Value {
			tasks[i].Value[j] = byte(rng.Uint32())
		}
	}
	h.ingest(tasks)
	h.close()                  // flushes: the tasks are read from an sstable
	h.opts.noBlockCache = true // each read goes to the files
	h.open()
	// Open's index filter build reads the same sstable from its own
	// goroutine; a read of the block it has in hand is not read from the
	// file (the armed read never failed, 1 in 20 runs).
	waitFilterBuilds(t, h.e, 1)
	h.run()
	armed.Store(true)
	h.advance(time.Hour)
	if !failed.Load() {
		t.Fatal("no read of the loader's scan failed")
	}
	h.advance(time.Minute)
	acked := h.sink.acked()
	seen := make(map[string]int, n)
	dup := 0
	for _, id := range acked {
		if seen[id]++; seen[id] == 2 {
			dup++
		}
	}
	if len(seen) != n || dup != 0 {
		t.Fatalf("%d deliveries of %d tasks (%d distinct), %d delivered more than once; want each once", len(acked), n, len(seen), dup)
	}
	if st := h.e.Stats(); st.Pending != 0 {
		t.Fatalf("%d pending", st.Pending)
	}
}

// nextOfLoad tells whether the caller runs in a step of loadLocked's scan
// past its first key.
func nextOfLoad() bool {
	buf := make([]byte, 64<<10)
	st := string(buf[:runtime.Stack(buf, false)])
	return strings.Contains(st, "(*shard).loadLocked") && strings.Contains(st, "(*Iterator).Next")
}

// TestProbeHeldSeekErrorKeepsOutage: a probe round's seek for a down
// group's held tasks that fails (an I/O error on an sstable block) counts
// as finding one, as markHeldGroups says of a read error. Pebble cleared
// the error at the next group's seek, so the failed group was taken for
// one with nothing held, and after unseenToForget rounds its outage was
// forgotten while its tasks were held on disk.
func TestProbeHeldSeekErrorKeepsOutage(t *testing.T) {
	var armed atomic.Bool
	fs := sstReadFaultIn(&armed, "markHeldGroups")
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.OutageMemory = -1 // every task that fails as unavailable is held
		o.FireBatch = 8
		o.Retry = defaultLikeRetry
		o.Retry.Jitter = -1
		o.FS = fs
	})
	a, b := sched("a", t0.Add(time.Second), 1), sched("b", t0.Add(time.Second), 2)
	b.Target = "payments"
	holdTasks(t, h, []codec.Task{a, b}, 2)
	reopenFromFiles(t, h)
	gs := []int64{heldGroup(transportSlot(a.Transport), a.Target), heldGroup(transportSlot(b.Transport), b.Target)}
	if gs[0] == gs[1] {
		t.Fatal("a's and b's targets share a group")
	}
	h.e.restoreOutages(gs)
	for range 2 * unseenToForget {
		armed.Store(true) // the first seek of the round fails: a's group
		h.e.probe(gs, h.e.nowMs())
		if armed.Load() {
			t.Fatal("no seek of the probe failed")
		}
	}
	if got := downGroups(h.e); len(got) != 2 {
		t.Fatalf("%d groups down after probes whose seek of one group failed, want 2 (a and b are held)", len(got))
	}
}

// TestHeldClaimSeekErrorReported: a seek of claimHeldLocked that fails
// (an I/O error on an sstable block) is reported, and the lane looks
// again heldRetry later. It went unseen: the scan ended there as at the
// range's end, the second pass's seek from the range's start cleared the
// error, and the cursor went back to the start.
func TestHeldClaimSeekErrorReported(t *testing.T) {
	const n = 20
	h, armed, logs := heldClaimFault(t, n)
	h.sink.setFail(nil)
	armed.Store(true)
	h.run()
	secondsUntilAcked(h, n, 60)
	if armed.Load() {
		t.Fatal("no seek of the held claim failed")
	}
	if got := logs.FilterMessage(msgHeldReadFailed).Len(); got != 1 {
		t.Fatalf("%d %q lines, want 1: the failed seek reported", got, msgHeldReadFailed)
	}
	acked := h.sink.acked()
	seen := map[string]bool{}
	for _, id := range acked {
		seen[id] = true
	}
	if len(acked) != n || len(seen) != n {
		t.Fatalf("%d deliveries of %d distinct tasks, want each of %d once", len(acked), len(seen), n)
	}
}

// sstReadFaultIn is a file system whose next read of an sstable from a
// call stack that holds fn fails once armed is set (it clears armed):
// a fault aimed at one read of the code under test, whatever the
// engine's other goroutines read meanwhile.
func sstReadFaultIn(armed *atomic.Bool, fn string) vfs.FS {
	return errorfs.Wrap(vfs.Default, errorfs.InjectorFunc(func(op errorfs.Op) error {
		if op.Kind != errorfs.OpFileReadAt || !strings.HasSuffix(op.Path, ".sst") || !armed.Load() {
			return nil
		}
		buf := make([]byte, 64<<10)
		if !strings.Contains(string(buf[:runtime.Stack(buf, false)]), fn) || !armed.CompareAndSwap(true, false) {
			return nil
		}
		return errors.New("injected read error")
	}))
}

// reopenFromFiles closes h's engine (its flush puts the keys in an
// sstable) and opens it again with no block cache, so that every read
// goes to the files, once Open's index filter build is done: that build
// reads the same sstable from its own goroutine, and a read of the block
// it has in hand is not read from the file (an armed fault never met, 1
// run in 20).
func reopenFromFiles(t *testing.T, h *harness) {
	t.Helper()
	h.close()
	h.opts.noBlockCache = true
	h.open()
	waitFilterBuilds(t, h.e, 1)
}

// heldClaimFault holds n tasks k00.. on disk for a target that failed
// and reopens the engine from the files (not run): the next sstable read
// of a held claim fails once armed is set; logs observes its lines.
func heldClaimFault(t *testing.T, n int) (h *harness, armed *atomic.Bool, logs *observer.ObservedLogs) {
	t.Helper()
	armed = new(atomic.Bool)
	fs := sstReadFaultIn(armed, "claimHeldLocked")
	core, logs := observer.New(zap.InfoLevel)
	h = holdHarness(t, -1, func(o *Options) { o.FS = fs; o.Logger = zap.New(core) })
	var batch []codec.Task
	for i := range n {
		batch = append(batch, sched(fmt.Sprintf("k%02d", i), t0.Add(time.Second), int64(i+1)))
	}
	holdTasks(t, h, batch, int64(n))
	reopenFromFiles(t, h)
	return h, armed, logs
}
