package shard

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/metrics"
)

// stuckOf lists the engine's stuck entries, failing the test on an error.
func stuckOf(t *testing.T, e *Engine) []StuckEntry {
	t.Helper()
	l, err := e.StuckEntries(0)
	if err != nil {
		t.Fatalf("StuckEntries: %v", err)
	}
	if l.Total != len(l.Entries) {
		t.Fatalf("StuckEntries: total %d, %d listed", l.Total, len(l.Entries))
	}
	return l.Entries
}

// recordsOf returns the keys of the records with prefix p in the store.
func recordsOf(t *testing.T, e *Engine, p byte) [][]byte {
	t.Helper()
	it, err := e.db.NewIter(&pebble.IterOptions{LowerBound: []byte{p}, UpperBound: []byte{p + 1}})
	if err != nil {
		t.Fatal(err)
	}
	defer it.Close()
	var out [][]byte
	for it.First(); it.Valid(); it.Next() {
		out = append(out, slices.Clone(it.Key()))
	}
	return out
}

// released returns what AwaitStored (awaitAsync) returned; the deadline
// only turns a hang into a failure.
func released(t *testing.T, ch chan error) error {
	t.Helper()
	select {
	case err := <-ch:
		return err
	case <-time.After(20 * time.Second):
		t.Fatal("AwaitStored still waits")
		return nil
	}
}

// taskKeys returns the t keys in the store.
func taskKeys(t *testing.T, e *Engine) [][]byte { return recordsOf(t, e, prefixTask) }

// corrupt overwrites the stored envelope under key with garbage.
func corrupt(t *testing.T, e *Engine, key []byte) {
	t.Helper()
	if err := e.db.Set(key, []byte("not an envelope"), pebble.Sync); err != nil {
		t.Fatal(err)
	}
}

