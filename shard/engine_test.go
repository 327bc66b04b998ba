package shard

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
)

func TestFiresAtDueNotBefore(t *testing.T) {
	cases := []struct {
		name   string
		due    time.Duration // relative to t0
		atOnce bool          // overdue or due now: fires without moving the clock
	}{
		{"overdue", -5 * time.Second, true},
		{"due-now", 0, true},
		{"1ms", time.Millisecond, false},
		{"1.5s", 1500 * time.Millisecond, false},
		{"3m", 3*time.Minute + 7*time.Millisecond, false},
		{"beyond-horizon", 25 * time.Minute, false},
		{"days", 50*time.Hour + 3*time.Millisecond, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			h.run()
			h.ingest([]codec.Task{sched("a", t0.Add(tc.due), 1)})
			if tc.atOnce {
				if got := h.sink.acked(); !slices.Equal(got, []string{"a"}) {
					t.Fatalf("overdue task: delivered %v, want [a]", got)
				}
				h.checkPending()
				return
			}
			// Walk the clock to 1 ms before due in a few steps.
			before := t0.Add(tc.due - time.Millisecond)
			for step := tc.due / 4; h.clk.Now().Add(step).Before(before); {
				h.advance(step)
			}
			h.set(before)
			if got := h.sink.acked(); len(got) != 0 {
				t.Fatalf("fired %v 1 ms before due", got)
			}
			h.advance(time.Millisecond)
			got := h.sink.all()
			if len(got) != 1 || got[0].ID != "a" || !got[0].At.Equal(t0.Add(tc.due)) {
				t.Fatalf("deliveries %+v, want a at %v", got, t0.Add(tc.due))
			}
			h.checkPending()
		})
	}
}

func TestEqualDueFiresInIngestOrder(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.Shards = 1; o.FireBatch = 7 })
	h.run()
	due := t0.Add(time.Minute)
	var want []string
	n := int64(0)
	for b := 0; b < 5; b++ {
		var batch []codec.Task
		for i := 0; i < 20; i++ {
			n++
			id := fmt.Sprintf("t%03d", n)
			batch = append(batch, sched(id, due, n))
			want = append(want, id)
		}
		h.ingest(batch)
	}
	// A sequence of replaces of one id at the same due: the last one fires,
	// after everything ingested before it.
	for i := 0; i < 3; i++ {
		n++
		h.ingest([]codec.Task{sched("same", due, n)})
	}
	want = append(want, "same")
	h.advance(time.Minute)
	if got := h.sink.acked(); !slices.Equal(got, want) {
		t.Fatalf("order:\n got %v\nwant %v", got, want)
	}
	if v := h.sink.all()[len(want)-1].Value; v != fmt.Sprintf("same#%d", n) {
		t.Fatalf("replaced task delivered value %q, want the last one", v)
	}
	h.checkPending()
}

func TestReplace(t *testing.T) {
	due1, due2 := t0.Add(time.Minute), t0.Add(2*time.Minute)
	cases := []struct {
		name      string
		first     codec.Task
		second    codec.Task
		wantValue string // value that fires
	}{
		{"same-partition-later-offset-wins", at(0, 10, 5, sched("x", due1, 1)), at(0, 11, 1, sched("x", due2, 2)), "x#2"},
		{"same-partition-earlier-offset-dropped", at(0, 10, 1, sched("x", due1, 1)), at(0, 9, 50, sched("x", due2, 2)), "x#1"},
		{"same-partition-same-offset-dropped", at(0, 10, 1, sched("x", due1, 1)), at(0, 10, 50, sched("x", due2, 2)), "x#1"},
		{"cross-partition-later-stamp-wins", at(0, 10, 5, sched("x", due1, 1)), at(1, 2, 6, sched("x", due2, 2)), "x#2"},
		{"cross-partition-earlier-stamp-dropped", at(0, 10, 5, sched("x", due1, 1)), at(1, 99, 4, sched("x", due2, 2)), "x#1"},
		{"cross-partition-tie-keeps-existing", at(0, 10, 5, sched("x", due1, 1)), at(1, 99, 5, sched("x", due2, 2)), "x#1"},
		// The topic was deleted and created again: the new log's offsets
		// start at 0 again, so broker time orders it against the old one.
		{"recreated-log-lower-offset-later-stamp-wins", at(0, 500, 5, sched("x", due1, 1)), inc(1, at(0, 3, 6, sched("x", due2, 2))), "x#2"},
		{"recreated-log-earlier-stamp-dropped", at(0, 500, 5, sched("x", due1, 1)), inc(1, at(0, 3, 4, sched("x", due2, 2))), "x#1"},
		{"old-log-after-recreated-one-by-stamp", inc(1, at(0, 3, 6, sched("x", due1, 1))), at(0, 500, 5, sched("x", due2, 2)), "x#1"},
		{"same-recreated-log-later-offset-wins", inc(2, at(0, 3, 6, sched("x", due1, 1))), inc(2, at(0, 4, 1, sched("x", due2, 2))), "x#2"},
	}
	for _, tc := range cases {
		for _, oneBatch := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/one-batch=%v", tc.name, oneBatch), func(t *testing.T) {
				h := newHarness(t, nil)
				h.run()
				if oneBatch {
					h.ingest([]codec.Task{tc.first, tc.second})
				} else {
					h.ingest([]codec.Task{tc.first})
					h.ingest([]codec.Task{tc.second})
				}
				info, err := h.e.Lookup("src", "x")
				if err != nil {
					t.Fatal(err)
				}
				wantDue := due1
				if tc.wantValue == "x#2" {
					wantDue = due2
				}
				if !info.Due.Equal(wantDue) {
					t.Fatalf("Lookup due %v, want %v", info.Due, wantDue)
				}
				h.checkPending()
				h.advance(3 * time.Minute)
				got := h.sink.all()
				if len(got) != 1 || got[0].Value != tc.wantValue {
					t.Fatalf("deliveries %+v, want one %s", got, tc.wantValue)
				}
				h.checkPending()
			})
		}
	}
}

// Two schedules of one id in one batch: the second replaces the first,
// which the same batch stored and deleted, so only the second enters the
// wheel (the first used to stay there until its due time, counted in
// InWheel, and cost a claim and a read).
func TestSameIDTwiceInBatchOneWheelEntry(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.Shards = 1 })
	h.ingest([]codec.Task{sched("x", t0.Add(time.Second), 1), sched("x", t0.Add(2*time.Second), 2), sched("y", t0.Add(time.Second), 3)})
	st := h.e.Stats()
	if st.Pending != 2 || st.Shards[0].InWheel != 2 {
		t.Fatalf("pending %d, in wheel %d; want 2 and 2", st.Pending, st.Shards[0].InWheel)
	}
	h.run()
	h.advance(2 * time.Second)
	if got := h.sink.all(); len(got) != 2 || got[0].ID != "y" || got[1].ID != "x" || got[1].Value != "x#2" {
		t.Fatalf("deliveries %+v, want y, then the second x", got)
	}
}

