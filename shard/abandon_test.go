package shard

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"

	"github.com/delaybridge/delaybridge/codec"
)

// putCorruptIndex stores an undecodable index entry for (source, id), as an
// unreadable block or a bad value would present it to a lookup, and makes
// sure the shard's filter does not hide it.
func putCorruptIndex(t *testing.T, e *Engine, source, id string) {
	t.Helper()
	ik := appendIndexKey(nil, source, id)
	if err := e.db.Set(ik, []byte("garbage"), pebble.Sync); err != nil {
		t.Fatal(err)
	}
	s := e.shards[e.shardOf(source, id)]
	s.mu.Lock()
	s.filterAddLocked(filterHash(ik))
	s.mu.Unlock()
}

// TestIngestErrorKeepsNoSupersededMark: an Ingest that fails a lookup
// after it decided to replace a task in flight takes that decision back;
// otherwise the task's acknowledgement deletes nothing and the delivered
// task stays pending (and is delivered again after a restart).
func TestIngestErrorKeepsNoSupersededMark(t *testing.T) {
	h := newHarness(t, nil)
	waitFilterBuilds(t, h.e, 1)
	putCorruptIndex(t, h.e, "src", "bad")
	h.ingest([]codec.Task{sched("x", t0, 1)})
	sink, cancel, done := runUntilInFlight(t, h, 4) // x#1 is in Deliver
	err := h.e.Ingest(context.Background(), []codec.Task{sched("x", t0.Add(time.Hour), 2), sched("bad", t0, 3)}, nil)
	if err == nil {
		t.Fatal("Ingest with an unreadable index entry succeeded")
	}
	close(sink.release) // the broker acknowledges x#1
	<-sink.ctxAlive
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if info, err := h.e.Lookup("src", "x"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("x was delivered and acknowledged, Lookup = %+v, %v; want ErrNotFound", info, err)
	}
	h.checkPending()
}

// TestIngestErrorRestoresEarlierDecision: an Ingest that fails after it
// replaced the overlay entry of an earlier batch still on its way to
// Pebble puts that entry back. Without it, a third message for the id,
// decided before the earlier batch is applied, finds no task and stores a
// second one: two pending tasks for one id.
func TestIngestErrorRestoresEarlierDecision(t *testing.T) {
	h := newHarness(t, nil)
	e := h.e
	waitFilterBuilds(t, e, 1)
	putCorruptIndex(t, e, "src", "bad")
	ctx := context.Background()

	// The hook runs after each successful Ingest's decisions: the first
	// one waits there (decided, not applied); the third one only says it
	// has decided. The failing one returns before it.
	var calls atomic.Int32
	decided, release, decided3 := make(chan struct{}), make(chan struct{}), make(chan struct{})
	e.testHookIngestDecided = func() {
		switch calls.Add(1) {
		case 1:
			close(decided)
			<-release
		case 2:
			close(decided3)
		}
	}
	first := make(chan error, 1)
	go func() { first <- e.Ingest(ctx, []codec.Task{sched("x", t0.Add(time.Hour), 1)}, nil) }()
	<-decided // x#1 decided, not applied

	if err := e.Ingest(ctx, []codec.Task{sched("x", t0.Add(2*time.Hour), 2), sched("bad", t0, 3)}, nil); err == nil {
		t.Fatal("Ingest with an unreadable index entry succeeded")
	}
	third := make(chan error, 1)
	go func() { third <- e.Ingest(ctx, []codec.Task{sched("x", t0.Add(3*time.Hour), 4)}, nil) }()
	<-decided3 // decided while x#1 is still unapplied
	close(release)
	for _, c := range []chan error{first, third} {
		if err := <-c; err != nil {
			t.Fatal(err)
		}
	}
	if got := e.Stats().Pending; got != 1 {
		t.Fatalf("pending = %d for the one id x, want 1", got)
	}
	info, err := e.Lookup("src", "x")
	if err != nil {
		t.Fatal(err)
	}
	if want := t0.Add(3 * time.Hour); info.Due.UnixMilli() != ms(want) {
		t.Fatalf("x due %v, want the third message's %v", info.Due, want)
	}
	h.checkPending()
}

