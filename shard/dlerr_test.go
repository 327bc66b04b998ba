package shard

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
)

// TestDeadLetterErrCostBounded: with 20 000 failing dead letters that no
// source waits for (publish-failed ones pile up by the hundred thousand
// while a target and its DLQ both refuse the bridge, and readiness is
// polled all along), Err reads each shard's sums: what a call allocates
// does not grow with them. Before, it walked every failing dead letter
// under its shard's lock and kept their sequences (35-39 ms and 8.4 MB a
// call with 200 000, hunt H195; about 330 KB a call here).
func TestDeadLetterErrCostBounded(t *testing.T) {
	const n = 20_000
	h := newHarness(t, func(o *Options) {
		o.Retry = RetryPolicy{Initial: time.Hour, Max: time.Hour, Multiplier: 2, Jitter: -1, MaxAttempts: 3}
	})
	h.sink.setFail(func(*codec.Task) error { return errors.New("kafka: publish to \"dlq\": TOPIC_AUTHORIZATION_FAILED") })
	h.run()
	for i := 0; i < n; i += 1000 {
		var dls []codec.Task
		for j := i; j < i+1000; j++ {
			dls = append(dls, deadLetter(fmt.Sprintf("dl%d", j), int64(j+1)))
		}
		h.ingest(dls)
	}
	want := fmt.Sprintf("dead-letter delivery failing (%d dead letters, 0 of them held", n)
	h.advanceUntil("every dead letter failing", func() bool {
		err := h.e.Err()
		return err != nil && strings.Contains(err.Error(), want)
	})
	if err := h.e.Err(); !strings.Contains(err.Error(), "TOPIC_AUTHORIZATION_FAILED") {
		t.Fatalf("Err = %v, want the DLQ's failure named", err)
	}

	const calls = 5
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for range calls {
		if h.e.Err() == nil {
			t.Fatal("Err = nil with failing dead letters")
		}
	}
	runtime.ReadMemStats(&after)
	if per := (after.TotalAlloc - before.TotalAlloc) / calls; per > 32<<10 {
		t.Fatalf("Err with %d failing dead letters allocated %d bytes a call; want it bounded by the DLQs, not the dead letters (under 32 KiB)", n, per)
	}
}

// TestDeadLetterSums: a shard's sums (dlHeld, dlParked, dlByDest,
// dlParkedLast) match its failing dead letters through random failures,
// refusals that park, DLQs learnt after a restart ("" until the next
// failure) and acknowledgements. Each DLQ's last failure is at least as
// recent as that of every dead letter of it still failing.
func TestDeadLetterSums(t *testing.T) {
	h := newHarness(t, nil)
	s := h.e.shards[0]
	rng := rand.New(rand.NewPCG(7, 9))
	dests := []string{"", "kafka:dlq", "nats:dlq.x", "kafka:other"}
	check := func(step int) {
		t.Helper()
		held, parked := 0, 0
		byDest := map[string]int{}
		maxAt := map[string]uint64{}
		var maxParked uint64
		for _, f := range s.dlFailing {
			if f.parked {
				parked++
				maxParked = max(maxParked, f.at)
				continue
			}
			held++
			byDest[f.dest]++
			maxAt[f.dest] = max(maxAt[f.dest], f.at)
		}
		if s.dlHeld != held || s.dlParked != parked {
			t.Fatalf("step %d: dlHeld %d, dlParked %d; the failing dead letters hold %d, %d", step, s.dlHeld, s.dlParked, held, parked)
		}
		if len(s.dlByDest) != len(byDest) {
			t.Fatalf("step %d: %d DLQs summed, %d failing", step, len(s.dlByDest), len(byDest))
		}
		for dest, d := range s.dlByDest {
			if d.n != byDest[dest] || d.last.err == nil || d.last.at < maxAt[dest] {
				t.Fatalf("step %d: DLQ %q summed %d, last at %d (%v); failing %d, last at %d", step, dest, d.n, d.last.at, d.last.err, byDest[dest], maxAt[dest])
			}
		}
		if parked > 0 && (s.dlParkedLast.err == nil || s.dlParkedLast.at < maxParked) || parked == 0 && s.dlParkedLast.err != nil {
			t.Fatalf("step %d: last refusal %v at %d with %d parked (last at %d)", step, s.dlParkedLast.err, s.dlParkedLast.at, parked, maxParked)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for step := range 5000 {
		seq := uint64(1 + rng.IntN(64))
		switch r := rng.IntN(10); {
		case r < 5:
			s.dlFailedLocked(seq, int64(step), dests[1+rng.IntN(len(dests)-1)], fmt.Errorf("failure %d", step), false)
		case r < 7:
			s.dlFailedLocked(seq, int64(step), dests[1+rng.IntN(len(dests)-1)], fmt.Errorf("refusal %d", step), true)
		case r < 8:
			// As loadDLFailuresLocked: a failure read at open, its DLQ
			// unknown until it fails again.
			if _, ok := s.dlFailing[seq]; !ok {
				s.dlSetLocked(seq, dlFailure{err: fmt.Errorf("before %d", step), at: h.e.dlTick.Add(1), parked: rng.IntN(2) == 0, fire: int64(step)})
			}
		default:
			s.dlDoneLocked(seq)
		}
		check(step)
	}
	for seq := range s.dlFailing {
		s.dlDoneLocked(seq)
	}
	check(-1)
	if len(s.dlByDest) != 0 || s.dlHeld != 0 || s.dlParked != 0 {
		t.Fatalf("all acknowledged: %d DLQs summed, %d held, %d parked", len(s.dlByDest), s.dlHeld, s.dlParked)
	}
}

// BenchmarkErrManyFailingDeadLetters: Err (what /readyz reports) with
// 200 000 failing dead letters over 8 shards, none awaited by a source.
func BenchmarkErrManyFailingDeadLetters(b *testing.B) {
	const n = 200_000
	h := newHarness(b, func(o *Options) {
		o.Retry = RetryPolicy{Initial: time.Hour, Max: time.Hour, Multiplier: 2, Jitter: -1, MaxAttempts: 3}
		o.Shards = 8
		o.Logger = zap.NewNop()
	})
	h.sink.setFail(func(*codec.Task) error { return errors.New("kafka: publish to \"dlq\": TOPIC_AUTHORIZATION_FAILED") })
	h.run()
	for i := 0; i < n; i += 1000 {
		var dls []codec.Task
		for j := i; j < i+1000; j++ {
			dls = append(dls, deadLetter(fmt.Sprintf("dl%d", j), int64(j+1)))
		}
		h.ingest(dls)
	}
	want := fmt.Sprintf("(%d dead letters", n)
	h.advanceUntil("every dead letter failing", func() bool {
		err := h.e.Err()
		return err != nil && strings.Contains(err.Error(), want)
	})
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		if h.e.Err() == nil {
			b.Fatal("Err = nil")
		}
	}
}