func TestCancel(t *testing.T) {
	due := t0.Add(time.Hour)
	type step struct {
		task    codec.Task
		advance time.Duration // before ingesting
	}
	cases := []struct {
		name    string
		steps   []step
		oneBtch bool
		fires   string // value that fires, "" none
		opts    func(*Options)
	}{
		{"cancel-after-schedule", []step{{task: sched("x", due, 1)}, {task: cancelTask("x", 2)}}, false, "", nil},
		{"schedule-then-cancel-one-batch", []step{{task: sched("x", due, 1)}, {task: cancelTask("x", 2)}}, true, "", nil},
		{"older-cancel-ignored", []step{{task: sched("x", due, 5)}, {task: cancelTask("x", 4)}}, false, "x#5", nil},
		{"cancel-before-schedule-drops-it", []step{{task: cancelTask("x", 5)}, {task: sched("x", due, 4)}}, false, "", nil},
		{"cancel-before-schedule-cross-partition", []step{{task: at(1, 1, 5, cancelTask("x", 5))}, {task: at(0, 100, 4, sched("x", due, 4))}}, false, "", nil},
		{"newer-schedule-after-cancel", []step{{task: cancelTask("x", 5)}, {task: sched("x", due, 6)}}, false, "x#6", nil},
		// A cancel remembered from a log since deleted does not drop a
		// later schedule of the new log at a lower offset.
		{"old-log-cancel-marker-vs-recreated-log", []step{{task: at(0, 500, 5, cancelTask("x", 5))}, {task: inc(1, at(0, 3, 6, sched("x", due, 3)))}}, false, "x#3", nil},
		{"recreated-log-cancel-at-lower-offset", []step{{task: at(0, 500, 5, sched("x", due, 5))}, {task: inc(1, at(0, 3, 6, cancelTask("x", 3)))}}, false, "", nil},
		{"cancel-marker-expires", []step{{task: cancelTask("x", 5)}, {task: sched("x", due, 4), advance: 24*time.Hour + time.Millisecond}}, false, "x#4", nil},
		{"cancel-marker-alive-before-expiry", []step{{task: cancelTask("x", 5)}, {task: sched("x", due, 4), advance: 24*time.Hour - time.Millisecond}}, false, "", nil},
		{"no-retention-forgets-early-cancel", []step{{task: cancelTask("x", 5)}, {task: sched("x", due, 4), advance: time.Millisecond}}, false, "x#4",
			func(o *Options) { o.CancelRetention = -1 }},
		{"no-retention-cancel-after-schedule", []step{{task: sched("x", due, 1)}, {task: cancelTask("x", 2)}}, false, "",
			func(o *Options) { o.CancelRetention = -1 }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, tc.opts)
			h.run()
			if tc.oneBtch {
				var b []codec.Task
				for _, s := range tc.steps {
					b = append(b, s.task)
				}
				h.ingest(b)
			} else {
				for _, s := range tc.steps {
					if s.advance > 0 {
						h.advance(s.advance)
					}
					h.ingest([]codec.Task{s.task})
				}
			}
			_, err := h.e.Lookup("src", "x")
			if tc.fires == "" && !errors.Is(err, ErrNotFound) {
				t.Fatalf("Lookup after cancel: %v, want ErrNotFound", err)
			}
			h.checkPending()
			h.set(due.Add(time.Hour))
			var got []string
			for _, d := range h.sink.all() {
				got = append(got, d.Value)
			}
			want := []string{}
			if tc.fires != "" {
				want = []string{tc.fires}
			}
			if !slices.Equal(got, want) && !(len(got) == 0 && len(want) == 0) {
				t.Fatalf("fired %v, want %v", got, want)
			}
			h.checkPending()
		})
	}
}

func TestCancelMarkersAreSwept(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.CancelRetention = time.Hour })
	h.run()
	h.ingest([]codec.Task{cancelTask("x", 1), cancelTask("y", 2)})
	countMarkers := func() int {
		n := 0
		for _, id := range []string{"x", "y"} {
			var ex indexEntry
			if found, _ := getIndex(h.e.db, appendIndexKey(nil, "src", id), &ex); found {
				n++
			}
		}
		return n
	}
	if n := countMarkers(); n != 2 {
		t.Fatalf("%d markers, want 2", n)
	}
	for i := 0; i < 30; i++ {
		h.advance(5 * time.Minute)
	}
	if n := countMarkers(); n != 0 {
		t.Fatalf("%d markers left after retention, want 0", n)
	}
}

func TestAdminCancelAndLookup(t *testing.T) {
	h := newHarness(t, nil)
	h.run()
	due := t0.Add(time.Hour)
	h.ingest([]codec.Task{sched("x", due, 1), sched("y", due, 2)})
	info, err := h.e.Lookup("src", "x")
	if err != nil {
		t.Fatal(err)
	}
	if info.ID != "x" || info.Source != "src" || !info.Due.Equal(due) || !info.NextFire.Equal(due) ||
		info.Target != "kafka:out" || info.Origin != "kafka:src/0@1" || info.Attempts != 0 {
		t.Fatalf("Lookup = %+v", info)
	}
	for _, tc := range []struct {
		source, id string
		want       error
	}{
		{"src", "x", nil},
		{"src", "x", ErrNotFound}, // already cancelled
		{"src", "nope", ErrNotFound},
		{"other", "y", ErrNotFound}, // ids are scoped to their source
	} {
		if err := h.e.Cancel(tc.source, tc.id); !errors.Is(err, tc.want) {
			t.Fatalf("Cancel(%s,%s) = %v, want %v", tc.source, tc.id, err, tc.want)
		}
	}
	if _, err := h.e.Lookup("src", "x"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Lookup after Cancel: %v", err)
	}
	// An admin cancel is stamped with the clock: an older schedule is dropped,
	// a newer one accepted.
	h.ingest([]codec.Task{at(3, 1, -10, sched("x", due, 3))})
	if _, err := h.e.Lookup("src", "x"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("older schedule after admin cancel accepted: %v", err)
	}
	h.ingest([]codec.Task{at(3, 2, 10, sched("x", due, 4))})
	if _, err := h.e.Lookup("src", "x"); err != nil {
		t.Fatalf("newer schedule after admin cancel: %v", err)
	}
	h.checkPending()
	h.set(due)
	if got := h.sink.acked(); len(got) != 2 {
		t.Fatalf("fired %v, want x and y", got)
	}
	h.checkPending()
}

