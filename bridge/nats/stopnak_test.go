package nats

import (
	"fmt"
	"testing"
	"time"
)

// TestAbandonedNakedAtStop: what the source holds when it stops (here a
// batch its handler had not finished; what its pulls had fetched after it
// takes the same path) is naked on the way out, so the server redelivers
// it at once to the consumer's next client, not after AckWait (2 min).
// A restarted bridge also asks back what a crashed run held (nakUnseen,
// TestUnseenNakedAtStart); this is the graceful stop's own part, seen here
// by a plain client that asks back nothing. Before this test, no
// test failed with those naks removed (bridge/nats, bridge/service).
func TestAbandonedNakedAtStop(t *testing.T) {
	cfg, _, js, src := createdSource(t, func(c *Config) { c.AckWait = 2 * time.Minute })
	for i := range 3 {
		publish(t, js, "delay.x", fmt.Sprint(i), nil)
	}
	h := &blocker{recorder: newRecorder(), entered: make(chan struct{}), release: make(chan struct{})}
	stop := runSource(t, src, h)
	select {
	case <-h.entered:
	case <-time.After(20 * time.Second):
		t.Fatal("no batch handed to the handler within 20 s")
	}
	if err := stop(); err != nil {
		t.Logf("Run after cancel: %v", err)
	}
	if n := h.itemCount(); n != 0 {
		t.Fatalf("%d items handled; the handler was to hold its batch until the stop", n)
	}
	// All three were delivered to the source and never acknowledged: only
	// its naks make them deliverable before AckWait ends.
	fetchUnacked(t, js, cfg, 3)
}
