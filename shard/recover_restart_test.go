package shard

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
)

// TestReleaseAfterRestart: the bridge restarted during or after an
// outage of its target (an operator's restart in the incident, a Helm
// upgrade), with a Close or a crash. The tasks that waited for the target
// were known to wait only in memory (shard.late), so after the restart no
// release happened once the target was back: each went at its own retry
// time, the last 300 s after the return (121 s when restarted 3 min
// before it), where without the restart all went with the first. Now
// their waiting records bring them back at Open, and the first delivery
// of one of them releases the rest in every shard.
func TestReleaseAfterRestart(t *testing.T) {
	for _, tc := range []struct {
		name string
		// stillDown: the target is still down for this long after the
		// restart (0: it came back before the restart).
		stillDown time.Duration
		crash     bool // no Close: the store as last synced
	}{
		{"target back before the restart", 0, false},
		{"restart during the outage", 3 * time.Minute, false},
		{"crash, target back before the restart", 0, true},
		{"crash during the outage", 3 * time.Minute, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mem := vfs.NewCrashableMem()
			h := newHarness(t, func(o *Options) {
				o.Retry = defaultLikeRetry
				if tc.crash {
					o.FS = mem
				}
			})
			down := fmt.Errorf("broker down: %w", ErrUnavailable)
			h.sink.setFail(func(*codec.Task) error { return down })
			h.run()
			const n = 200
			h.ingest(dueAtT0(n))
			for range 30 { // the outage, a minute at a time
				h.advance(time.Minute)
			}
			if len(h.sink.acked()) != 0 {
				t.Fatal("delivered during the outage")
			}
			checkWaitingRecords(t, h.e)
			if tc.crash {
				h.crashReopen(mem)
			} else {
				h.reopen()
			}
			checkWaitingRecords(t, h.e)
			if got := h.e.Stats().OldestOverdue; !got.Equal(t0) {
				t.Fatalf("oldest overdue after the restart %v, want the waiting tasks' due time %v", got, t0)
			}
			var releases atomic.Int32
			h.e.testHookRelease = func([]int64) { releases.Add(1) }
			h.run()
			for range int(tc.stillDown / time.Minute) {
				h.advance(time.Minute)
			}
			if len(h.sink.acked()) != 0 {
				t.Fatal("delivered while the target was down")
			}
			first := h.backUntilFirstDelivery()
			last := first
			for len(h.sink.acked()) < n {
				if last++; last > 301 {
					break
				}
				h.advance(time.Second)
			}
			t.Logf("after the target's return: first delivery %ds, last %ds (%d of %d), %d releases", first, last, len(h.sink.acked()), n, releases.Load())
			if acked := h.sink.acked(); len(acked) != n || last > first {
				t.Fatalf("%d of %d tasks delivered by the time the first was (%ds after the return), the last %ds after; want all at once (%d releases)",
					len(acked), n, first, last, releases.Load())
			}
			acked := h.sink.acked()
			slices.Sort(acked)
			if len(slices.Compact(acked)) != n {
				t.Fatal("a task delivered twice")
			}
			h.checkPending()
			if got := waitingRecords(t, h.e); got != 0 {
				t.Fatalf("%d waiting records left once every task was delivered", got)
			}
		})
	}
}