// TestLookupCancelSourceWithNUL: the store keys a task by source, 0, id,
// so source "src\x00b" with id "c" would name source "src"'s task
// "b\x00c". Lookup and Cancel refuse such a source as not found and
// leave that task alone.
func TestLookupCancelSourceWithNUL(t *testing.T) {
	h := newHarness(t, nil)
	h.run()
	h.ingest([]codec.Task{sched("b\x00c", t0.Add(time.Hour), 1)})
	if _, err := h.e.Lookup("src\x00b", "c"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Lookup(src\\x00b, c) = %v, want ErrNotFound", err)
	}
	if err := h.e.Cancel("src\x00b", "c"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Cancel(src\\x00b, c) = %v, want ErrNotFound", err)
	}
	if _, err := h.e.Lookup("src", "b\x00c"); err != nil {
		t.Fatalf("the task the NUL source named is gone: %v", err)
	}
}

func TestDeadLettersDeliveredAtOnce(t *testing.T) {
	h := newHarness(t, nil)
	h.run()
	dl := codec.Task{Kind: codec.KindDeadLetter, ID: "bad", Source: "src", Origin: "kafka:src/0@7",
		Transport: codec.TransportKafka, Target: "dlq", Code: codec.CodeBadDue, Detail: "nope"}
	h.ingest([]codec.Task{dl, sched("ok", t0.Add(time.Second), 8), dl})
	got := h.sink.all()
	if len(got) != 2 || got[0].Kind != codec.KindDeadLetter || got[0].Target != "dlq" || got[0].Code != codec.CodeBadDue {
		t.Fatalf("deliveries %+v, want two dead letters", got)
	}
	if _, err := h.e.Lookup("src", "bad"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("dead letter indexed: %v", err)
	}
	h.checkPending()
}

func TestCheckpointsDurableAcrossReopen(t *testing.T) {
	h := newHarness(t, nil)
	if _, ok, err := h.e.Checkpoint("kafka|t|0"); ok || err != nil {
		t.Fatalf("fresh checkpoint: ok=%v err=%v", ok, err)
	}
	h.ingest([]codec.Task{sched("a", t0.Add(time.Hour), 1)}, Checkpoint{Key: "kafka|t|0", Offset: 41}, Checkpoint{Key: "nats|S|c", Offset: 7})
	h.ingest(nil, Checkpoint{Key: "kafka|t|0", Offset: 42})
	h.reopen()
	for _, tc := range []struct {
		key  string
		want int64
		ok   bool
	}{{"kafka|t|0", 42, true}, {"nats|S|c", 7, true}, {"kafka|t|1", 0, false}} {
		got, ok, err := h.e.Checkpoint(tc.key)
		if err != nil || ok != tc.ok || got != tc.want {
			t.Fatalf("Checkpoint(%s) = %d,%v,%v want %d,%v", tc.key, got, ok, err, tc.want, tc.ok)
		}
	}
	if _, err := h.e.Lookup("src", "a"); err != nil {
		t.Fatalf("task ingested with the checkpoint: %v", err)
	}
}

func TestHorizonLoadsFarFutureTasks(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.Horizon = 10 * time.Minute })
	h.run()
	dues := []time.Duration{time.Minute, 9 * time.Minute, 10 * time.Minute, 11 * time.Minute, time.Hour + time.Millisecond,
		25 * time.Hour, 7*24*time.Hour + 123*time.Millisecond, 30 * 24 * time.Hour}
	var batch []codec.Task
	for i, d := range dues {
		batch = append(batch, sched(fmt.Sprintf("d%d", i), t0.Add(d), int64(i+1)))
	}
	h.ingest(batch)
	if st := h.e.Stats(); st.Pending != int64(len(dues)) {
		t.Fatalf("pending %d", st.Pending)
	}
	inWheel := 0
	for _, s := range h.e.Stats().Shards {
		inWheel += s.InWheel
	}
	if inWheel != 2 {
		t.Fatalf("%d tasks in the wheels, want 2 (the rest is beyond the horizon)", inWheel)
	}
	// Walk 31 days in 20-minute steps (twice the horizon, so the loader
	// also jumps); each task fires at the first step
	// at or after its due, exactly once.
	step := 20 * time.Minute
	for h.clk.Now().Before(t0.Add(31 * 24 * time.Hour)) {
		h.advance(step)
		maxWheel := 0
		for _, s := range h.e.Stats().Shards {
			maxWheel = max(maxWheel, s.InWheel)
		}
		if maxWheel > 2 {
			t.Fatalf("at %v: %d entries in a wheel", h.clk.Now(), maxWheel)
		}
	}
	got := h.sink.all()
	if len(got) != len(dues) {
		t.Fatalf("%d deliveries, want %d: %+v", len(got), len(dues), got)
	}
	for _, d := range got {
		var i int
		fmt.Sscanf(d.ID, "d%d", &i)
		due := t0.Add(dues[i])
		if d.At.Before(due) || d.At.Sub(due) >= step {
			t.Fatalf("%s due %v fired at %v", d.ID, due, d.At)
		}
	}
	h.checkPending()
}

// TestHorizonBoundaryProperty ingests tasks due around the moving horizon
// end while the clock moves in small random steps, and checks every task
// fires exactly once and never early.
func TestHorizonBoundaryProperty(t *testing.T) {
	for seed := uint64(1); seed <= 4; seed++ {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			const horizon = time.Second
			h := newHarness(t, func(o *Options) { o.Horizon = horizon; o.Shards = 3; o.FireBatch = 5 })
			h.run()
			rng := rand.New(rand.NewPCG(seed, 99))
			dues := map[string]time.Time{}
			n := int64(0)
			for round := 0; round < 150; round++ {
				var batch []codec.Task
				for k := rng.IntN(6); k > 0; k-- {
					n++
					id := fmt.Sprint("p", n)
					// Around now+horizon/2 (where the loader moves) and
					// now+horizon (the current end), +-50 ms.
					base := horizon
					if rng.IntN(2) == 0 {
						base = horizon / 2
					}
					due := h.clk.Now().Add(base + time.Duration(rng.IntN(101)-50)*time.Millisecond)
					dues[id] = due
					batch = append(batch, sched(id, due, n))
				}
				if len(batch) > 0 {
					h.ingest(batch)
				}
				h.advance(time.Duration(1+rng.IntN(40)) * time.Millisecond)
			}
			h.advance(2 * horizon)
			seen := map[string]int{}
			for _, d := range h.sink.all() {
				seen[d.ID]++
				if d.At.Before(dues[d.ID]) {
					t.Fatalf("%s due %v fired early at %v", d.ID, dues[d.ID], d.At)
				}
			}
			for id := range dues {
				if seen[id] != 1 {
					t.Fatalf("%s fired %d times", id, seen[id])
				}
			}
			if len(seen) != len(dues) {
				t.Fatalf("fired %d distinct, ingested %d", len(seen), len(dues))
			}
			h.checkPending()
		})
	}
}

