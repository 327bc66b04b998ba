package shard

import (
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// TestCollidingDownTargetManyHeld (hunt H177, NOT FIXED): a target that
// stays down with many more held tasks than a batch, older than those of
// a target that is back and shares its held group (12 bits of hash: with
// 50 000 targets every group holds about 12). Each probe of the group
// that holds only the down target's tasks ends in its backoff (at most
// heldProbeMax, 30 s), so the up target's held tasks wait one backoff per
// batch of the other's: 2m31s here (160 down tasks, batches of 8, backoff
// capped at 8 s) against 1 s without the collision; with the defaults
// (batches of 512, 30 s) 100 000 held tasks of the down target ahead
// would delay the other by about 100 minutes. Skipped unless
// DELAYBRIDGE_H177=1: it asserts the behaviour wanted and fails.
func TestCollidingDownTargetManyHeld(t *testing.T) {
	if os.Getenv("DELAYBRIDGE_H177") == "" {
		t.Skip("hunt H177 repro of an unfixed behaviour; DELAYBRIDGE_H177=1 runs it")
	}
	for _, collide := range []bool{false, true} {
		t.Run(fmt.Sprint("collide=", collide), func(t *testing.T) {
			h := holdHarness(t, -1)
			downT := "elsewhere"
			if collide {
				downT = collidingTarget(int(codec.TransportKafka), "out")
			}
			var batch []codec.Task
			for i := range 184 {
				tk := sched(fmt.Sprintf("t%03d", i), t0.Add(time.Second), int64(i+1))
				if i < 160 {
					tk.Target = downT
				}
				batch = append(batch, tk)
			}
			holdTasks(t, h, batch, 184)
			h.sink.setFail(func(tk *codec.Task) error {
				if tk.Target == downT {
					return errDown
				}
				return nil
			})
			start := h.clk.Now()
			for range 600 {
				h.advance(time.Second)
				n := 0
				for _, id := range h.sink.acked() {
					if id >= "t160" {
						n++
					}
				}
				if n == 24 {
					took := h.clk.Now().Sub(start)
					t.Logf("the 24 held tasks of the target back delivered %s after its return", took)
					if took > 3*h.e.opts.Retry.Max {
						t.Errorf("collide=%v: %s, want within a few probes (%s each)", collide, took, h.e.opts.Retry.Max)
					}
					return
				}
			}
			t.Fatalf("collide=%v: not all delivered in 10 min", collide)
		})
	}
}