// TestWaitingRecordsLeaveWithTheirTasks: a task waiting for an outage
// has a waiting record exactly while it waits (in memory) for it: a
// cancel (by message and by the API), a replace, a dead-lettering, a
// failure that is not an outage, a move to the held tasks and a delivery
// each take it away in the same commit, so none is left in the store
// after the outage, and a restart finds exactly the tasks still waiting.
func TestWaitingRecordsLeaveWithTheirTasks(t *testing.T) {
	h := newHarness(t, func(o *Options) {
		o.Shards = 2
		o.Retry = RetryPolicy{Initial: 500 * time.Millisecond, Max: 5 * time.Minute, Multiplier: 2, Jitter: -1, MaxAttempts: 3}
	})
	down := fmt.Errorf("broker down: %w", ErrUnavailable)
	var mu sync.Mutex
	modes := map[string]string{} // by id: "" down, "refused", "rejected", "up"
	setMode := func(id, m string) {
		mu.Lock()
		modes[id] = m
		mu.Unlock()
	}
	h.sink.setFail(func(t *codec.Task) error {
		mu.Lock()
		m := modes[t.ID]
		mu.Unlock()
		switch m {
		case "up":
			return nil
		case "refused":
			return errors.New("MESSAGE_TOO_LARGE")
		case "rejected":
			return &RejectedError{Code: codec.CodeTooLarge, Err: errors.New("too large for the target")}
		}
		return down
	})
	h.run()
	ids := []string{"cancel-msg", "cancel-api", "replace", "rejected", "refused", "delivered", "waits"}
	var tasks []codec.Task
	for i, id := range ids {
		tasks = append(tasks, sched(id, t0, int64(i+1)))
	}
	h.ingest(tasks)
	h.advance(time.Minute)
	if got := waitingRecords(t, h.e); got != int64(len(ids)) {
		t.Fatalf("%d waiting records after the outage began, want %d", got, len(ids))
	}
	checkWaitingRecords(t, h.e)

	h.ingest([]codec.Task{cancelTask("cancel-msg", 100)})
	if err := h.e.Cancel("src", "cancel-api"); err != nil {
		t.Fatal(err)
	}
	replaced := sched("replace", t0.Add(time.Hour), 101)
	h.ingest([]codec.Task{replaced})
	setMode("rejected", "rejected")
	setMode("refused", "refused")
	setMode("delivered", "up")
	h.advance(5 * time.Minute) // every retry comes
	checkWaitingRecords(t, h.e)
	if got := waitingRecords(t, h.e); got != 1 {
		t.Fatalf("%d waiting records, want 1 (waits)", got)
	}
	if !slices.Contains(h.sink.acked(), "delivered") {
		t.Fatal("delivered not delivered")
	}
	h.reopen()
	checkWaitingRecords(t, h.e)
	s := h.e.shards[h.e.shardOf("src", "waits")]
	s.mu.Lock()
	n := 0
	for _, lt := range s.late {
		if lt.group() != 0 {
			n++
		}
	}
	s.mu.Unlock()
	if n != 1 {
		t.Fatalf("after the restart %d tasks known to wait for the outage, want 1 (waits)", n)
	}
	h.run()
	setMode("waits", "up")
	setMode("refused", "up")
	h.advance(10 * time.Minute)
	if got := waitingRecords(t, h.e); got != 0 {
		t.Fatalf("%d waiting records after the outage", got)
	}
	checkWaitingRecords(t, h.e)
}

// TestStaleWaitingRecordsDropped: a waiting record whose task is not at
// its retry's key (a build without these records delivered or retried
// it: it ignores them), a corrupt one and those past OutageMemory are
// deleted at Open; none makes a task known to wait, or a group down.
func TestStaleWaitingRecordsDropped(t *testing.T) {
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.Retry = RetryPolicy{Initial: 500 * time.Millisecond, Max: 5 * time.Minute, Multiplier: 2, Jitter: -1, MaxAttempts: 3}
	})
	down := fmt.Errorf("broker down: %w", ErrUnavailable)
	h.sink.setFail(func(*codec.Task) error { return down })
	h.run()
	h.ingest([]codec.Task{sched("a", t0, 1), sched("b", t0, 2), sched("c", t0, 3)})
	h.advance(time.Minute)
	h.close()
	db, err := openPebble(t.Context(), h.opts.Dir, nil, h.e0Logger(), 0, 0, nil, 0, false)
	if err != nil {
		t.Fatal(err)
	}
	g := heldGroup(transportSlot(codec.TransportKafka), "out")
	stale := [][]byte{waitingKey(0, 1000), waitingKey(0, 1001)}
	b := db.NewBatch()
	b.Set(stale[0], appendWaiting(nil, ms(t0)+60_000, packLate(ms(t0), g)), nil) // no such task
	b.Set(stale[1], []byte{1, 2, 3}, nil)                                        // corrupt
	if err := errors.Join(b.Commit(pebble.Sync), db.Close()); err != nil {
		t.Fatal(err)
	}
	h.opts.OutageMemory = 2 // lowered: one of a, b, c is not kept
	h.open()
	s := h.e.shards[0]
	s.mu.Lock()
	late := len(s.late)
	s.mu.Unlock()
	if late != 2 {
		t.Fatalf("%d tasks known to wait after the restart, want 2 (the bound)", late)
	}
	if got := waitingRecords(t, h.e); got != 2 {
		t.Fatalf("%d waiting records after Open, want 2: the stale, corrupt and over-the-bound ones deleted", got)
	}
	checkWaitingRecords(t, h.e)
}