func TestRetryBackoffThenDeadLetter(t *testing.T) {
	h := newHarness(t, func(o *Options) {
		o.Retry = RetryPolicy{Initial: 100 * time.Millisecond, Max: 300 * time.Millisecond, Multiplier: 2, Jitter: -1, MaxAttempts: 4}
	})
	h.sink.setFail(func(t *codec.Task) error {
		if t.Target == "out" {
			return errors.New("broker says no")
		}
		return nil
	})
	h.run()
	h.ingest([]codec.Task{sched("x", t0, 1)})
	// Attempts at 0, +100, +300 (100+200), +600 (capped 300), then DLQ at once.
	for _, d := range []time.Duration{99, 1, 199, 1, 299, 1} {
		h.advance(d * time.Millisecond)
	}
	got := h.sink.all()
	wantAt := []time.Duration{0, 100, 300, 600, 600}
	if len(got) != len(wantAt) {
		t.Fatalf("deliveries %+v", got)
	}
	for i, d := range got {
		if !d.At.Equal(t0.Add(wantAt[i] * time.Millisecond)) {
			t.Fatalf("delivery %d at %v, want +%v", i, d.At.Sub(t0), wantAt[i]*time.Millisecond)
		}
		if i < 4 && (d.Err == nil || d.Attempts != uint32(i)) {
			t.Fatalf("delivery %d: %+v", i, d)
		}
	}
	dl := got[4]
	if dl.Kind != codec.KindDeadLetter || dl.Target != "dlq" || dl.Code != codec.CodePublishFailed || dl.Err != nil {
		t.Fatalf("dead letter %+v", dl)
	}
	if _, err := h.e.Lookup("src", "x"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("dead-lettered task still indexed: %v", err)
	}
	h.checkPending()
}

// TestRejectedDeadLetteredAtOnce: a task its sink rejects
// (*RejectedError: the running config refuses its target) is not retried:
// it becomes a dead letter with the rejection's code and text at once,
// and leaves the index.
func TestRejectedDeadLetteredAtOnce(t *testing.T) {
	h := newHarness(t, func(o *Options) {
		o.Retry = RetryPolicy{Initial: 100 * time.Millisecond, Max: 300 * time.Millisecond, Multiplier: 2, Jitter: -1, MaxAttempts: 4}
	})
	h.sink.setFail(func(t *codec.Task) error {
		if t.Target == "out" {
			return fmt.Errorf("sink: %w", &RejectedError{Code: codec.CodeTargetNotAllowed, Err: errors.New("target kafka:out is no longer allowed")})
		}
		return nil
	})
	h.run()
	h.ingest([]codec.Task{sched("x", t0, 1)})
	h.advance(0)
	got := h.sink.all()
	if len(got) != 2 || got[0].Err == nil {
		t.Fatalf("deliveries %+v, want the rejected try, then its dead letter at once", got)
	}
	dl := got[1]
	if dl.Kind != codec.KindDeadLetter || dl.Target != "dlq" || dl.Code != codec.CodeTargetNotAllowed || dl.Err != nil || !dl.At.Equal(t0) {
		t.Fatalf("dead letter %+v", dl)
	}
	if d := dl.Detail; d != "target kafka:out is no longer allowed" {
		t.Errorf("detail %q", d)
	}
	if _, err := h.e.Lookup("src", "x"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("dead-lettered task still indexed: %v", err)
	}
	h.checkPending()
}

// TestOutageDoesNotUseRetryBudget: a target broker that cannot be reached
// (ErrUnavailable) charges no attempt, however long it lasts; the waits
// double from Initial up to Max, and the task is delivered once the broker
// is back. A refusal afterwards is charged as usual.
func TestOutageDoesNotUseRetryBudget(t *testing.T) {
	h := newHarness(t, func(o *Options) {
		o.Retry = RetryPolicy{Initial: 100 * time.Millisecond, Max: time.Second, Multiplier: 2, Jitter: -1, MaxAttempts: 2}
	})
	down := fmt.Errorf("dial broker: connection refused: %w", ErrUnavailable)
	h.sink.setFail(func(*codec.Task) error { return down })
	h.run()
	h.ingest([]codec.Task{sched("x", t0, 1)})
	// Tries at 0, then each wait as long as the task is overdue: +100,
	// +200, +400, +800, then Max: +1800, +2800.
	for _, d := range []time.Duration{100, 100, 200, 400, 1000, 1000} {
		h.advance(d * time.Millisecond)
	}
	if info, err := h.e.Lookup("src", "x"); err != nil || info.Attempts != 0 {
		t.Fatalf("after the outage: %+v, %v; want pending with 0 attempts", info, err)
	}
	// The broker answers again but refuses: that is an attempt.
	h.sink.setFail(func(*codec.Task) error { return errors.New("broker says no") })
	h.advance(time.Second)
	h.sink.setFail(nil)
	h.advance(100 * time.Millisecond)
	got := h.sink.all()
	wantAt := []time.Duration{0, 100, 200, 400, 800, 1800, 2800, 3800, 3900}
	if len(got) != len(wantAt) {
		t.Fatalf("deliveries %+v", got)
	}
	for i, d := range got {
		if !d.At.Equal(t0.Add(wantAt[i] * time.Millisecond)) {
			t.Fatalf("delivery %d at %v, want +%v", i, d.At.Sub(t0), wantAt[i]*time.Millisecond)
		}
		wantAttempts, wantErr := uint32(0), true
		if i == len(got)-1 {
			wantAttempts, wantErr = 1, false
		}
		if d.Kind != codec.KindSchedule || d.Attempts != wantAttempts || (d.Err != nil) != wantErr {
			t.Fatalf("delivery %d: %+v", i, d)
		}
	}
	if n := h.e.Stats().Pending; n != 0 {
		t.Fatalf("pending %d after delivery", n)
	}
	h.checkPending()
}

