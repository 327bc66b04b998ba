package shard

import (
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/delaybridge/delaybridge/codec"
)

// TestPauseFiring: while firing is paused, due tasks wait (the stored ones
// and the ones ingested meanwhile), a cancel or replace ingested meanwhile
// stops the version it supersedes, the dead letters a source waits for
// still go out, and Stats says what waits; on ResumeFiring the rest fires
// in due order (one shard: shards fire side by side).
func TestPauseFiring(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.Shards = 1 })
	h.ingest([]codec.Task{
		sched("stored-c", t0.Add(3*time.Second), 1),
		sched("stored-r", t0.Add(2*time.Second), 2),
		sched("stored-a", t0.Add(4*time.Second), 3),
	})
	h.e.PauseFiring()
	if !h.e.FiringPaused() || testutil.ToFloat64(h.e.m.FiringPaused) != 1 {
		t.Fatal("not paused (or delaybridge_firing_paused not 1) after PauseFiring")
	}
	h.run()
	h.advance(time.Minute) // all three overdue

	// The backlog read while paused: more overdue tasks, the cancel and
	// the replace (due in an hour) of two stored ones, a dead letter.
	h.ingest([]codec.Task{
		sched("late-b", t0.Add(time.Second), 10),
		sched("late-d", t0.Add(5*time.Second), 11),
		cancelTask("stored-c", 12),
		sched("stored-r", t0.Add(time.Hour), 13),
	})
	h.ingestAwaitedDL("bad")
	if got := h.sink.acked(); !slices.Equal(got, []string{"bad"}) {
		t.Fatalf("delivered while paused: %v; want only the awaited dead letter", got)
	}
	st := h.e.Stats()
	if want := t0.Add(time.Second); !st.OldestOverdue.Equal(want) || !st.NextDue.Equal(want) {
		t.Errorf("Stats while paused: oldest overdue %v, next due %v; want both %v", st.OldestOverdue.Time, st.NextDue.Time, want)
	}
	if st.Pending != 4 { // stored-a, stored-r's replacement, late-b, late-d
		t.Errorf("Stats while paused: %d pending, want 4", st.Pending)
	}

	h.e.ResumeFiring()
	if testutil.ToFloat64(h.e.m.FiringPaused) != 0 {
		t.Error("delaybridge_firing_paused not 0 after ResumeFiring")
	}
	h.settle()
	want := []string{"bad", "late-b", "stored-a", "late-d"}
	if got := h.sink.acked(); !slices.Equal(got, want) {
		t.Fatalf("delivered %v; want %v (the cancelled and the replaced version never, the rest in due order)", got, want)
	}
	h.advance(time.Hour)
	if got := h.sink.acked(); !slices.Equal(got, append(want, "stored-r")) {
		t.Fatalf("delivered %v; want the replacement last", got)
	}
	if v := h.sink.all()[len(want)].Value; v != "stored-r#13" {
		t.Errorf("replacement delivered as %q, want stored-r#13", v)
	}
	h.checkPending()
}

// TestPauseFiringRunEnds: tasks set aside while paused go back to the
// wheel when Run returns, and a next Run fires them once resumed; so does
// a reopen of the store.
func TestPauseFiringRunEnds(t *testing.T) {
	h := newHarness(t, nil)
	h.ingest([]codec.Task{sched("a", t0.Add(time.Second), 1), sched("b", t0.Add(2*time.Second), 2)})
	h.e.PauseFiring()
	h.run()
	h.advance(time.Minute)
	h.stop()
	if got := h.sink.acked(); len(got) != 0 {
		t.Fatalf("delivered while paused: %v", got)
	}
	h.run()
	h.e.ResumeFiring()
	h.settle()
	if got := h.sink.acked(); !slices.Equal(slices.Sorted(slices.Values(got)), []string{"a", "b"}) {
		t.Fatalf("delivered %v after a second Run, want a and b", got)
	}

	// A reopened engine is not paused.
	h.ingest([]codec.Task{sched("c", t0.Add(2*time.Minute), 3)})
	h.e.PauseFiring()
	h.stop()
	h.reopen()
	if h.e.FiringPaused() {
		t.Fatal("a reopened engine is paused")
	}
	h.run()
	h.advance(time.Hour)
	if got := h.sink.acked(); !slices.Equal(slices.Sorted(slices.Values(got)), []string{"a", "b", "c"}) {
		t.Fatalf("delivered %v after the reopen, want a, b and c", got)
	}
}
