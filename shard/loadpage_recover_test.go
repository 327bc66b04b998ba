package shard

import (
	"fmt"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
)

// TestRecoverPagedHerd: a herd larger than one default page, overdue at
// a restart, with tasks ingested after Open and before Run into it and
// before it: each delivered once, the herd in ingest order.
func TestRecoverPagedHerd(t *testing.T) {
	// A long lane grace: this is about the loader's order (lanes taken
	// as stuck at once, make test-long's DELAYBRIDGE_LANE_GRACE=1ms, have
	// TestStuckLaneParkedGoFirst).
	h := newHarness(t, func(o *Options) { o.Shards = 1; o.Logger = zap.NewNop(); o.FireBatch = 4096; o.LaneGrace = time.Hour })
	herd := t0.Add(time.Hour)
	const n = defaultLoadPage + 3000
	var want []string
	for i := 0; i < n; i += 1000 {
		var batch []codec.Task
		for j := i; j < min(i+1000, n); j++ {
			tk := sched(fmt.Sprintf("h%05d", j), herd, int64(j+1))
			batch = append(batch, tk)
			want = append(want, tk.ID)
		}
		h.ingest(batch)
	}
	h.clk.Set(herd.Add(time.Minute))
	h.reopen()
	s := h.e.shards[0]
	s.mu.Lock()
	t.Logf("after recovery: wheel %d, horizon (%d,%d) herd %d", s.w.Len(), s.horizonEnd, s.horizonSeq, ms(herd))
	s.mu.Unlock()
	h.ingest([]codec.Task{sched("late", herd, n+10), sched("early", herd.Add(-time.Second), n+11)})
	want = append(want, "late")
	h.run()
	for range 50 {
		h.advance(time.Millisecond)
	}
	acked := h.sink.acked()
	if len(acked) != n+2 || acked[0] != "early" {
		t.Fatalf("%d delivered, want %d, first %q", len(acked), n+2, acked[0])
	}
	if fmt.Sprint(acked[1:]) != fmt.Sprint(want) {
		for i := range want {
			if acked[i+1] != want[i] {
				t.Fatalf("order differs at %d: %s want %s", i, acked[i+1], want[i])
			}
		}
	}
	h.checkPending()
}
