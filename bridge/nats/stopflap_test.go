package nats

import (
	"errors"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/internal/logthrottle"
)

// TestConsumingStopFlappingThrottled (review R210): a batch taken in
// ended a run of stops and restarted the stop throttle, so a consume
// that stops and goes on by turns (a flaky link missing heartbeats) logged
// "consuming stopped" and "consuming again" at every turn. Now a stop
// line is followed by one end line, the turns after it within the
// interval log nothing, and the next lines count them.
func TestConsumingStopFlappingThrottled(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	now := time.Unix(1_000_000, 0)
	s := &Source{log: zap.New(core), stopNow: func() time.Time { return now }}
	errHB := errors.New("nats source: no idle heartbeat within 10s")
	turn := func() {
		s.consumingStopped(errHB)
		now = now.Add(50 * time.Millisecond)
		s.consumingAgain("a batch was taken in after consuming stopped")
		now = now.Add(50 * time.Millisecond)
	}
	stops := func() []observer.LoggedEntry {
		return logs.FilterMessage("nats source: consuming stopped; restarting").All()
	}
	ends := func() []observer.LoggedEntry { return logs.FilterMessageSnippet("consuming again").All() }
	const turns = 100 // 10 s
	for range turns {
		turn()
	}
	if len(stops()) != 1 || len(ends()) != 1 {
		t.Fatalf("%d turns of a stop and a batch in 10 s: %d stop and %d end lines, want 1 and 1", turns, len(stops()), len(ends()))
	}
	now = now.Add(logthrottle.DefaultEvery)
	turn()
	if len(stops()) != 2 || len(ends()) != 2 {
		t.Fatalf("an interval later: %d stop and %d end lines, want 2 and 2", len(stops()), len(ends()))
	}
	if h := stops()[1].ContextMap()["held_back"]; h != int64(turns-1) {
		t.Fatalf("the second stop line: held_back %v, want %d", h, turns-1)
	}
	if h := ends()[1].ContextMap()["held_back"]; h != int64(turns-1) {
		t.Fatalf("the second end line: held_back %v, want %d", h, turns-1)
	}
	if last := logs.All()[logs.Len()-1].Message; last != ends()[1].Message {
		t.Fatalf("the last line %q, want the end line after the stop line", last)
	}
}