// A held dead letter (its DLQ fails as a whole) and a parked one (its DLQ
// refuses it as this message) are listed with what their envelope and
// their failure say. DropStuck removes each for good: its Handle's wait
// and its checkpoint key's hold end, the pending count, the parked gauge
// and Err follow, the DLQ never gets it, and after a restart it is neither
// listed nor held nor stored ('t', 'f' and 'w' records gone).
func TestDropStuckDeadLetter(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name  string
		err   error
		state StuckState
	}{
		{"held", errors.New("kafka: publish to \"dlq\": TOPIC_AUTHORIZATION_FAILED"), StuckHeld},
		{"parked", fmt.Errorf("kafka: publish to \"dlq\": %w: message too large", ErrRefused), StuckParked},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := metrics.New(nil)
			h := newHarness(t, func(o *Options) {
				o.Retry = parkPolicy
				o.Metrics = m
			})
			h.sink.setFail(func(t *codec.Task) error {
				if t.ID == "bad" {
					return tc.err
				}
				return nil
			})
			h.run()
			const key = "kafka|src|0"
			d, err := h.e.IngestAwait(ctx, []codec.Task{deadLetter("bad", 7), sched("later", t0.Add(time.Hour), 8)},
				[]Checkpoint{{Key: key, Offset: 8}})
			if err != nil {
				t.Fatal(err)
			}
			h.settle()
			if tc.state == StuckParked {
				h.advanceUntil("the park", func() bool { return d.Parked() == 1 })
				if got := testutil.ToFloat64(m.DeadLettersParkedNow); got != 1 {
					t.Fatalf("parked gauge %v, want 1", got)
				}
			} else {
				h.advanceUntil("attempts past the policy", func() bool { return h.sink.deliveriesOf("bad") > parkPolicy.MaxAttempts })
			}
			list := stuckOf(t, h.e)
			if len(list) != 1 {
				t.Fatalf("stuck entries %+v, want the dead letter", list)
			}
			got := list[0]
			if got.State != tc.state || got.Kind != "dead-letter" || got.Code != string(codec.CodeBadDue) || got.Detail != "nope" ||
				got.Origin != "kafka:src/0@7" || got.Source != "src" || got.Destination != "kafka:dlq" ||
				got.Attempts < uint32(parkPolicy.MaxAttempts) || got.Error != tc.err.Error() || got.NextFire.IsZero() {
				t.Fatalf("stuck entry %+v", got)
			}
			if wantKeys := map[StuckState][]string{StuckHeld: {key}}[tc.state]; !slices.Equal(got.HeldKeys, wantKeys) {
				t.Fatalf("held keys %q, want %q", got.HeldKeys, wantKeys)
			}
			if n := len(recordsOf(t, h.e, prefixDLFailure)); n != 1 {
				t.Fatalf("%d failure records, want 1", n)
			}
			awaited := awaitAsync(h.e, key)
			if tc.state == StuckParked {
				// Its park released the source already.
				if err := released(t, awaited); err != nil {
					t.Fatalf("AwaitStored of a parked dead letter's key = %v", err)
				}
			} else if err, done := pendingErr(awaited); done {
				t.Fatalf("AwaitStored returned %v while the dead letter is held", err)
			}

			if err := h.e.DropStuck(got.Shard, got.Seq); err != nil {
				t.Fatalf("DropStuck: %v", err)
			}
			if tc.state == StuckHeld {
				if err := released(t, awaited); err != nil {
					t.Fatalf("AwaitStored after the drop = %v", err)
				}
			}
			for p, name := range map[byte]string{prefixDLFailure: "f", prefixDLWait: "w"} {
				if recs := recordsOf(t, h.e, p); len(recs) != 0 {
					t.Fatalf("%s records after the drop: %x", name, recs)
				}
			}
			if ok, err := waitReleased(d); !ok {
				t.Fatalf("Handle wait after the drop: %v", err)
			}
			if n := d.Dropped(); n != map[StuckState]int{StuckHeld: 1}[tc.state] {
				t.Fatalf("DeadLetters.Dropped = %d", n)
			}
			if err := h.e.Err(); err != nil {
				t.Fatalf("Err after the drop = %v", err)
			}
			if got := testutil.ToFloat64(m.DeadLettersParkedNow); got != 0 {
				t.Fatalf("parked gauge %v after the drop", got)
			}
			if got := testutil.ToFloat64(m.StuckDropped.WithLabelValues(string(tc.state))); got != 1 {
				t.Fatalf("dropped counter %v, want 1", got)
			}
			if p := h.e.Stats().Pending; p != 1 {
				t.Fatalf("%d pending after the drop, want 1 (the later task)", p)
			}
			h.checkPending()
			if l := stuckOf(t, h.e); len(l) != 0 {
				t.Fatalf("listed after the drop: %+v", l)
			}
			if err := h.e.DropStuck(got.Shard, got.Seq); !errors.Is(err, ErrNotFound) {
				t.Fatalf("second DropStuck = %v, want ErrNotFound", err)
			}
			// The DLQ works again: nothing of the dropped dead letter
			// reaches it.
			n := h.sink.deliveriesOf("bad")
			h.sink.setFail(nil)
			h.advance(5 * time.Second)
			if k := h.sink.deliveriesOf("bad"); k != n {
				t.Fatalf("%d deliveries of the dropped dead letter after the drop", k-n)
			}

			h.stop()
			h.reopen()
			if l := stuckOf(t, h.e); len(l) != 0 {
				t.Fatalf("listed after a restart: %+v", l)
			}
			if n := h.e.AwaitedDeadLetters(key); n != 0 {
				t.Fatalf("%s awaits %d dead letters after a restart", key, n)
			}
			if err := h.e.Err(); err != nil {
				t.Fatalf("Err after a restart = %v", err)
			}
			for p, name := range map[byte]string{prefixDLFailure: "f", prefixDLWait: "w"} {
				if recs := recordsOf(t, h.e, p); len(recs) != 0 {
					t.Fatalf("%s records after the drop: %x", name, recs)
				}
			}
			if n := len(taskKeys(t, h.e)); n != 1 {
				t.Fatalf("%d t keys, want the later task's", n)
			}
			h.checkPending()
		})
	}
}