func (h *harness) e0Logger() *zap.Logger { return h.opts.Logger }

// dueAtT0 is n schedules t000, t001... due at t0 (offsets 1..n).
func dueAtT0(n int) []codec.Task {
	tasks := make([]codec.Task, n)
	for i := range tasks {
		tasks[i] = sched(fmt.Sprintf("t%03d", i), t0, int64(i+1))
	}
	return tasks
}

// waitingRecords counts the store's waiting records.
func waitingRecords(t testing.TB, e *Engine) int64 {
	t.Helper()
	return countPrefix(t, e, prefixWaiting)
}

// checkWaitingRecords asserts that each shard's waiting records are
// exactly its tasks known to wait for an outage (once every batch is
// durable), with their retry's fire time, due time and group.
func checkWaitingRecords(t testing.TB, e *Engine) {
	t.Helper()
	for _, s := range e.shards {
		it, err := e.db.NewIter(&pebble.IterOptions{LowerBound: shardSeqKey(prefixWaiting, s.id, 0), UpperBound: shardSeqKey(prefixWaiting, s.id+1, 0)})
		if err != nil {
			t.Fatal(err)
		}
		stored := map[uint64]lateTask{}
		for ok := it.First(); ok; ok = it.Next() {
			_, seq, fire, dg, ok := parseWaiting(it.Key(), it.Value())
			if !ok {
				t.Fatalf("shard %d: corrupt waiting record %x", s.id, it.Key())
			}
			stored[seq] = lateTask{dg: dg, fire: fire}
		}
		it.Close()
		s.mu.Lock()
		for seq, lt := range s.late {
			if lt.group() == 0 {
				continue
			}
			if r, ok := stored[seq]; !ok || r.dg != lt.dg || r.fire != lt.fire {
				s.mu.Unlock()
				t.Fatalf("shard %d: task %d waits for group %x (due %d, retry %d); its record %v %+v", s.id, seq, lt.group(), lt.due(), lt.fire, ok, r)
			}
			delete(stored, seq)
		}
		s.mu.Unlock()
		if len(stored) > 0 {
			t.Fatalf("shard %d: waiting records of tasks not waiting: %v", s.id, stored)
		}
	}
}

// TestWaitingOverLoweredBoundHeld: retry.waiting_in_memory lowered
// across a restart during an outage (a bridge short of memory). The
// tasks waiting past the new bound are held on disk at Open, as the
// fire loop holds the next one that fails once the bound is reached, so
// they go with the first delivery after the target's return. Before,
// their waiting records were only deleted: known to wait no more, they
// went at their own retry times, the last up to retry.max (here 5 min)
// after the return.
func TestWaitingOverLoweredBoundHeld(t *testing.T) {
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.Retry = defaultLikeRetry
		o.OutageMemory = 100
	})
	down := fmt.Errorf("broker down: %w", ErrUnavailable)
	h.sink.setFail(func(*codec.Task) error { return down })
	h.run()
	const n, bound = 20, 4
	h.ingest(dueAtT0(n))
	for range 30 { // the outage, a minute at a time
		h.advance(time.Minute)
	}
	if st := h.e.Stats(); st.Held != 0 || waitingRecords(t, h.e) != n {
		t.Fatalf("before the restart: %d held, %d waiting records; want 0 and %d", st.Held, waitingRecords(t, h.e), n)
	}
	h.close()
	h.opts.OutageMemory = bound
	h.open()
	if st := h.e.Stats(); st.Held != n-bound || st.Pending != n || !st.OldestOverdue.Equal(t0) {
		t.Fatalf("after the restart: held %d, pending %d, oldest overdue %v; want %d held of %d pending, overdue since %v",
			st.Held, st.Pending, st.OldestOverdue, n-bound, n, t0)
	}
	if got := waitingRecords(t, h.e); got != bound {
		t.Fatalf("%d waiting records after the restart, want %d (the bound)", got, bound)
	}
	checkWaitingRecords(t, h.e)
	h.checkPending()
	h.run()
	h.allDeliveredOnceAfterReturn(n)
}