// TestSweepLookupErrorKeepsMarker: a sweep that cannot read a marker's
// index entry keeps the marker's expiry key (so a later round removes the
// marker) and says so; the markers it can read are swept.
func TestSweepLookupErrorKeepsMarker(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.CancelRetention = time.Second; o.Shards = 1 })
	waitFilterBuilds(t, h.e, 1)
	h.ingest([]codec.Task{cancelTask("c", 1), cancelTask("ok", 2)})
	putCorruptIndex(t, h.e, "src", "c") // the marker's entry becomes unreadable
	s := h.e.shards[0]
	_, err := s.sweep(ms(t0.Add(2 * time.Second)))
	if err == nil {
		t.Fatal("sweep reported no error for a marker it could not read")
	}
	expiry := ms(t0.Add(time.Second))
	for _, c := range []struct {
		id   string
		want bool
	}{{"c", true}, {"ok", false}} {
		_, found, gerr := getCopy(h.e.db, appendExpiryKey(nil, s.id, expiry, "src", c.id))
		if gerr != nil {
			t.Fatal(gerr)
		}
		if found != c.want {
			t.Errorf("expiry key of %s present = %v after the sweep, want %v", c.id, found, c.want)
		}
	}
	if _, found, _ := getCopy(h.e.db, appendIndexKey(nil, "src", "ok")); found {
		t.Error("the readable marker's index entry survived the sweep")
	}
}

// TestEmptyBatchSyncsWhatItRead: a writer whose decisions read an
// undurable batch and which writes nothing (every message dropped, no
// checkpoint) still syncs, so the outcome it reports rests on durable
// decisions; a writer that read nothing undurable writes nothing.
func TestEmptyBatchSyncsWhatItRead(t *testing.T) {
	h := newHarness(t, nil)
	e := h.e
	for _, c := range []struct {
		name      string
		read      bool
		wantApply bool
	}{
		{"read an undurable batch", true, true},
		{"read only Pebble", false, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			earlier, tk := newTicket(), newTicket()
			earlier.release() // applied, its sync not known
			if c.read {
				tk.dependOn(earlier)
			}
			b := e.db.NewBatch()
			defer b.Close()
			applied, err := e.applyInOrder(tk, b, "test")
			if err != nil {
				t.Fatal(err)
			}
			if applied != c.wantApply {
				t.Fatalf("applied = %v, want %v", applied, c.wantApply)
			}
			if applied {
				if err := b.SyncWait(); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}

// TestMaxShardsBounds: the last shard's exclusive upper bound (the next
// shard number) must fit the key's u16, or its ranges would wrap to
// shard 0.
func TestMaxShardsBounds(t *testing.T) {
	if got, low := taskBound(maxShards, 0), taskBound(maxShards-1, 0); string(got) <= string(low) {
		t.Fatalf("taskBound(%d) = %x sorts at or before taskBound(%d) = %x", maxShards, got, maxShards-1, low)
	}
	if _, err := Open(Options{Dir: t.TempDir(), Shards: maxShards + 1}); err == nil {
		t.Fatalf("Open accepted %d shards", maxShards+1)
	}
}

// TestRunCloseRace: Run and Close called at once agree on who won: Close
// refuses (ErrRunning) while a Run it could not see yet runs, or Run
// refuses (ErrClosed) once Close began; never a Run on a closed store.
func TestRunCloseRace(t *testing.T) {
	for i := range 30 {
		e, err := Open(Options{Dir: t.TempDir(), Shards: 2})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		start := make(chan struct{})
		runErr, closeErr := make(chan error, 1), make(chan error, 1)
		go func() { <-start; runErr <- e.Run(ctx, newRecSink(nil)) }()
		go func() { <-start; closeErr <- e.Close() }()
		close(start)
		cerr := <-closeErr
		switch {
		case errors.Is(cerr, ErrRunning):
			cancel()
			if err := <-runErr; err != nil {
				t.Fatalf("round %d: Close refused for a running Run, then Run = %v", i, err)
			}
			if err := e.Close(); err != nil {
				t.Fatalf("round %d: Close after Run: %v", i, err)
			}
		case cerr == nil:
			cancel()
			if err := <-runErr; !errors.Is(err, ErrClosed) {
				t.Fatalf("round %d: Close closed the store, and Run = %v, want ErrClosed", i, err)
			}
		default:
			t.Fatalf("round %d: Close = %v", i, cerr)
		}
		cancel()
	}
}

// TestSweepKeepsUpWhenIdle: an idle shard sweeps expired cancel markers a
// full round after another, not one round (sweepBatch) per park of up to
// a second: a burst of cancels came due faster than it was swept.
func TestSweepKeepsUpWhenIdle(t *testing.T) {
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.CancelRetention = time.Hour
	})
	h.run()
	const n = 3 * sweepBatch
	for i := 0; i < n; i += 512 {
		var b []codec.Task
		for j := i; j < i+512; j++ {
			b = append(b, cancelTask(fmt.Sprint("gone-", j), int64(j+1)))
		}
		h.ingest(b)
	}
	if got := len(recordsOf(t, h.e, prefixExpiry)); got != n {
		t.Fatalf("%d cancel markers, want %d", got, n)
	}
	h.advance(time.Hour + time.Second)
	if got := len(recordsOf(t, h.e, prefixExpiry)); got != 0 {
		t.Fatalf("%d of %d expired cancel markers left once the loop settled", got, n)
	}
}