// An entry whose envelope does not decode is listed once the fire loop
// finds it (when it comes due, again after a restart), with its decode
// error, and DropStuck removes it: an undecodable ordinary task with its
// index entry (a later schedule with its id is new, counted once), an
// undecodable awaited dead letter with the hold of its checkpoint key.
// Nothing of either is delivered.
func TestDropStuckUndecodable(t *testing.T) {
	ctx := context.Background()
	m := metrics.New(nil)
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.Metrics = m
	})
	const key = "kafka|src|0"
	due := t0.Add(time.Second)
	h.ingest([]codec.Task{sched("a", due, 1)})
	if _, err := h.e.IngestAwait(ctx, []codec.Task{deadLetter("dl", 2)}, []Checkpoint{{Key: key, Offset: 2}}); err != nil {
		t.Fatal(err)
	}
	keys := taskKeys(t, h.e)
	if len(keys) != 2 {
		t.Fatalf("%d t keys, want 2", len(keys))
	}
	for _, k := range keys {
		corrupt(t, h.e, k)
	}
	dlSeq, taskSeq := uint64(2), uint64(1)
	h.run()
	// The dead letter is due at once; the task in a second.
	if l := stuckOf(t, h.e); len(l) != 1 || l[0].Seq != dlSeq || l[0].State != StuckUndecodable ||
		l[0].Error == "" || l[0].Code != "" || !slices.Equal(l[0].HeldKeys, []string{key}) {
		t.Fatalf("stuck entries %+v, want the undecodable dead letter holding %s", l, key)
	}
	// Not ready: the dead letter's source waits for it for good.
	if err := h.e.Err(); err == nil || !strings.Contains(err.Error(), "1 stored entries cannot be decoded") ||
		!strings.Contains(err.Error(), "1 of them dead letters their sources wait for") {
		t.Fatalf("Err = %v, want the undecodable held dead letter", err)
	}
	if got := testutil.ToFloat64(m.Undecodable); got != 1 {
		t.Fatalf("undecodable gauge %v, want 1", got)
	}
	// Found again after a restart.
	h.stop()
	h.reopen()
	if l := stuckOf(t, h.e); len(l) != 0 {
		t.Fatalf("listed before the fire loop ran: %+v", l)
	}
	h.run()
	h.set(due)
	l := stuckOf(t, h.e)
	if len(l) != 2 || l[0].Seq != dlSeq || l[1].Seq != taskSeq || l[1].State != StuckUndecodable ||
		!l[1].NextFire.Equal(due) || len(l[1].HeldKeys) != 0 {
		t.Fatalf("stuck entries after the restart %+v, want the dead letter, then the task", l)
	}
	if err := h.e.Err(); err == nil || !strings.Contains(err.Error(), "2 stored entries cannot be decoded") ||
		!strings.Contains(err.Error(), "1 of them dead letters") {
		t.Fatalf("Err after the restart = %v, want both undecodable entries", err)
	}
	if got := testutil.ToFloat64(m.Undecodable); got != 2 {
		t.Fatalf("undecodable gauge %v after the restart, want 2", got)
	}
	if lim, err := h.e.StuckEntries(1); err != nil || lim.Total != 2 || len(lim.Entries) != 1 || lim.Entries[0].Seq != dlSeq {
		t.Fatalf("StuckEntries(1) = %+v, %v", lim, err)
	}
	awaited := awaitAsync(h.e, key)
	if err, done := pendingErr(awaited); done {
		t.Fatalf("AwaitStored = %v while the undecodable dead letter is held", err)
	}

	for _, seq := range []uint64{taskSeq, dlSeq} {
		if err := h.e.DropStuck(0, seq); err != nil {
			t.Fatalf("DropStuck(0, %d): %v", seq, err)
		}
	}
	if err := released(t, awaited); err != nil {
		t.Fatalf("AwaitStored after the drop = %v", err)
	}
	if recs := recordsOf(t, h.e, prefixDLWait); len(recs) != 0 {
		t.Fatalf("w records after the drop: %x", recs)
	}
	if got := testutil.ToFloat64(m.StuckDropped.WithLabelValues(string(StuckUndecodable))); got != 2 {
		t.Fatalf("dropped counter %v, want 2", got)
	}
	if l := stuckOf(t, h.e); len(l) != 0 {
		t.Fatalf("listed after the drop: %+v", l)
	}
	if err := h.e.Err(); err != nil {
		t.Fatalf("Err after the drops = %v", err)
	}
	if got := testutil.ToFloat64(m.Undecodable); got != 0 {
		t.Fatalf("undecodable gauge %v after the drops, want 0", got)
	}
	if _, err := h.e.Lookup("src", "a"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Lookup of the dropped task = %v, want ErrNotFound", err)
	}
	if n := len(recordsOf(t, h.e, prefixIndex)); n != 0 {
		t.Fatalf("%d index entries left", n)
	}
	h.checkPending()
	// The id is free: a later schedule is new work, counted once.
	h.ingest([]codec.Task{sched("a", due.Add(time.Second), 3)})
	if p := h.e.Stats().Pending; p != 1 {
		t.Fatalf("%d pending after a new schedule of the dropped id, want 1", p)
	}
	h.advance(2 * time.Second)
	if got := h.sink.acked(); !slices.Equal(got, []string{"a"}) {
		t.Fatalf("delivered %v, want only the new a", got)
	}
	if v := h.sink.all()[0].Value; v != "a#3" {
		t.Fatalf("delivered %q, want the new schedule", v)
	}
	h.stop()
	h.reopen()
	h.run()
	h.advance(time.Minute)
	if l := stuckOf(t, h.e); len(l) != 0 {
		t.Fatalf("listed after a restart: %+v", l)
	}
	if n := len(taskKeys(t, h.e)) + len(recordsOf(t, h.e, prefixDLWait)); n != 0 {
		t.Fatalf("%d t and w records left", n)
	}
	if n := h.e.AwaitedDeadLetters(key); n != 0 {
		t.Fatalf("%s awaits %d after a restart", key, n)
	}
	h.checkPending()
}