func TestFailingDeadLetterQueue(t *testing.T) {
	h := newHarness(t, func(o *Options) {
		o.Retry = RetryPolicy{Initial: 100 * time.Millisecond, Max: time.Second, Jitter: -1, MaxAttempts: 1}
	})
	dlqDown := true
	h.sink.setFail(func(t *codec.Task) error {
		if t.Target == "out" || dlqDown {
			return errors.New("unavailable")
		}
		return nil
	})
	h.run()
	h.ingest([]codec.Task{sched("x", t0, 1)})
	if err := h.e.Err(); err == nil || !strings.Contains(err.Error(), "dead-letter") {
		t.Fatalf("Err() = %v while the DLQ fails", err)
	}
	// Retried forever with capped backoff: 100, 200, 400, 800, 1000, 1000...
	for i := 0; i < 20; i++ {
		h.advance(time.Second)
	}
	if n := h.e.Stats().Pending; n != 1 {
		t.Fatalf("dead letter dropped: pending %d", n)
	}
	h.sink.setFail(func(t *codec.Task) error {
		if t.Target == "out" {
			return errors.New("unavailable")
		}
		return nil
	})
	h.advance(time.Second)
	if err := h.e.Err(); err != nil {
		t.Fatalf("Err() = %v after the DLQ recovered", err)
	}
	if n := h.e.Stats().Pending; n != 0 {
		t.Fatalf("pending %d after the DLQ recovered", n)
	}
	h.checkPending()
}

func TestRecoveryAfterReopen(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.Horizon = time.Minute })
	dues := map[string]time.Duration{"a": time.Second, "b": 30 * time.Second, "c": 10 * time.Minute, "d": 48 * time.Hour}
	var batch []codec.Task
	n := int64(0)
	for _, id := range []string{"a", "b", "c", "d"} {
		n++
		batch = append(batch, sched(id, t0.Add(dues[id]), n))
	}
	h.ingest(batch)
	h.ingest([]codec.Task{cancelTask("zz", 10)})
	seqBefore := h.e.seq.Load()
	h.close()
	// Down for 20 minutes: a, b and c are overdue on restart.
	h.clk.Advance(20 * time.Minute)
	h.open()
	if st := h.e.Stats(); st.Pending != 4 {
		t.Fatalf("recovered pending %d, want 4", st.Pending)
	}
	if h.e.seq.Load() < seqBefore {
		t.Fatalf("sequence went back: %d < %d", h.e.seq.Load(), seqBefore)
	}
	h.checkPending()
	h.run()
	if got := h.sink.acked(); !slices.Equal(got, []string{"a", "b", "c"}) && len(got) != 3 {
		t.Fatalf("after recovery fired %v, want a b c at once", got)
	}
	// The cancel marker survived too.
	h.ingest([]codec.Task{sched("zz", t0.Add(time.Hour), 9)})
	if _, err := h.e.Lookup("src", "zz"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("cancel marker lost in recovery: %v", err)
	}
	h.set(t0.Add(48 * time.Hour))
	if got := h.sink.acked(); len(got) != 4 {
		t.Fatalf("fired %v", got)
	}
	h.checkPending()
}

func TestShardCountChangeRefused(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.Shards = 4 })
	h.close()
	o := h.opts
	o.Shards = 5
	if _, err := Open(o); err == nil || !strings.Contains(err.Error(), "shard count") {
		t.Fatalf("Open with another shard count: %v", err)
	}
}

func TestClockStepBackNeverFiresEarly(t *testing.T) {
	h := newHarness(t, nil)
	h.run()
	h.ingest([]codec.Task{sched("a", t0.Add(10*time.Second), 1)})
	h.advance(9 * time.Second)
	h.set(t0.Add(-time.Hour)) // NTP step back
	h.ingest([]codec.Task{sched("b", t0.Add(5*time.Second), 2)})
	h.advance(time.Hour + 4*time.Second) // t0+4s
	if got := h.sink.acked(); len(got) != 0 {
		t.Fatalf("fired %v before due after a clock step back", got)
	}
	h.advance(time.Second) // t0+5s: b is due, but the wheel's time is t0+9s; it may only be late
	h.advance(5 * time.Second)
	for _, d := range h.sink.all() {
		due := map[string]time.Time{"a": t0.Add(10 * time.Second), "b": t0.Add(5 * time.Second)}[d.ID]
		if d.At.Before(due) {
			t.Fatalf("%s fired at %v before due %v", d.ID, d.At, due)
		}
	}
	if got := h.sink.acked(); len(got) != 2 {
		t.Fatalf("fired %v, want a and b", got)
	}
}

func TestIngestRejectsUnknownKind(t *testing.T) {
	h := newHarness(t, nil)
	err := h.e.Ingest(context.Background(), []codec.Task{sched("a", t0, 1), {Kind: 9}}, nil)
	if !errors.Is(err, ErrInvalidTask) {
		t.Fatalf("Ingest = %v, want ErrInvalidTask", err)
	}
	if n := countTaskKeys(t, h.e); n != 0 {
		t.Fatalf("partial batch stored: %d tasks", n)
	}
}

func TestStats(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.Shards = 2 })
	h.ingest([]codec.Task{sched("a", t0.Add(-time.Second), 1), sched("b", t0.Add(time.Hour), 2)})
	st := h.e.Stats()
	if st.Pending != 2 || len(st.Shards) != 2 {
		t.Fatalf("%+v", st)
	}
	if !st.NextDue.Equal(t0.Add(-time.Second)) || !st.OldestOverdue.Equal(t0.Add(-time.Second)) {
		t.Fatalf("next %v oldest overdue %v", st.NextDue, st.OldestOverdue)
	}
	if !st.Horizon.Equal(t0.Add(10 * time.Minute)) {
		t.Fatalf("horizon %v", st.Horizon)
	}
	h.run()
	st = h.e.Stats()
	if st.Pending != 1 || !st.NextDue.Equal(t0.Add(time.Hour)) || !st.OldestOverdue.IsZero() {
		t.Fatalf("after firing: %+v", st)
	}
}

