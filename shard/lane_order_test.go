package shard

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
)

// TestStuckLaneParkedGoFirst: a backlog fires through a lane taken as
// stuck at once (LaneGrace 1 ms), so each round's claim waits aside while
// the lane publishes. When the lane returned between a round's claim
// (which could not take the tasks set aside: the lane was busy) and its
// dispatch, the round's new tasks went out at once, ahead of the older
// ones still aside: whole batches out of due order, every run. Tasks set
// aside now go first, and the backlog goes out in due order.
func TestStuckLaneParkedGoFirst(t *testing.T) {
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.Logger = zap.NewNop()
		o.FireBatch = 256
		o.LaneGrace = time.Millisecond
	})
	base := t0.Add(time.Hour)
	const n = 8000
	var want []string
	for i := 0; i < n; i += 1000 {
		var batch []codec.Task
		for j := i; j < i+1000; j++ {
			tk := sched(fmt.Sprintf("d%05d", j), base.Add(time.Duration(j)*time.Millisecond), int64(j+1))
			batch = append(batch, tk)
			want = append(want, tk.ID)
		}
		h.ingest(batch)
	}
	h.clk.Set(base.Add(time.Minute)) // all overdue
	h.run()
	for range 20 {
		h.advance(time.Millisecond)
	}
	got := h.sink.acked()
	if len(got) != n {
		t.Fatalf("%d delivered, want %d", len(got), n)
	}
	if !slices.Equal(got, want) {
		for i := range want {
			if got[i] != want[i] {
				t.Fatalf("delivered out of due order at %d: %s, want %s", i, got[i], want[i])
			}
		}
	}
	h.checkPending()
}
