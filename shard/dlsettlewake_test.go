package shard

import (
	"errors"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
)

// TestDLQSettleWakeSubMillisecond (review R211): a DLQ's settle end was
// kept as whole milliseconds rounded down (settleAt), while settle
// compares the exact time: a DLQ that became healthy at a time with a
// sub-millisecond part (the real clock's always) has its fire loops
// woken in the millisecond before its settle ends, find it not yet due,
// and park for the same millisecond, which has come: they spin until the
// clock passes the exact end (for ever on this fake clock, which does
// not move by itself). The loops must park until the end.
func TestDLQSettleWakeSubMillisecond(t *testing.T) {
	h, logs := dlqLogHarness(t, 2)
	// Every time from here on has 300 µs past its millisecond.
	h.clk.Advance(300 * time.Microsecond)
	var down atomic.Bool
	down.Store(true)
	h.sink.setFail(func(t *codec.Task) error {
		if down.Load() {
			return errors.New("kafka: publish to \"dlq\": TOPIC_AUTHORIZATION_FAILED")
		}
		return nil
	})
	h.run()
	h.ingest([]codec.Task{deadLetter("a", 1)})
	h.advanceUntil("the DLQ failing", func() bool { return dlqsFailing(h.e, "kafka:dlq") > 0 })
	down.Store(false)
	h.advanceUntil("delivered", func() bool { return slices.Contains(h.sink.acked(), "a") })
	h.e.dlqLines.mu.Lock()
	c := h.e.dlqLines.conds["kafka:dlq"]
	var healthy time.Time
	if c != nil {
		healthy = c.healthy
	}
	h.e.dlqLines.mu.Unlock()
	if healthy.IsZero() {
		t.Fatal("the DLQ's recovery is not settling once it took its dead letter")
	}
	if healthy.Nanosecond()%int(time.Millisecond) == 0 {
		t.Fatalf("healthy at %v, want a time with a sub-millisecond part", healthy)
	}
	// In the last millisecond of the settle time, before its exact end:
	// the loops wake (their timers fire) and must park again.
	end := healthy.Add(dlqSettle)
	h.set(end.Add(-100 * time.Microsecond))
	if n := logs.FilterMessage(msgDLQRecovered).Len(); n != 0 {
		t.Fatalf("recovered logged %d times before the settle time ended", n)
	}
	h.set(end.Add(time.Millisecond))
	if n := logs.FilterMessage(msgDLQRecovered).FilterField(zap.String("dlq", "kafka:dlq")).Len(); n != 1 {
		t.Fatalf("%d recovered lines once the settle time ended, want 1", n)
	}
}