// Only listed entries may be dropped: an ordinary pending task, a dead
// letter that has not failed, an unknown seq or shard are ErrNotFound, and
// nothing changes. A closed engine and a failed store are refused.
func TestDropStuckNotListed(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t, func(o *Options) { o.Shards = 2 })
	h.ingest([]codec.Task{sched("a", t0.Add(time.Hour), 1)})
	if _, err := h.e.IngestAwait(ctx, []codec.Task{deadLetter("dl", 2)}, []Checkpoint{{Key: "k", Offset: 2}}); err != nil {
		t.Fatal(err)
	}
	info, err := h.e.Lookup("src", "a")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		shard int
		seq   uint64
	}{{info.Shard, 1}, {h.e.shardOf("src", "kafka:src/0@2"), 2}, {0, 999}, {1, 999}, {2, 1}, {-1, 1}} {
		if err := h.e.DropStuck(c.shard, c.seq); !errors.Is(err, ErrNotFound) {
			t.Errorf("DropStuck(%d, %d) = %v, want ErrNotFound", c.shard, c.seq, err)
		}
	}
	if p := h.e.Stats().Pending; p != 2 {
		t.Fatalf("%d pending, want 2", p)
	}
	if _, err := h.e.Lookup("src", "a"); err != nil {
		t.Fatalf("Lookup after the refused drops: %v", err)
	}
	if n := h.e.AwaitedDeadLetters("k"); n != 1 {
		t.Fatalf("k awaits %d, want 1", n)
	}
	// A failed store refuses the drop before it looks, as Cancel does.
	_ = h.e.fail("test", errors.New("disk gone"))
	if err := h.e.DropStuck(0, 999); !errors.Is(err, ErrStoreFailed) {
		t.Fatalf("DropStuck on a failed store = %v, want ErrStoreFailed", err)
	}
	e := h.e
	h.close()
	if err := e.DropStuck(0, 999); !errors.Is(err, ErrClosed) {
		t.Fatalf("DropStuck on a closed engine = %v, want ErrClosed", err)
	}
	if _, err := e.StuckEntries(0); !errors.Is(err, ErrClosed) {
		t.Fatalf("StuckEntries on a closed engine = %v, want ErrClosed", err)
	}
}