// TestStatsNextDueExact: tasks in the wheel's coarse levels are reported at
// their own due time, not the start of their bucket.
func TestStatsNextDueExact(t *testing.T) {
	for _, d := range []time.Duration{
		50 * time.Millisecond, // finest level
		9*time.Minute + 7*time.Second,
		time.Hour + 3*time.Minute + 7*time.Millisecond, // past the horizon: store only
		49*time.Hour + 17*time.Second,
	} {
		t.Run(d.String(), func(t *testing.T) {
			h := newHarness(t, func(o *Options) { o.Shards = 1 })
			h.run()
			h.advance(1234 * time.Millisecond) // the wheel's time off any bucket edge
			due := h.clk.Now().Add(d)
			h.ingest([]codec.Task{sched("a", due, 1), sched("b", due.Add(time.Hour), 2)})
			st := h.e.Stats()
			if !st.NextDue.Equal(due) || !st.Shards[0].NextDue.Equal(due) {
				t.Fatalf("next due %v (shard %v), want %v", st.NextDue, st.Shards[0].NextDue, due)
			}
			if !st.OldestOverdue.IsZero() {
				t.Fatalf("oldest overdue %v with nothing due", st.OldestOverdue)
			}
		})
	}
}

// TestStatsOldestOverdueDuringRetries: a task whose publishes fail waits
// at its retry time; it is overdue since its due time all along, refused or
// unreachable, and no longer once delivered, replaced or cancelled.
// TestAdminCancelMarkerNotOlderThanItsTask: an admin cancel is stamped
// with the bridge clock, but the task it cancels may carry a broker time
// ahead of it (a producer's CreateTime, clock skew). The marker must still
// win over that task's message read again and over an older schedule of
// the id from another partition, or a 204'd cancel would be delivered.
func TestAdminCancelMarkerNotOlderThanItsTask(t *testing.T) {
	due := t0.Add(time.Hour)
	x := at(0, 7, 5000, sched("x", due, 1)) // broker time t0+5 s, bridge clock t0
	for _, tc := range []struct {
		name  string
		again codec.Task
		want  error // from Lookup after the cancel and the ingest of again
	}{
		{"the same message read again", x, ErrNotFound},
		{"an older schedule from another partition", at(1, 3, 4000, sched("x", due, 2)), ErrNotFound},
		{"a newer schedule from another partition", at(1, 4, 6000, sched("x", due, 3)), nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			h.run()
			h.ingest([]codec.Task{x})
			if err := h.e.Cancel("src", "x"); err != nil {
				t.Fatal(err)
			}
			h.ingest([]codec.Task{tc.again})
			if _, err := h.e.Lookup("src", "x"); !errors.Is(err, tc.want) {
				t.Fatalf("Lookup after the cancel and %s: %v, want %v", tc.name, err, tc.want)
			}
			h.set(due)
			wantFired := 0
			if tc.want == nil {
				wantFired = 1
			}
			if got := h.sink.acked(); len(got) != wantFired {
				t.Fatalf("fired %v, want %d", got, wantFired)
			}
		})
	}
}

// TestStatsOldestOverdueWhilePublishing: a claimed batch is out of the
// wheel but not delivered while the sink publishes it (a slow or hanging
// target); Stats still counts its due time as overdue.
func TestStatsOldestOverdueWhilePublishing(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.Shards = 1 })
	due := t0.Add(-time.Minute)
	h.ingest([]codec.Task{sched("x", due, 1)})
	sink, cancel, done := runUntilInFlight(t, h, 1)
	st := h.e.Stats()
	close(sink.release)
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	if !st.OldestOverdue.Equal(due) || st.Pending != 1 {
		t.Fatalf("while its publish is in flight: oldest overdue %v, pending %d; want %v, 1", st.OldestOverdue, st.Pending, due)
	}
	if st := h.e.Stats(); !st.OldestOverdue.IsZero() || st.Pending != 0 {
		t.Fatalf("after the delivery: oldest overdue %v, pending %d; want none", st.OldestOverdue, st.Pending)
	}
}

// TestOutageReported: tasks waiting for an unreachable target make Err
// (readiness) name the target transport, per transport: a delivery to the
// other transport does not clear it, one to the same transport does, and
// an outage no task confirmed for twice Retry.Max (its tasks cancelled)
// is dropped.
func TestOutageReported(t *testing.T) {
	down := fmt.Errorf("NOT_ENOUGH_REPLICAS: %w", ErrUnavailable)
	for _, tc := range []struct {
		name string
		end  func(h *harness)
		want bool // Err still reports the outage after end
	}{
		{"a delivery to the other transport", func(h *harness) {
			n := sched("n", h.clk.Now(), 2)
			n.Transport = codec.TransportNATS
			h.ingest([]codec.Task{n})
			h.advance(time.Second)
		}, true},
		{"a delivery to the same transport", func(h *harness) {
			h.sink.setFail(nil)
			h.advance(10 * time.Second)
		}, false},
		{"its task cancelled, then twice retry.max", func(h *harness) {
			h.ingest([]codec.Task{cancelTask("x", 3)})
			h.advance(21 * time.Second)
		}, false},
		{"its task cancelled, less than twice retry.max", func(h *harness) {
			h.ingest([]codec.Task{cancelTask("x", 3)})
			h.advance(15 * time.Second)
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, func(o *Options) {
				o.Shards = 1
				o.Retry = RetryPolicy{Initial: time.Second, Max: 10 * time.Second, Multiplier: 2, Jitter: -1, MaxAttempts: 2}
			})
			h.sink.setFail(func(t *codec.Task) error {
				if t.Transport == codec.TransportKafka {
					return down
				}
				return nil
			})
			h.run()
			if err := h.e.Err(); err != nil {
				t.Fatalf("Err before the outage: %v", err)
			}
			h.ingest([]codec.Task{sched("x", t0, 1)})
			for range 3 {
				h.advance(time.Second)
			}
			err := h.e.Err()
			if err == nil || !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "kafka target unavailable") {
				t.Fatalf("Err during the outage = %v, want the kafka target unavailable", err)
			}
			tc.end(h)
			if err := h.e.Err(); (err != nil) != tc.want {
				t.Fatalf("Err after %s = %v, want reported %v", tc.name, err, tc.want)
			}
		})
	}
}

