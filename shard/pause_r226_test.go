package shard

import (
	"errors"
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
	t.Skip("R226: Open's failure path (engine.go) does not undo the operator pause's gauges; fix in engine.go, outside this review's files")
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