// gateSink is recSink whose Deliver blocks, before delivering, a batch
// holding the task with id gate until release is closed.
type gateSink struct {
	*recSink
	gate    atomic.Pointer[string]
	entered chan struct{}
	release chan struct{}
}

func (g *gateSink) Deliver(ctx context.Context, batch []*codec.Task) []error {
	gate := g.gate.Load()
	for _, t := range batch {
		if gate != nil && t.ID == *gate {
			g.entered <- struct{}{}
			<-g.release
			break
		}
	}
	return g.recSink.Deliver(ctx, batch)
}

// A held dead letter dropped while the fire loop is publishing it: the
// drop stands whatever the DLQ answers. If it fails, nothing is retried or
// recorded and the drop counts; if the DLQ takes it anyway, it counts as
// dead-lettered, not dropped. Either way the pending count is exact, the
// waits are released once, and nothing comes back after a restart.
func TestDropStuckInFlight(t *testing.T) {
	ctx := context.Background()
	for _, acked := range []bool{false, true} {
		t.Run(fmt.Sprintf("acked=%v", acked), func(t *testing.T) {
			m := metrics.New(nil)
			h := newHarness(t, func(o *Options) {
				o.Shards = 1
				o.Retry = parkPolicy
				o.Metrics = m
			})
			denied := errors.New("kafka: publish to \"dlq\": TOPIC_AUTHORIZATION_FAILED")
			h.sink.setFail(func(*codec.Task) error { return denied })
			g := &gateSink{recSink: h.sink, entered: make(chan struct{}), release: make(chan struct{})}
			var once sync.Once
			release := func() { once.Do(func() { close(g.release) }) }
			t.Cleanup(release) // before the harness stops the loop blocked in the sink
			ctxRun, cancel := context.WithCancel(ctx)
			h.cancel, h.done = cancel, make(chan error, 1)
			go func() { h.done <- h.e.Run(ctxRun, g) }()
			h.settle()
			const key = "kafka|src|0"
			d, err := h.e.IngestAwait(ctx, []codec.Task{deadLetter("bad", 1)}, []Checkpoint{{Key: key, Offset: 1}})
			if err != nil {
				t.Fatal(err)
			}
			h.settle()
			l := stuckOf(t, h.e)
			if len(l) != 1 || l[0].State != StuckHeld {
				t.Fatalf("stuck entries %+v, want the held dead letter", l)
			}
			// Its retry blocks in the sink.
			gate := "bad"
			g.gate.Store(&gate)
			h.clk.Set(l[0].NextFire.Time)
			select {
			case <-g.entered:
			case <-time.After(20 * time.Second):
				t.Fatal("the retry did not reach the sink")
			}
			if acked {
				h.sink.setFail(nil)
			}
			if err := h.e.DropStuck(l[0].Shard, l[0].Seq); err != nil {
				t.Fatalf("DropStuck in flight: %v", err)
			}
			if ok, err := waitReleased(d); !ok {
				t.Fatalf("Handle wait after the drop: %v", err)
			}
			if err := released(t, awaitAsync(h.e, key)); err != nil {
				t.Fatal(err)
			}
			g.gate.Store(nil)
			release()
			h.settle()
			h.advance(10 * time.Second)
			if n := h.sink.deliveriesOf("bad"); n != 2 {
				t.Fatalf("%d deliveries, want the first and the one in flight at the drop", n)
			}
			if l := stuckOf(t, h.e); len(l) != 0 {
				t.Fatalf("listed after the drop: %+v", l)
			}
			if err := h.e.Err(); err != nil {
				t.Fatalf("Err = %v", err)
			}
			wantDropped, wantDL := 1.0, 0.0
			if acked {
				wantDropped, wantDL = 0, 1
			}
			if got := testutil.ToFloat64(m.StuckDropped.WithLabelValues(string(StuckHeld))); got != wantDropped {
				t.Fatalf("dropped counter %v, want %v", got, wantDropped)
			}
			if got := testutil.ToFloat64(m.DeadLettered.WithLabelValues(string(codec.CodeBadDue))); got != wantDL {
				t.Fatalf("dead-lettered counter %v, want %v", got, wantDL)
			}
			if got := testutil.ToFloat64(m.DeadLettersParkedNow); got != 0 {
				t.Fatalf("parked gauge %v", got)
			}
			if p := h.e.Stats().Pending; p != 0 {
				t.Fatalf("%d pending, want 0", p)
			}
			h.checkPending()
			if d.Dropped() != 1 {
				t.Fatalf("DeadLetters.Dropped = %d, want 1", d.Dropped())
			}
			h.stop()
			h.reopen()
			if n := len(taskKeys(t, h.e)) + len(recordsOf(t, h.e, prefixDLFailure)) + len(recordsOf(t, h.e, prefixDLWait)); n != 0 {
				t.Fatalf("%d t, f and w records after a restart", n)
			}
			if h.e.Err() != nil || h.e.AwaitedDeadLetters(key) != 0 || h.e.Stats().Pending != 0 {
				t.Fatalf("after a restart: Err %v, awaited %d, pending %d", h.e.Err(), h.e.AwaitedDeadLetters(key), h.e.Stats().Pending)
			}
		})
	}
}