func TestStatsOldestOverdueDuringRetries(t *testing.T) {
	down := fmt.Errorf("dial: connection refused: %w", ErrUnavailable)
	for _, tc := range []struct {
		name string
		err  error
		end  func(h *harness)
	}{
		{"refused then delivered", errors.New("broker says no"), func(h *harness) {
			h.sink.setFail(nil)
			h.advance(time.Minute)
		}},
		{"unreachable then delivered", down, func(h *harness) {
			h.sink.setFail(nil)
			h.advance(time.Minute)
		}},
		{"replaced while waiting", down, func(h *harness) {
			h.ingest([]codec.Task{sched("x", h.clk.Now().Add(time.Hour), 2)})
		}},
		{"cancelled while waiting", down, func(h *harness) {
			h.ingest([]codec.Task{cancelTask("x", 3)})
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, func(o *Options) {
				o.Shards = 1
				o.Retry = RetryPolicy{Initial: time.Second, Max: 10 * time.Second, Multiplier: 2, Jitter: -1, MaxAttempts: 100}
			})
			err := tc.err
			h.sink.setFail(func(*codec.Task) error { return err })
			h.run()
			due := t0.Add(time.Second)
			h.ingest([]codec.Task{sched("x", due, 1)})
			for range 4 { // tries at +1 s, +2 s, +4 s
				h.advance(time.Second)
			}
			if n := len(h.sink.all()); n < 2 {
				t.Fatalf("%d attempts, want a few", n)
			}
			st := h.e.Stats()
			if !st.OldestOverdue.Equal(due) || !st.Shards[0].OldestOverdue.Equal(due) {
				t.Fatalf("oldest overdue %v while retrying, want the due time %v", st.OldestOverdue, due)
			}
			if !st.NextDue.After(h.clk.Now()) {
				t.Fatalf("next due %v, want the retry time after now %v", st.NextDue, h.clk.Now())
			}
			tc.end(h)
			if st := h.e.Stats(); !st.OldestOverdue.IsZero() {
				t.Fatalf("oldest overdue %v after the task %s", st.OldestOverdue, tc.name)
			}
		})
	}
}

// TestStatsOldestOverdueFailingDeadLetter: a dead letter whose DLQ keeps
// refusing it waits at its retry time like a task; oldest overdue shows
// its due time until the DLQ takes it.
func TestStatsOldestOverdueFailingDeadLetter(t *testing.T) {
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.Retry = RetryPolicy{Initial: time.Second, Max: 10 * time.Second, Multiplier: 2, Jitter: -1, MaxAttempts: 3}
	})
	h.sink.setFail(func(*codec.Task) error { return errors.New("dlq says no") })
	h.run()
	due := t0.Add(time.Second)
	h.set(due)
	h.ingest([]codec.Task{{Kind: codec.KindDeadLetter, ID: "bad", Source: "src", Origin: "kafka:src/0@9", Stamp: ms(due), Due: ms(due),
		Transport: codec.TransportKafka, Target: "dlq", Code: codec.CodeBadDue}})
	for range 4 {
		h.advance(time.Second)
	}
	if n := len(h.sink.all()); n < 2 {
		t.Fatalf("%d attempts, want a few", n)
	}
	if st := h.e.Stats(); !st.OldestOverdue.Equal(due) {
		t.Fatalf("oldest overdue %v while the DLQ refuses the dead letter, want its due time %v", st.OldestOverdue, due)
	}
	h.sink.setFail(nil)
	h.advance(time.Minute)
	if acked := h.sink.acked(); !slices.Equal(acked, []string{"bad"}) {
		t.Fatalf("acknowledged %v, want the dead letter", acked)
	}
	if st := h.e.Stats(); !st.OldestOverdue.IsZero() || st.Pending != 0 {
		t.Fatalf("after the DLQ took it: oldest overdue %v, pending %d", st.OldestOverdue, st.Pending)
	}
}

func TestClosedEngine(t *testing.T) {
	h := newHarness(t, nil)
	h.close()
	e, err := Open(h.opts)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	if err := e.Ingest(context.Background(), []codec.Task{sched("a", t0, 1)}, nil); !errors.Is(err, ErrClosed) {
		t.Fatalf("Ingest after Close: %v", err)
	}
	if _, err := e.Lookup("src", "a"); !errors.Is(err, ErrClosed) {
		t.Fatalf("Lookup after Close: %v", err)
	}
}

// TestFiredTombstonesClearedWithoutLoss: after tasks fire, the loader
// range-deletes the space before the first stored task; a task ingested
// later with an earlier due (overdue) must still fire, also after a
// restart.
func TestFiredTombstonesClearedWithoutLoss(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.Shards = 1; o.Horizon = time.Minute })
	h.run()
	var batch []codec.Task
	for i := 0; i < 50; i++ {
		batch = append(batch, sched(fmt.Sprint("f", i), t0.Add(time.Duration(i)*time.Second), int64(i+1)))
	}
	batch = append(batch, sched("later", t0.Add(time.Hour), 100))
	h.ingest(batch)
	h.advance(2 * time.Minute) // fires f*, moves the horizon, clears
	s := h.e.shards[0]
	s.mu.Lock()
	cleared := s.clears > 0
	s.mu.Unlock()
	if !cleared {
		t.Fatal("no range deletion after the horizon moved")
	}
	// Tasks fired below the same first stored task ("later") as at the
	// last clearing: their tombstones are cleared by the next one all the
	// same (the range used to end at the first stored task, and was not
	// made again while that stayed first).
	for i := range 3 {
		id := fmt.Sprint("more", i)
		h.ingest([]codec.Task{sched(id, h.clk.Now().Add(time.Second), int64(102+i))})
		s.mu.Lock()
		clears := s.clears
		s.mu.Unlock()
		h.advance(time.Second)
		if got := h.sink.acked(); got[len(got)-1] != id {
			t.Fatalf("fired %v, want %s last", got, id)
		}
		h.advance(time.Minute)
		s.mu.Lock()
		again := s.clears
		s.mu.Unlock()
		if again <= clears {
			t.Fatalf("round %d: no range deletion after a task fired since the last one", i)
		}
	}
	h.stop()
	h.ingest([]codec.Task{sched("overdue", t0.Add(-time.Hour), 101)})
	h.reopen()
	if st := h.e.Stats(); st.Pending != 2 {
		t.Fatalf("pending %d after reopen, want 2 (later, overdue)", st.Pending)
	}
	h.checkPending()
	h.sink.reset()
	h.run()
	if got := h.sink.acked(); !slices.Equal(got, []string{"overdue"}) {
		t.Fatalf("fired %v, want [overdue]", got)
	}
}

