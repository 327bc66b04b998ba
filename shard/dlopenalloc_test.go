package shard

import (
	"errors"
	"fmt"
	"math"
	"runtime"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
)

// TestOpenCopiesFailingDeadLettersOnce (review R211): Open reads each
// dead letter failing at the last restart to learn its DLQ
// (logRestoredDLQs). It copied the stored value (getCopy) and then
// decoded the copy, which copies it again: twice each dead letter's
// payload (100 000 failing dead letters of 1 KiB over 8 shards: open
// 250 -> 320 ms and 157 -> 260 MB allocated with the decode). It decodes
// Pebble's bytes: one copy, open back to 235-255 ms and 150 MB.
func TestOpenCopiesFailingDeadLettersOnce(t *testing.T) {
	const n, size = 64, 256 << 10
	h := newHarness(t, func(o *Options) {
		o.Retry = RetryPolicy{Initial: time.Hour, Max: time.Hour, Multiplier: 2, Jitter: -1, MaxAttempts: 3}
		o.Shards = 2
		o.Logger = zap.NewNop()
	})
	h.sink.setFail(func(*codec.Task) error { return errors.New("kafka: publish to \"dlq\": TOPIC_AUTHORIZATION_FAILED") })
	h.run()
	var dls []codec.Task
	for i := range n {
		d := deadLetter(fmt.Sprintf("dl%d", i), int64(i+1))
		d.Value = make([]byte, size)
		dls = append(dls, d)
	}
	h.ingest(dls)
	h.advanceUntil("every dead letter failing", func() bool { return dlqsFailing(h.e, "kafka:dlq") > 0 && failingCount(h.e) == n })
	h.close()
	h.open()
	if got := failingCount(h.e); got != n {
		t.Fatalf("%d failing dead letters at open, want %d", got, n)
	}
	// Open's reading of them, again (its sums counted twice, which this
	// test does not look at), alone: Open as a whole replays the WAL,
	// whose allocations depend on what Pebble flushed. The least of a few
	// reads: what else the process allocates meanwhile (goroutines of
	// tests before) only adds.
	alloc := uint64(math.MaxUint64)
	for range 3 {
		var sum uint64
		for _, s := range h.e.shards {
			runtime.GC()
			var before, after runtime.MemStats
			s.mu.Lock()
			runtime.ReadMemStats(&before)
			err := s.loadDLFailuresLocked()
			runtime.ReadMemStats(&after)
			s.mu.Unlock()
			if err != nil {
				t.Fatal(err)
			}
			sum += after.TotalAlloc - before.TotalAlloc
		}
		alloc = min(alloc, sum)
	}
	t.Logf("open with %d failing dead letters of %d KiB: %d KiB allocated", n, size>>10, alloc>>10)
	if raceOn {
		return // Pebble copies values under -race: 1.5 times them with one copy here
	}
	if limit := uint64(n*size) * 3 / 2; alloc > limit {
		t.Fatalf("open allocated %d KiB for %d failing dead letters of %d KiB, want at most %d KiB (one copy each)", alloc>>10, n, size>>10, limit>>10)
	}
}

// failingCount is how many dead letters the engine's shards hold failing,
// parked ones too.
func failingCount(e *Engine) int {
	c := 0
	for _, s := range e.shards {
		s.mu.Lock()
		c += len(s.dlFailing)
		s.mu.Unlock()
	}
	return c
}
