package wheel_test

import (
	"fmt"

	"github.com/delaybridge/delaybridge/wheel"
)

// A shard's fire loop: sleep until Next, then fire in bounded batches.
// Time is passed in, so the example (like the tests) never sleeps.
func Example() {
	now := int64(1_700_000_000_000) // Unix ms, from the owner's clock
	w := wheel.New(now)
	w.Add(now+1500, 1) // in 1.5 s
	w.Add(now+20, 2)
	w.Add(now+20, 3) // same due: fires after 2
	h := w.Add(now+60_000, 4)
	w.Remove(h) // cancelled

	for w.Len() > 0 {
		at, _ := w.Next() // the owner would sleep until at
		now = max(now, at)
		for more := true; more; {
			more = w.AdvanceN(now, 2, func(due int64, seq uint64) {
				fmt.Printf("fire seq %d (due +%d ms)\n", seq, due-1_700_000_000_000)
			})
		}
	}
	// Output:
	// fire seq 2 (due +20 ms)
	// fire seq 3 (due +20 ms)
	// fire seq 1 (due +1500 ms)
}
