package shard

import (
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/metrics"
)

// claimUnread plays the fire loop up to a claim whose envelopes are not
// read yet (run: claimLocked under the lock, then readClaimed unlocked).
func claimUnread(t *testing.T, h *harness) (*shard, []fireItem) {
	t.Helper()
	s := h.e.shards[0]
	s.mu.Lock()
	s.drainLocked()
	if err := s.housekeepLocked(ms(h.clk.Now())); err != nil {
		s.mu.Unlock()
		t.Fatal(err)
	}
	claimed := s.claimLocked(ms(h.clk.Now()))
	s.mu.Unlock()
	if len(claimed) != 1 {
		t.Fatalf("claimed %d, want 1", len(claimed))
	}
	return s, claimed
}

// readAndSettle is the rest of the fire loop for a claim whose task is
// gone: nothing to deliver.
func readAndSettle(t *testing.T, s *shard, claimed []fireItem) {
	t.Helper()
	items, dropped, retry, err := s.readClaimed(claimed, len(claimed))
	if err != nil {
		t.Fatal(err)
	}
	s.settleClaimed(dropped, retry)
	if len(items) != 0 {
		t.Fatalf("%d items to deliver, want none: the task is gone", len(items))
	}
}

// TestCancelBetweenClaimAndReadCounted: a cancel that meets a task the
// fire loop has claimed but not read yet is not counted at the cancel (the
// task is in flight: its delivery counts it), and the fire loop then finds
// the key gone: no delivery is left to count it, so the read counts it
// cancelled. By the admin API and by a delay-cancel alike (found by a
// metrics hunt: neither fired nor cancelled before).
func TestCancelBetweenClaimAndReadCounted(t *testing.T) {
	for _, tc := range []struct {
		name   string
		cancel func(h *harness) error
	}{
		{"admin", func(h *harness) error { return h.e.Cancel("src", "x") }},
		{"delay-cancel", func(h *harness) error { h.ingest([]codec.Task{cancelTask("x", 2)}); return nil }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := metrics.New(prometheus.NewRegistry())
			h := newHarness(t, func(o *Options) { o.Metrics = m; o.Shards = 1 })
			h.ingest([]codec.Task{sched("x", t0.Add(time.Second), 1)})
			h.clk.Advance(time.Second)
			s, claimed := claimUnread(t, h)
			if err := tc.cancel(h); err != nil {
				t.Fatal(err)
			}
			readAndSettle(t, s, claimed)
			if p := h.e.Stats().Pending; p != 0 {
				t.Fatalf("pending %d", p)
			}
			if c, f := testutil.ToFloat64(m.Cancelled.WithLabelValues("src")), testutil.ToFloat64(m.Fired.WithLabelValues("kafka", "task")); c != 1 || f != 0 {
				t.Fatalf("cancelled %v, fired %v; want 1, 0", c, f)
			}
			if len(s.cancelSrc) != 0 || len(s.inflight) != 0 {
				t.Fatalf("left behind: cancelSrc %v, inflight %v", s.cancelSrc, s.inflight)
			}
		})
	}
}

// TestDropBetweenClaimAndReadCounted: the same for an operator's drop of a
// failing dead letter (DELETE /v1/stuck/{shard}/{seq}): counted dropped.
func TestDropBetweenClaimAndReadCounted(t *testing.T) {
	m := metrics.New(prometheus.NewRegistry())
	h := newHarness(t, func(o *Options) {
		o.Metrics = m
		o.Shards = 1
		o.Retry = RetryPolicy{Initial: time.Second, Max: time.Second, Multiplier: 2, Jitter: -1, MaxAttempts: 3}
	})
	h.sink.setFail(func(*codec.Task) error { return errors.New("dlq down") })
	h.run()
	h.ingest([]codec.Task{{Kind: codec.KindDeadLetter, ID: "bad", Source: "src", Origin: "kafka:src/0@9",
		Transport: codec.TransportKafka, Target: "dlq", Code: codec.CodeBadDue}})
	if st, err := h.e.StuckEntries(10); err != nil || len(st.Entries) != 1 {
		t.Fatalf("stuck %+v %v", st, err)
	}
	h.stop() // the test plays the fire loop from here
	h.clk.Advance(2 * time.Second)
	s, claimed := claimUnread(t, h)
	if err := h.e.DropStuck(0, claimed[0].seq); err != nil {
		t.Fatal(err)
	}
	readAndSettle(t, s, claimed)
	if d, f := testutil.ToFloat64(m.StuckDropped.WithLabelValues("held")), testutil.ToFloat64(m.DeadLettered.WithLabelValues("bad-due")); d != 1 || f != 0 {
		t.Fatalf("stuck_dropped_total{held} %v, dead_lettered_total{bad-due} %v; want 1, 0", d, f)
	}
}