// An undecodable task that a replace is deleting (decided, not yet
// applied) is no longer stuck: it is not listed and DropStuck does not
// touch it, so the pending count is taken down once, by the replace.
func TestDropStuckWhileReplaced(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.Shards = 1 })
	due := t0.Add(time.Second)
	h.ingest([]codec.Task{sched("a", due, 1)})
	corrupt(t, h.e, taskKeys(t, h.e)[0])
	h.run()
	h.set(due)
	if l := stuckOf(t, h.e); len(l) != 1 || l[0].Seq != 1 {
		t.Fatalf("stuck entries %+v, want the undecodable task", l)
	}
	ingested, resume := ingestHeld(t, h, sched("a", due.Add(time.Second), 2))
	if l := stuckOf(t, h.e); len(l) != 0 {
		t.Fatalf("listed while a replace deletes it: %+v", l)
	}
	dropped := make(chan error, 1)
	go func() { dropped <- h.e.DropStuck(0, 1) }()
	select {
	case err := <-dropped:
		if !errors.Is(err, ErrNotFound) {
			t.Fatalf("DropStuck while a replace deletes it = %v, want ErrNotFound", err)
		}
	case <-time.After(20 * time.Second): // only turns a hang into a failure
		resume()
		t.Fatalf("DropStuck waits for the replace: %v", <-dropped)
	}
	resume()
	if err := <-ingested; err != nil {
		t.Fatal(err)
	}
	h.settle()
	if l := stuckOf(t, h.e); len(l) != 0 {
		t.Fatalf("listed after the replace deleted it: %+v", l)
	}
	if p := h.e.Stats().Pending; p != 1 {
		t.Fatalf("%d pending, want the new a", p)
	}
	h.checkPending()
	h.advance(time.Second)
	if got := h.sink.acked(); !slices.Equal(got, []string{"a"}) {
		t.Fatalf("delivered %v, want the new a once", got)
	}
}

