package shard

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/metrics"
)

// TestR226FailedOpenLeavesNoPauseGauges (review R226): an Open that fails
// after it restored an operator's pause (loadOperatorPause runs early in
// recover) leaves no engine to take its gauges out again, as Open does
// for the failing and parked dead-letter gauges ("a failed Open leaves no
// engine to take them out"). The pause's gauges stayed set:
// delaybridge_firing_paused and _by_operator 1, _since_seconds the
// pause's start, on a metrics object shared with the next engine of the
// process (the store's test harnesses, a process that opens again).
func TestR226FailedOpenLeavesNoPauseGauges(t *testing.T) {
	m := metrics.New(prometheus.NewRegistry())
	// After the pause is restored (its log line), every read of an
	// sstable fails: the read of the sequence that follows fails Open.
	var armed atomic.Bool
	injected := errors.New("injected read error")
	fs := errorfs.Wrap(vfs.Default, errorfs.InjectorFunc(func(op errorfs.Op) error {
		if armed.Load() && op.Kind == errorfs.OpFileReadAt && strings.HasSuffix(op.Path, ".sst") {
			return injected
		}
		return nil
	}))
	logger := zaptest.NewLogger(t, zaptest.Level(zap.InfoLevel), zaptest.WrapOptions(zap.Hooks(func(e zapcore.Entry) error {
		if strings.HasPrefix(e.Message, "firing paused by the operator (kept in the store)") {
			armed.Store(true)
		}
		return nil
	})))
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.Metrics = m
		o.FS = fs
		o.Logger = logger
	})
	h.ingest([]codec.Task{sched("a", t0.Add(time.Hour), 1)})
	if _, err := h.e.PauseFiringByOperator("r226"); err != nil {
		t.Fatal(err)
	}
	h.close() // flushed: the sequence is read from an sstable
	h.opts.noBlockCache = true
	e, err := Open(h.opts)
	if err == nil {
		h.e = e
		t.Fatal("Open succeeded with every sstable read failing after the pause's restore")
	}
	if !armed.Load() || !strings.Contains(err.Error(), injected.Error()) {
		t.Fatalf("Open: %v (armed %v); want the injected read error after the pause's restore", err, armed.Load())
	}
	t.Logf("Open: %v", err)
	p, o, since := testutil.ToFloat64(m.FiringPaused), testutil.ToFloat64(m.FiringPausedByOperator), testutil.ToFloat64(m.FiringPausedByOperatorSince)
	if p != 0 || o != 0 || since != 0 {
		t.Errorf("after a failed Open: delaybridge_firing_paused %v, _by_operator %v, _since_seconds %v; want 0 (no engine holds the pause)", p, o, since)
	}
	// The store itself is fine: the next Open is paused, gauges set.
	armed.Store(false)
	h.opts.Logger = zaptest.NewLogger(t, zaptest.Level(zap.InfoLevel))
	h.open()
	if st := h.e.Firing(); st.Operator == nil || st.Operator.Reason != "r226" {
		t.Fatalf("Firing() after the second Open = %+v, want the pause", st)
	}
	if o := testutil.ToFloat64(m.FiringPausedByOperator); o != 1 {
		t.Fatalf("delaybridge_firing_paused_by_operator %v after the second Open, want 1", o)
	}
}

// pausedHeldParked (review R226) runs a held task into a lane's parked
// tasks and then into a pause: four tasks held for target "out" (h1..h4,
// in key order), and after a reopen (every group released at once) two
// overdue ones d1, d2 of the same lane; with batches of 2 the first round
// claims d1, d2 and h1 (held tasks get at least one slot), the lane takes
// d1 and d2 (held in the sink) and h1 waits in the lane's parked tasks.
// The operator pauses, the sink answers, and the loop's next round sends
// h1 back: a held task stays in the store, at its held key. It returns
// the order of the deliveries of h1..h4 after the resume.
func pausedHeldParked(t *testing.T) []string {
	h := holdHarness(t, -1, func(o *Options) { o.FireBatch = 2; o.LaneGrace = time.Hour })
	var held []codec.Task
	for i := range 4 {
		held = append(held, sched(fmt.Sprintf("h%d", i+1), t0.Add(time.Second), int64(i+1)))
	}
	holdTasks(t, h, held, 4)
	h.sink.setFail(nil)
	h.reopen()
	h.sink.reset()
	h.ingest([]codec.Task{sched("d1", t0, 11), sched("d2", t0, 12)})
	sink, release := newLaneSink(h)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.e.Run(ctx, sink) }()
	defer func() { release(); cancel(); <-done }()

	waitSignal(t, sink.entered, "d1 and d2 in the sink")
	eventuallyTrue(t, "h1 parked behind d1 and d2", func() bool { return h.e.parkedIn(codec.TransportKafka) == 1 })
	if _, err := h.e.PauseFiringByOperator("r226"); err != nil {
		t.Fatal(err)
	}
	release()
	eventuallyTrue(t, "d1, d2 delivered and nothing in flight", func() bool {
		return len(h.sink.acked()) == 2 && h.e.Firing().InFlight == 0
	})
	h.settle()
	if got := h.sink.acked(); !slices.Equal(got, []string{"d1", "d2"}) {
		t.Fatalf("delivered %v during the pause, want d1 and d2 (in the sink at the pause) only", got)
	}
	if st := h.e.Stats(); st.Held != 4 {
		t.Fatalf("held %d during the pause, want 4 (h1 back at its held key)", st.Held)
	}
	if _, _, err := h.e.ResumeFiringByOperator(); err != nil {
		t.Fatal(err)
	}
	eventuallyTrue(t, "every task delivered after the resume", func() bool { return h.e.Stats().Pending == 0 })
	checkDeliveredOnce(t, h, 6)
	return slices.DeleteFunc(h.sink.acked(), func(id string) bool { return id[0] == 'd' })
}

// TestR226PausedHeldParkedDeliveredOnce: a held task sent back from a
// lane's parked tasks by a pause is neither delivered during it nor lost:
// the release after the resume delivers it, once.
func TestR226PausedHeldParkedDeliveredOnce(t *testing.T) {
	if got := pausedHeldParked(t); len(got) != 4 {
		t.Fatalf("held tasks delivered after the resume: %v, want h1..h4", got)
	}
}

// TestR226PausedHeldParkedKeepsItsPlace (review R226, LOW): the held task
// a pause sent back (sendBackLocked: addLocked skips a held fire time; it
// stays in the store) waits for the release cursor, which had passed it,
// to come round the lane's whole held range again: after the resume h1
// goes after h2..h4 (with a held backlog of millions, after all of it),
// though the release goes in key order (each group's oldest first).
func TestR226PausedHeldParkedKeepsItsPlace(t *testing.T) {
	if got, want := pausedHeldParked(t), []string{"h1", "h2", "h3", "h4"}; !slices.Equal(got, want) {
		t.Fatalf("held tasks delivered after the resume in the order %v, want %v (h1 was claimed first, then sent back by the pause)", got, want)
	}
}
