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
// in the delivery sequences, the other's deliveries, long after its last
// reset: the operator is told. (Each also asks those back as lost, so some
// are taken in by both: README, "One bridge instance per consumer group".)
func TestSharedConsumerWarned(t *testing.T) {
	core, logs := observer.New(zap.WarnLevel)
	defer func(d time.Duration) { sharedGapAfter = d }(sharedGapAfter)
	sharedGapAfter = 0 // gaps right after the start count too
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
	if logs.FilterMessageSnippet("went to another client").Len() == 0 {
		t.Error("no warning about another client taking the consumer's deliveries")
	}
}
