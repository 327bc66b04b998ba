package shard

import (
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// TestM227PausedStepBackFiresEarly: a task set aside while firing was
// paused, the clock stepped back past its due time (an NTP step), then the
// pause ends: docs/design.md "Two clocks" says a clock stepped back never
// makes a task's first publish early, yet takePausedLocked claims what was
// set aside without looking at the clock.
func TestM227PausedStepBackFiresEarly(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.Shards = 1 })
	due := t0.Add(10 * time.Second)
	h.ingest([]codec.Task{sched("x", due, 1)})
	if _, err := h.e.PauseFiringByOperator("m227"); err != nil {
		t.Fatal(err)
	}
	h.run()
	h.advance(20 * time.Second) // due: set aside
	h.set(t0.Add(5 * time.Second))
	if _, _, err := h.e.ResumeFiringByOperator(); err != nil {
		t.Fatal(err)
	}
	h.settle()
	for _, d := range h.sink.all() {
		if d.At.Before(due) {
			t.Errorf("%s delivered at %v by the clock, before its due %v", d.ID, d.At.Sub(t0), due.Sub(t0))
		}
	}
}