// Once a drop's commit is durable and drained by whoever holds the shard
// lock next, the entry is no longer stuck, before DropStuck itself takes
// the lock again: a second drop deciding in between would otherwise drop
// it twice (the pending count and the stored count key one too low for
// good). The drop's batch is played here by hand, under the lock, so the
// window is hit every time.
func TestDropStuckDrainedDropIsNotStuck(t *testing.T) {
	for _, parked := range []bool{false, true} {
		t.Run(fmt.Sprintf("parked=%v", parked), func(t *testing.T) {
			h := newHarness(t, func(o *Options) { o.Shards = 1; o.Retry = parkPolicy })
			fail := errors.New("kafka: publish to \"dlq\": TOPIC_AUTHORIZATION_FAILED")
			by, want := droppedHeldInFlight, StuckHeld
			if parked {
				fail = fmt.Errorf("kafka: publish to \"dlq\": %w: message too large", ErrRefused)
				by, want = droppedParkedInFlight, StuckParked
			}
			h.sink.setFail(func(*codec.Task) error { return fail })
			h.run()
			if _, err := h.e.IngestAwait(context.Background(), []codec.Task{deadLetter("bad", 1)}, []Checkpoint{{Key: "k", Offset: 1}}); err != nil {
				t.Fatal(err)
			}
			h.settle()
			h.advanceUntil("stuck", func() bool {
				l := stuckOf(t, h.e)
				return len(l) == 1 && l[0].State == want
			})
			h.stop()
			seq := stuckOf(t, h.e)[0].Seq
			s := h.e.shards[0]
			s.mu.Lock()
			// What DropStuck decides under the lock ...
			pb := &pendingBatch{tk: newTicket()}
			s.enqueueLocked(pb)
			s.supersedeLocked(seq, pb, by, "")
			// ... its commit becoming durable, and the next lock holder
			// draining it before DropStuck's own clean-up.
			pb.tk.release()
			pb.synced.Store(true)
			s.drainLocked()
			st, stuck := s.stuckLocked(seq)
			s.mu.Unlock()
			if stuck {
				t.Fatalf("seq %d is stuck (%+v) after its drop was drained: a second drop would drop it again", seq, st)
			}
			if err := h.e.DropStuck(0, seq); !errors.Is(err, ErrNotFound) {
				t.Fatalf("a second DropStuck = %v, want ErrNotFound", err)
			}
			if l := stuckOf(t, h.e); len(l) != 0 {
				t.Fatalf("listed after the drop: %+v", l)
			}
			if err := h.e.Err(); err != nil {
				t.Fatalf("Err after the drop: %v", err)
			}
		})
	}
}

// TestLookupWaitsForTheWriteItsEntryComesFrom: between a decision and its
// batch being applied (a new task here; a retry moving a task's key is the
// same case) the index entry is known and the task key not yet written.
// Lookup waits for that write instead of reporting the pending task as not
// found, which an operator could take for "gone" and publish it again.
func TestLookupWaitsForTheWriteItsEntryComesFrom(t *testing.T) {
	h := newHarness(t, nil)
	ingested, resume := ingestHeld(t, h, sched("a", t0.Add(time.Hour), 1))
	h.e.testHookLookupWaits = resume // the apply goes on once Lookup waits for it
	info, err := h.e.Lookup("src", "a")
	if err != nil {
		t.Fatalf("Lookup of a task whose write is under way: %v, want it found", err)
	}
	if !info.Due.Equal(t0.Add(time.Hour)) {
		t.Fatalf("Lookup = %+v", info)
	}
	if err := <-ingested; err != nil {
		t.Fatal(err)
	}
}

// ingestHeld starts an Ingest of task and returns once it has decided,
// before its batch is applied; the apply goes on at resume (also called at
// the test's end). ingested gets Ingest's result.
func ingestHeld(t *testing.T, h *harness, task codec.Task) (ingested chan error, resume func()) {
	t.Helper()
	decided, proceed := make(chan struct{}), make(chan struct{})
	var once sync.Once
	resume = func() { once.Do(func() { close(proceed) }) }
	t.Cleanup(resume)
	h.e.testHookIngestDecided = func() { close(decided); <-proceed }
	ingested = make(chan error, 1)
	go func() { ingested <- h.e.Ingest(context.Background(), []codec.Task{task}, nil) }()
	<-decided
	h.e.testHookIngestDecided = nil
	return ingested, resume
}
