package shard

import (
	"bytes"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/metrics"
)

// TestCancelOfSentBackTaskCounted: a cancel that meets a task while
// its fire round reads envelopes (the task is claimed: in flight) leaves
// the count to the delivery ("counted by the delivery, as cancelled only
// if the broker did not take the task"). When the round's byte budget
// sends that task back (settleClaimed's retry path), its in-flight entry
// is ended without looking at what superseded it, and its next claim
// finds the key gone as "not superseded": delaybridge_cancelled_total
// never counts the cancel. The comment on that path says it is a read
// error, "rare enough"; with fire_batch_bytes it is every round of large
// tasks.
func TestCancelOfSentBackTaskCounted(t *testing.T) {
	var arm, blocked atomic.Bool
	release := make(chan struct{})
	entered := make(chan struct{})
	fs := errorfs.Wrap(vfs.Default, errorfs.InjectorFunc(func(op errorfs.Op) error {
		if op.Kind == errorfs.OpFileReadAt && strings.HasSuffix(op.Path, ".blob") && arm.Load() && blocked.CompareAndSwap(false, true) {
			close(entered)
			<-release // the fire loop reading a's value
		}
		return nil
	}))
	m := metrics.New(prometheus.NewRegistry())
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.FS = fs
		o.Metrics = m
		o.FireBatchBytes = 1024 // a's 4 KiB spends it: b and c go back
	})
	a := sched("a", t0.Add(time.Hour), 1)
	a.Value = bytes.Repeat([]byte("A"), 4096) // separated into a blob file
	h.ingest([]codec.Task{a, sched("b", t0.Add(time.Hour), 2), sched("c", t0.Add(time.Hour), 3)})
	h.close() // flushes: a's envelope goes to a blob file
	h.open()
	h.run()
	arm.Store(true)
	h.clk.Advance(time.Hour)
	<-entered
	// The loop has claimed a, b and c and is reading a's envelope.
	s := h.e.shards[0]
	s.mu.Lock()
	_, cInFlight := s.inflight[3]
	s.mu.Unlock()
	if !cInFlight {
		t.Fatalf("c not claimed while a is read")
	}
	if err := h.e.Cancel("src", "c"); err != nil {
		t.Fatalf("Cancel: %v", err)
	}
	close(release)
	h.settle()
	h.advance(time.Millisecond)
	if got := h.sink.acked(); !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("delivered %v, want a and b", got)
	}
	if got := metricValue(t, m.Cancelled.WithLabelValues("src")); got != 1 {
		t.Errorf("delaybridge_cancelled_total = %v, want 1: the cancel of c (sent back by the byte budget) was never counted", got)
	}
	h.checkPending()
}
