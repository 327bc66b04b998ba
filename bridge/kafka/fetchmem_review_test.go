package kafka

import (
	"context"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"go.uber.org/zap/zapcore"

	"github.com/delaybridge/delaybridge/bridge"
)

// TestFetchMemoryDeadLettersWithHealthyDLQStayWithinBudget (review R220):
// every batch of a backlog over 64 partitions holds a dead letter (a
// producer that sets a malformed delay header on every record), and the
// DLQ takes them at once. Pipeline.Handle calls Batch.DeadLetterWait for
// each such batch before it waits for the acknowledgement; the source
// moved the partition's bytes out of the budget there, let other workers
// fill it, and counted them again once the batch was stored: the budget
// bounded nothing (peak held several budgets). A wait that ends at once
// must leave the bytes counted.
func TestFetchMemoryDeadLettersWithHealthyDLQStayWithinBudget(t *testing.T) {
	const (
		parts   = 64
		perPart = 100
		budget  = 256 << 10
		fetch   = 64 << 10
	)
	// Waits shorter than an hour are the DLQ at work, whatever the
	// machine's speed.
	old := deadLetterStallAfter
	t.Cleanup(func() { deadLetterStallAfter = old })
	deadLetterStallAfter = time.Hour
	c := newCluster(t, kfake.SeedTopics(parts, "delay"))
	produceBacklog(t, c, "delay", parts, perPart, 1000)
	h := newMemHandler()
	h.setFail(func(ctx context.Context, b *bridge.Batch) error {
		if b.DeadLetterWait != nil {
			b.DeadLetterWait() // as Pipeline.Handle: the batch has dead letters
		}
		time.Sleep(time.Millisecond) // the DLQ's acknowledgement
		return nil
	})
	s := budgetSource(t, c, zapcore.WarnLevel, fetch, budget, 32)
	stop := runSource(t, s, h)
	waitFor(t, "the backlog stored", func() bool { return h.count() >= parts*perPart })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	_, _, peak := s.mem.state()
	s.mem.mu.Lock()
	peakAll := s.mem.peakAll
	s.mem.mu.Unlock()
	const oneFetch = 128 << 10
	t.Logf("peak held %d KiB, held and stuck %d KiB (budget %d KiB), %v waits", peak>>10, peakAll>>10, budget>>10, waitsOf(s))
	if peakAll > budget+oneFetch {
		t.Errorf("the source held %d bytes at its peak (%d counted), over the budget %d plus one fetch (%d)", peakAll, peak, budget, oneFetch)
	}
	if !budgetIdle(s) {
		held, stuck, _ := s.mem.state()
		t.Errorf("after the source stopped: held %d stuck %d, want nothing", held, stuck)
	}
}
