package shard

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// TestReleaseBeyondByteBudget: a release claims a group's waiting tasks
// by count; those past the round's byte budget (FireBatchBytes) go back
// to the wheel. They must stay released (taken next round), not wait
// out their own retry (up to Retry.Max) as if no release had happened.
func TestReleaseBeyondByteBudget(t *testing.T) {
	for _, tc := range []struct {
		name    string
		horizon time.Duration
	}{
		{"in the wheel", 0},
		{"past the horizon", time.Minute},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, func(o *Options) {
				o.Shards = 1
				o.Retry = defaultLikeRetry
				o.Horizon = tc.horizon
				o.FireBatchBytes = 8 << 10 // about 7 of the 1 KiB tasks a round
			})
			down := fmt.Errorf("broker down: %w", ErrUnavailable)
			h.sink.setFail(func(*codec.Task) error { return down })
			h.run()
			const n = 40
			var tasks []codec.Task
			for i := range n {
				task := sched(fmt.Sprintf("t%03d", i), t0, int64(i+1))
				task.Value = []byte(strings.Repeat("v", 1024))
				tasks = append(tasks, task)
			}
			h.ingest(tasks)
			for range 30 { // the outage, a minute at a time
				h.advance(time.Minute)
			}
			h.sink.setFail(nil)
			steps := 0
			for len(h.sink.acked()) == 0 {
				if steps++; steps > 301 {
					t.Fatal("nothing delivered 5 min after the broker came back")
				}
				h.advance(time.Second)
			}
			for range 10 {
				h.advance(time.Second)
			}
			if got := len(h.sink.acked()); got != n {
				t.Fatalf("%d of %d tasks delivered 10 s after the first one was, %ds after the broker came back; want all (released)", got, n, steps)
			}
			h.checkPending()
		})
	}
}