// TestRetryKeepsIncarnation: a failed publish rewrites the task's index
// entry from its envelope; the entry must keep the incarnation of the log
// the task came from, or a later message of that log at a lower offset
// (and a later broker time) would be compared by offset and dropped.
func TestRetryKeepsIncarnation(t *testing.T) {
	h := newHarness(t, func(o *Options) {
		o.Retry = RetryPolicy{Initial: 100 * time.Millisecond, Max: 100 * time.Millisecond, Multiplier: 2, Jitter: -1, MaxAttempts: 10}
	})
	h.sink.setFail(func(t *codec.Task) error {
		if string(t.Value) == "x#1" {
			return errors.New("broker says no")
		}
		return nil
	})
	h.run()
	// Incarnation 0 is the first log, and the envelope version 1 the
	// retry would rewrite without an incarnation: use the new log's.
	h.ingest([]codec.Task{inc(1, at(0, 9, 5, sched("x", t0, 1)))})
	h.advance(time.Millisecond) // the first attempt fails; retry in 100 ms
	if got := h.sink.all(); len(got) != 1 || got[0].Err == nil {
		t.Fatalf("deliveries %+v, want one failed attempt", got)
	}
	// Same log, lower offset, earlier broker time: older, dropped.
	h.ingest([]codec.Task{inc(1, at(0, 8, 6, sched("x", t0.Add(time.Hour), 2)))})
	if info, err := h.e.Lookup("src", "x"); err != nil || !info.Due.Equal(t0) {
		t.Fatalf("after an older message of the same log: %+v, %v; want the retrying task due %v", info, err, t0)
	}
	// A third log's message, lower offset, later broker time: newer.
	h.ingest([]codec.Task{inc(2, at(0, 0, 7, sched("x", t0.Add(time.Hour), 3)))})
	info, err := h.e.Lookup("src", "x")
	if err != nil {
		t.Fatal(err)
	}
	if !info.Due.Equal(t0.Add(time.Hour)) {
		t.Fatalf("due %v, want the third log's schedule at %v", info.Due, t0.Add(time.Hour))
	}
	h.set(t0.Add(2 * time.Hour))
	var fired []string
	for _, d := range h.sink.all() {
		if d.Err == nil {
			fired = append(fired, d.Value)
		}
	}
	if !slices.Equal(fired, []string{"x#3"}) {
		t.Fatalf("delivered %v, want [x#3]", fired)
	}
	h.checkPending()
}

// TestOpenCreatesPrivateDir: a store directory Open creates (and its
// missing parents) is 0700, since it holds every payload; an existing
// one keeps its mode.
func TestOpenCreatesPrivateDir(t *testing.T) {
	base := t.TempDir()
	for _, tc := range []struct {
		name     string
		existing os.FileMode // 0: Open creates it
		want     os.FileMode
	}{
		{"created", 0, 0o700},
		{"existing", 0o750, 0o750},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(base, tc.name, "data")
			if tc.existing != 0 {
				if err := os.MkdirAll(dir, tc.existing); err != nil {
					t.Fatal(err)
				}
				if err := os.Chmod(dir, tc.existing); err != nil { // past the umask
					t.Fatal(err)
				}
			}
			e, err := Open(Options{Dir: dir, Logger: zap.NewNop()})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			fi, err := os.Stat(dir)
			if err != nil {
				t.Fatal(err)
			}
			if got := fi.Mode().Perm(); got != tc.want {
				t.Fatalf("store directory mode %v, want %v", got, tc.want)
			}
		})
	}
}

// TestClearFiredReadErrorKeepsStored: when reading the shard's first
// stored task fails (a read error on the table that holds it), no range
// deletion is made: taken for an empty shard, the range reached now and
// deleted every stored task due by then (review).
func TestClearFiredReadErrorKeepsStored(t *testing.T) {
	toggle := &errorfs.Toggle{Injector: errorfs.InjectorFunc(func(op errorfs.Op) error {
		if strings.HasSuffix(op.Path, ".sst") && (op.Kind == errorfs.OpFileRead || op.Kind == errorfs.OpFileReadAt) {
			return errorfs.ErrInjected
		}
		return nil
	})}
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.FS = errorfs.Wrap(vfs.Default, toggle)
	})
	for i := range 5 {
		h.ingest([]codec.Task{sched(fmt.Sprint("t", i), t0.Add(time.Duration(i+1)*time.Second), int64(i+1))})
	}
	before := countTaskKeys(t, h.e)
	if err := h.e.db.Flush(); err != nil { // to a table whose blocks are not cached yet
		t.Fatal(err)
	}
	h.clk.Advance(time.Minute) // all five overdue, none fired (no Run)
	s := h.e.shards[0]
	toggle.On()
	s.mu.Lock()
	s.firedSinceClear = 1      // as after any delivery
	s.horizonEnd = h.e.nowMs() // due to move: a clear is due
	s.mu.Unlock()
	var cleared atomic.Bool
	h.e.testHookClear = func([]byte) { cleared.Store(true) }
	s.clearFired(h.e.nowMs())
	toggle.Off()
	if after := countTaskKeys(t, h.e); after != before {
		t.Fatalf("clearFired deleted %d stored, undelivered tasks", before-after)
	}
	if cleared.Load() {
		t.Fatal("clearFired made a range deletion after its read failed")
	}
}

// TestRecoveryOverdueBacklogInBuckets: a backlog that came due while the
// engine was down (a herd due at one instant, and an earlier task) is put
// in the wheel's buckets at recovery, the wheel starting at the earliest
// stored fire time, not in its late list: a task ingested due before the
// herd would otherwise be inserted into that sorted list with a copy of
// the rest of the herd (BenchmarkIngestBeforeOverdueHerd). The backlog
// then fires in due order, equal dues in ingest order, and the task
// ingested after the restart in its place.
func TestRecoveryOverdueBacklogInBuckets(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.Shards = 1; o.FireBatch = 16 })
	herd := t0.Add(30 * time.Minute)
	var want []string
	h.ingest([]codec.Task{sched("early", t0.Add(10*time.Minute), 1)})
	want = append(want, "early")
	var batch []codec.Task
	for i := range 100 {
		id := fmt.Sprintf("h%03d", i)
		batch = append(batch, sched(id, herd, int64(i+2)))
	}
	h.ingest(batch)
	h.clk.Set(t0.Add(time.Hour)) // down over both due times
	h.reopen()
	s := h.e.shards[0]
	s.mu.Lock()
	start := s.w.Now()
	s.mu.Unlock()
	if first := t0.Add(10 * time.Minute).UnixMilli(); start != first {
		t.Fatalf("wheel starts at %v, want the earliest stored fire time %v", time.UnixMilli(start).UTC(), time.UnixMilli(first).UTC())
	}
	h.ingest([]codec.Task{sched("between", t0.Add(20*time.Minute), 200)})
	want = append(want, "between")
	for i := range 100 {
		want = append(want, fmt.Sprintf("h%03d", i))
	}
	h.run()
	h.advance(time.Millisecond)
	if got := h.sink.acked(); !slices.Equal(got, want) {
		t.Fatalf("order after recovery:\n got %v\nwant %v", got, want)
	}
	h.checkPending()
}
