package shard

import (
	"fmt"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// TestHeldReadFailureEnds: the fire loop ended a shard's "reading held
// tasks failed" (storeLines) only at a held claim that released tasks. A
// failed claim whose held tasks were then cancelled (nothing held any
// more: no claim reads again) never had its "store failure over" line,
// and the condition stayed active, every shard's round taking the
// storeLines lock, for the life of the engine. So for a claim that read
// without error but released nothing (every group in its backoff): the
// line waited for a backoff to end. A read without error, or nothing
// held, now ends it.
func TestHeldReadFailureEnds(t *testing.T) {
	const n = 20
	h, armed, logs := heldClaimFault(t, n)
	armed.Store(true)
	h.run()
	if armed.Load() {
		t.Fatal("no read of the held claim failed")
	}
	if got := logs.FilterMessage(msgHeldReadFailed).Len(); got != 1 {
		t.Fatalf("%d %q lines, want 1", got, msgHeldReadFailed)
	}
	// Before the claim's retry (heldRetry), every held task is cancelled.
	var cancels []codec.Task
	for i := range n {
		cancels = append(cancels, cancelTask(fmt.Sprintf("k%02d", i), int64(100+i)))
	}
	h.ingest(cancels)
	if st := h.e.Stats(); st.Held != 0 {
		t.Fatalf("held %d after cancelling every held task, want 0", st.Held)
	}
	for range 10 {
		h.advance(time.Second)
	}
	over := 0
	for _, l := range logs.FilterMessageSnippet("store failure over").All() {
		t.Logf("%s %v", l.Message, l.ContextMap())
		if l.ContextMap()["failure"] == msgHeldReadFailed {
			over++
		}
	}
	if over != 1 {
		t.Fatalf("%d end lines for %q, want 1 once nothing is held", over, msgHeldReadFailed)
	}
	if a := h.e.storeLines.active.Load(); a != 0 {
		t.Fatalf("%d store failure conditions still active, want 0", a)
	}
}
