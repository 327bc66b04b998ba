package shard

import (
	"fmt"
	"testing"
	"time"
)

// TestHeldReopenOtherOutageMemory: held tasks survive a reopen with a
// bigger, smaller or negative OutageMemory (those waiting in memory past
// a smaller one held at Open), the target still down for a while, and
// are all delivered once, the counts matching the store.
func TestHeldReopenOtherOutageMemory(t *testing.T) {
	for _, next := range []int{1000, 3, -1, 0} {
		t.Run(fmt.Sprint(next), func(t *testing.T) {
			h := holdHarness(t, 10)
			const n = 100
			holdAll(t, h, n)
			h.advance(3 * time.Second)
			h.stop()
			h.close()
			h.opts.OutageMemory = next
			h.open()
			// The 10 that waited in memory stay there up to the new
			// bound; those past it are held at Open.
			inMemory := 10
			switch {
			case next < 0:
				inMemory = 0
			case next > 0:
				inMemory = min(inMemory, next)
			}
			held, all := heldKeys(t, h.e)
			if st := h.e.Stats(); st.Held != held || st.Pending != all || all != n || held != int64(n-inMemory) {
				t.Fatalf("after reopen: %+v; store %d held, %d all", st, held, all)
			}
			h.run() // still down
			for range 10 {
				h.advance(time.Second)
			}
			held, all = heldKeys(t, h.e)
			if st := h.e.Stats(); st.Held != held || st.Pending != all || all != n {
				t.Fatalf("down after reopen: Stats held %d pending %d; store %d held, %d all", st.Held, st.Pending, held, all)
			}
			t.Logf("OutageMemory %d: held %d of %d while down", next, held, all)
			h.sink.reset()
			h.sink.setFail(nil)
			for range 20 {
				h.advance(time.Second)
			}
			checkDeliveredOnce(t, h, n)
			if st := h.e.Stats(); st.Pending != 0 || st.Held != 0 {
				t.Fatalf("after delivery: %+v", st)
			}
			h.checkPending()
		})
	}
}
