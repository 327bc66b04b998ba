package shard

import (
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// TestHeldTasksAfterClockStepBack: tasks held on disk through an outage
// are released within Retry.Max of their target's return after the wall
// clock stepped back an hour, not an hour later: the lane's next look and
// the groups' backoff ends move back with the clock.
func TestHeldTasksAfterClockStepBack(t *testing.T) {
	h := holdHarness(t, -1) // every task held
	var batch []codec.Task
	for i := range 5 {
		batch = append(batch, sched(string(rune('a'+i)), t0.Add(time.Second), int64(i+1)))
	}
	holdTasks(t, h, batch, 5)
	// Probes keep failing: the group's backoff grows to Retry.Max.
	for range 20 {
		h.advance(time.Second)
	}
	probes := len(h.sink.all())
	h.advance(8 * time.Second)
	if len(h.sink.all()) == probes {
		t.Fatal("no probe of the held tasks in Retry.Max")
	}
	h.sink.setFail(nil)
	h.set(h.clk.Now().Add(-time.Hour))
	for range 10 { // Retry.Max (8 s) and a little
		h.advance(time.Second)
	}
	checkDeliveredOnce(t, h, 5)
	if st := h.e.Stats(); st.Held != 0 || st.Pending != 0 {
		t.Fatalf("held %d, pending %d after delivery", st.Held, st.Pending)
	}
}

// TestOutageGoesStaleAfterClockStepBack: an outage record whose tasks left
// the store some other way (here: cancelled) goes stale after twice
// Retry.Max, also when the clock stepped back meanwhile; without moving
// its time back, readiness said "target unavailable" for the whole step.
func TestOutageGoesStaleAfterClockStepBack(t *testing.T) {
	h := holdHarness(t, 100) // waits in memory, retried within Retry.Max
	h.sink.setFail(func(*codec.Task) error { return errDown })
	h.ingest([]codec.Task{sched("a", t0.Add(time.Second), 1)})
	h.run()
	h.advance(time.Second)
	if h.e.Err() == nil {
		t.Fatal("no outage reported while the target refuses as unavailable")
	}
	h.ingest([]codec.Task{cancelTask("a", 2)})
	h.set(h.clk.Now().Add(-time.Hour))
	for range 20 { // twice Retry.Max (16 s) and a little
		h.advance(time.Second)
	}
	if err := h.e.Err(); err != nil {
		t.Fatalf("outage still reported 20 s after its last task left, clock stepped back an hour: %v", err)
	}
}