// TestWaitingOverLoweredBoundBatched: the tasks held at Open past a
// lowered retry.waiting_in_memory are moved with their values (the held
// key holds the envelope), so one batch for all of them held up to the
// old bound's values in memory at once, at the start of a bridge whose
// bound was lowered to spare memory (1 MiB tasks: 4096 of them reach
// Pebble's 4 GiB batch limit, where it panics). They are committed in
// batches of holdAtOpenBatchBytes, each whole for the tasks it moves;
// nothing else changes: held and pending counts match the store, a
// second restart with a lower bound again holds the rest, and all go at
// the target's return.
func TestWaitingOverLoweredBoundBatched(t *testing.T) {
	const limit = 64 << 10
	var sizes []int
	var sizesMu sync.Mutex
	oldLimit, oldHook := holdAtOpenBatchBytes, testHookHoldAtOpenCommit
	t.Cleanup(func() { holdAtOpenBatchBytes, testHookHoldAtOpenCommit = oldLimit, oldHook })
	holdAtOpenBatchBytes = limit
	testHookHoldAtOpenCommit = func(size int) {
		sizesMu.Lock()
		defer sizesMu.Unlock()
		sizes = append(sizes, size)
	}
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.Retry = defaultLikeRetry
		o.OutageMemory = 100
	})
	down := fmt.Errorf("broker down: %w", ErrUnavailable)
	h.sink.setFail(func(*codec.Task) error { return down })
	h.run()
	const n, value = 40, 16 << 10
	tasks := dueAtT0(n)
	for i := range tasks {
		tasks[i].Value = bytes.Repeat([]byte{'v'}, value)
	}
	h.ingest(tasks)
	for range 30 { // the outage, a minute at a time
		h.advance(time.Minute)
	}
	if got := waitingRecords(t, h.e); got != n {
		t.Fatalf("%d waiting records before the restart, want %d", got, n)
	}
	h.close()
	sizes = nil
	h.opts.OutageMemory = 8
	h.open()
	sizesMu.Lock()
	got := slices.Clone(sizes)
	sizesMu.Unlock()
	t.Logf("batches at Open: %v bytes", got)
	// A batch goes once it reaches the limit: at most one task's move past it.
	if len(got) < 2 || slices.Max(got) >= limit+value+1024 {
		t.Fatalf("batches of %v bytes for %d tasks of %d bytes held at Open; want each below %d (limit %d and one task)",
			got, n-8, value, limit+value+1024, limit)
	}
	check := func(inMemory int) {
		t.Helper()
		held, all := heldKeys(t, h.e)
		if st := h.e.Stats(); st.Held != held || held != int64(n-inMemory) || st.Pending != all || all != n {
			t.Fatalf("%+v; store %d held of %d; want %d held of %d", st, held, all, n-inMemory, n)
		}
		if got := waitingRecords(t, h.e); got != int64(inMemory) {
			t.Fatalf("%d waiting records, want %d", got, inMemory)
		}
		checkWaitingRecords(t, h.e)
		h.checkPending()
	}
	check(8)
	h.close()
	h.opts.OutageMemory = 2
	h.open()
	check(2)
	h.run()
	h.allDeliveredOnceAfterReturn(n)
}

// allDeliveredOnceAfterReturn brings the target back and checks that all
// n pending tasks go within a second of the first delivery, each once,
// and leave nothing held or pending.
func (h *harness) allDeliveredOnceAfterReturn(n int) {
	t := h.t
	t.Helper()
	first := h.backUntilFirstDelivery()
	last := first
	for len(h.sink.acked()) < n && last <= 301 {
		last++
		h.advance(time.Second)
	}
	t.Logf("after the target's return: first delivery %ds, last %ds (%d of %d)", first, last, len(h.sink.acked()), n)
	if acked := h.sink.acked(); len(acked) != n || last > first+1 {
		t.Fatalf("%d of %d tasks delivered %ds after the return, the first %ds after; want all within a second of the first", len(acked), n, last, first)
	}
	acked := h.sink.acked()
	slices.Sort(acked)
	if len(slices.Compact(acked)) != n {
		t.Fatal("a task delivered twice")
	}
	h.checkPending()
	if st := h.e.Stats(); st.Held != 0 || st.Pending != 0 {
		t.Fatalf("held %d, pending %d once delivered", st.Held, st.Pending)
	}
}
