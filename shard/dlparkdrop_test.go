package shard

import (
	"fmt"
	"testing"

	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
)

// TestDLQFailureEndsWhenParkedDropped (review R211): a DLQ that refused
// a dead letter as the message it is logged "dead-letter delivery
// failing" at the refusals before the park, and its failure stayed open
// after the park, waiting for a delivery to it. An operator then dropping
// the parked dead letter (DELETE /v1/stuck) left the failure open for
// good, with no end line: only drops of failing dead letters not parked
// ended it (TestDLQFailureEndsWhenDropped). It ends as they do, with the
// line that says its dead letters were dropped (or parked).
func TestDLQFailureEndsWhenParkedDropped(t *testing.T) {
	h, logs := dlqLogHarness(t, 1)
	refusal := fmt.Errorf("kafka: publish to \"dlq\": %w: MESSAGE_TOO_LARGE", ErrRefused)
	h.sink.setFail(func(*codec.Task) error { return refusal })
	h.run()
	h.ingest([]codec.Task{deadLetter("big", 1)})
	h.advanceUntil("the park", func() bool { return parkedNow(h.e) == 1 })
	if n := logs.FilterMessage(msgDLQFailing).FilterField(zap.String("dlq", "kafka:dlq")).Len(); n != 1 {
		t.Fatalf("%d failing lines before the park, want 1", n)
	}
	s := h.e.shards[0]
	s.mu.Lock()
	var seqs []uint64
	for q := range s.dlFailing {
		seqs = append(seqs, q)
	}
	s.mu.Unlock()
	for _, q := range seqs {
		if err := h.e.DropStuck(0, q); err != nil {
			t.Fatal(err)
		}
	}
	h.settle()
	h.advance(dlqSettle)
	if n := logs.FilterMessage(msgDLQRecovered).Len(); n != 0 {
		t.Fatalf("recovered logged %d times for a DLQ that took nothing", n)
	}
	end := logs.FilterMessage(msgDLQDropped).FilterField(zap.String("dlq", "kafka:dlq")).All()
	if len(end) != 1 {
		t.Fatalf("%d lines ending the failure once its parked dead letter was dropped, want 1", len(end))
	}
	if m := end[0].ContextMap(); m["parked"] != int64(1) {
		t.Fatalf("end line %v, want parked=1", m)
	}
	if n := h.e.dlqLines.active.Load(); n != 0 {
		t.Fatalf("%d DLQ failures still under way", n)
	}
}
