package nats

import (
	"fmt"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestSharedConsumerWarned (review R171): two bridges on one consumer (two
// releases keeping the default nats.consumer), unsupported. Each sees gaps
// in the delivery sequences: the other's deliveries. Those must not be
// nak'd as lost (the server would hand them out again, and both stores
// would take them in: 8-11 of 60 in the review's runs), and the operator
// is told. (A source that starts while the other holds deliveries still
// asks those back when no pull of the other's is waiting at the server:
// README, NATS source.)
func TestSharedConsumerWarned(t *testing.T) {
	core, logs := observer.New(zap.WarnLevel)
	cfg, _, js, srcA := createdSource(t, func(c *Config) {
		c.AckWait = 2 * time.Minute
		c.BatchSize = 1
		c.Logger = zap.New(zapcore.NewTee(c.Logger.Core(), core))
	})
	srcB, err := NewSource(connect(t, cfg), cfg)
	if err != nil {
		t.Fatal(err)
	}
	a := &holdEach{recorder: newRecorder(), hold: 50 * time.Millisecond}
	b := &holdEach{recorder: newRecorder(), hold: 50 * time.Millisecond}
	runSource(t, srcA, a)
	runSource(t, srcB, b)
	// Both consuming before anything is published: a source that starts
	// while the other holds deliveries asks those back (see nakUnseen),
	// which this test is not about.
	eventually(t, "both sources consuming", func() bool { return isClosed(srcA.CaughtUp()) && isClosed(srcB.CaughtUp()) })
	const n = 60
	for i := range n {
		publish(t, js, "delay.x", fmt.Sprint(i), nil)
		time.Sleep(5 * time.Millisecond) // pacing: both sources pulling
	}
	seen := func() (taken map[int64]int, both int) {
		taken = map[int64]int{}
		for _, q := range a.seqs() {
			taken[q] |= 1
		}
		for _, q := range b.seqs() {
			taken[q] |= 2
		}
		for _, v := range taken {
			if v == 3 {
				both++
			}
		}
		return taken, both
	}
	eventually(t, fmt.Sprintf("all %d taken in", n), func() bool { m, _ := seen(); return len(m) >= n })
	eventually(t, "all acked", func() bool {
		ci := consumerInfo(t, js, cfg.Stream, cfg.Consumer)
		return ci.NumAckPending == 0 && ci.NumPending == 0
	})
	_, both := seen()
	t.Logf("A took %d, B %d, both %d", a.itemCount(), b.itemCount(), both)
	if a.itemCount() == 0 || b.itemCount() == 0 {
		t.Skip("one source took every message: no sharing to observe this run")
	}
	if both > 0 {
		t.Errorf("%d messages taken in by both sources", both)
	}
	if logs.FilterMessageSnippet("went to another client").Len() == 0 {
		t.Error("no warning about another client taking the consumer's deliveries")
	}
}
