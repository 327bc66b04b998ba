package shard

import (
	"context"
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
	h := failingDeadLetters(t, n, 4, false)
	if err := h.e.Err(); !strings.Contains(err.Error(), "TOPIC_AUTHORIZATION_FAILED") {
		t.Fatalf("Err = %v, want the DLQ's failure named", err)
	}
	per := allocatedPerCall(5, func() {
		if h.e.Err() == nil {
			t.Fatal("Err = nil with failing dead letters")
		}
	})
	if per > 32<<10 {
		t.Fatalf("Err with %d failing dead letters allocated %d bytes a call; want it bounded by the DLQs, not the dead letters (under 32 KiB)", n, per)
	}
}

// failingDeadLetters opens an engine of shards shards whose DLQ refuses
// every dead letter as a whole (retried hourly), ingests n dead letters
// (awaited: through IngestAwait, so their source waits for them) and
// returns once Err counts them all failing.
func failingDeadLetters(tb testing.TB, n, shards int, awaited bool) *harness {
	tb.Helper()
	h := newHarness(tb, func(o *Options) {
		o.Retry = RetryPolicy{Initial: time.Hour, Max: time.Hour, Multiplier: 2, Jitter: -1, MaxAttempts: 3}
		o.Shards = shards
		o.Logger = zap.NewNop()
	})
	h.sink.setFail(func(*codec.Task) error { return errors.New("kafka: publish to \"dlq\": TOPIC_AUTHORIZATION_FAILED") })
	h.run()
	for i := 0; i < n; i += 1000 {
		var dls []codec.Task
		for j := i; j < min(n, i+1000); j++ {
			dls = append(dls, deadLetter(fmt.Sprintf("dl%d", j), int64(j+1)))
		}
		if !awaited {
			h.ingest(dls)
		} else if _, err := h.e.IngestAwait(context.Background(), dls, nil); err != nil {
			tb.Fatal(err)
		}
	}
	h.settle()
	held := 0
	if awaited {
		held = n
	}
	want := fmt.Sprintf("dead-letter delivery failing (%d dead letters, %d of them held", n, held)
	h.advanceUntil("every dead letter failing", func() bool {
		err := h.e.Err()
		return err != nil && strings.Contains(err.Error(), want)
	})
	return h
}

// allocatedPerCall is what f allocates a call, over calls calls.
func allocatedPerCall(calls int, f func()) uint64 {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for range calls {
		f()
	}
	runtime.ReadMemStats(&after)
	return (after.TotalAlloc - before.TotalAlloc) / uint64(calls)
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
			// As loadDLFailuresLocked for a dead letter that does not decode: its DLQ
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

// TestDeadLetterErrLastAcrossShards: Err names, of a DLQ whose dead
// letters fail in several shards, the latest failure of any shard, and of
// the parked ones the latest refusal of any shard, whichever shard it is
// in (the shards' sums are merged by failure order, not shard order).
func TestDeadLetterErrLastAcrossShards(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.Shards = 3 })
	fail := func(shard int, seq uint64, err string, refused bool) {
		s := h.e.shards[shard]
		s.mu.Lock()
		defer s.mu.Unlock()
		s.dlFailedLocked(seq, 1, "kafka:dlq", errors.New(err), refused)
	}
	// In failure order. The latest refusal is in the middle shard; the
	// latest held failure is in the last one, with the earliest refusal.
	fail(2, 3, "DLQ timeout", false)
	fail(0, 1, "DLQ not leader", false)
	fail(1, 2, "DLQ unknown topic", false)
	fail(2, 6, "too large", true)
	fail(0, 4, "invalid record", true)
	fail(1, 5, "corrupt message", true)
	fail(2, 3, "DLQ not authorized", false)
	err := h.e.Err()
	if err == nil {
		t.Fatal("Err = nil with failing dead letters")
	}
	msg := err.Error()
	for _, want := range []string{"(3 dead letters, 0 of them held", "DLQ not authorized", "3 dead letters parked", "last refusal: corrupt message"} {
		if !strings.Contains(msg, want) {
			t.Errorf("Err = %q, want %q in it", msg, want)
		}
	}
	for _, stale := range []string{"DLQ timeout", "DLQ not leader", "DLQ unknown topic", "too large", "invalid record"} {
		if strings.Contains(msg, stale) {
			t.Errorf("Err = %q, names %q, an earlier failure", msg, stale)
		}
	}
}

// TestDeadLetterErrAwaitedCostBounded: with 20 000 failing dead letters
// that sources wait for (bad input while its DLQ refuses the bridge), over
// 4 shards, Err does not copy or look up every awaited one per shard: what
// a call allocates does not grow with them, and each shard walks the
// smaller of its failing dead letters and the awaited ones. Copying their
// sequences for a lookup in every shard allocated 160 KB a call here (and
// took 2.6 ms a call over 8 shards, twice the walk it replaced).
func TestDeadLetterErrAwaitedCostBounded(t *testing.T) {
	const n = 20_000
	h := failingDeadLetters(t, n, 4, true)
	per := allocatedPerCall(5, func() {
		if h.e.Err() == nil {
			t.Fatal("Err = nil with failing dead letters")
		}
	})
	if per > 32<<10 {
		t.Fatalf("Err with %d failing dead letters sources wait for allocated %d bytes a call; want it bounded by the DLQs (under 32 KiB)", n, per)
	}
}

// TestAwaitedFailingCounts: over random failures, parks, acknowledgements,
// holds and Handle waits on 3 shards, the shards' awaitedFailingLocked add
// up to the failing, not parked, dead letters that a source holds or a
// Handle watches, whichever side each shard walks (its failing dead
// letters when they are fewer than the awaited ones, else the awaited).
func TestAwaitedFailingCounts(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.Shards = 3 })
	e := h.e
	rng := rand.New(rand.NewPCG(3, 5))
	walks := map[bool]int{} // by whether a shard walks its failing ones
	handle := &DeadLetters{e: e, done: make(chan struct{})}
	release := func(seq uint64) {
		e.dl.mu.Lock()
		defer e.dl.mu.Unlock()
		delete(e.dl.m, seq)
		if keys, ok := e.dl.held[seq]; ok {
			delete(e.dl.held, seq)
			for _, k := range keys {
				e.dl.byKey[k].n--
			}
		}
	}
	for step := range 4000 {
		// A sequence belongs to one shard, as Engine.seq numbers them.
		seq := uint64(1 + rng.IntN(90))
		s := e.shards[seq%3]
		awaited, r := seq, rng.IntN(12)
		if step/400%2 == 1 {
			// Fewer awaited than failing: the shards walk the awaited
			// ones, many of them both held and watched.
			if step%400 == 0 {
				for seq := range uint64(91) {
					release(seq)
				}
			}
			awaited = uint64(1 + rng.IntN(12))
			r = []int{0, 1, 2, 3, 0, 4, 6, 8, 10, 11, 10, 11}[r]
		}
		switch {
		case r < 4:
			s.mu.Lock()
			s.dlFailedLocked(seq, int64(step), "kafka:dlq", fmt.Errorf("failure %d", step), rng.IntN(4) == 0)
			s.mu.Unlock()
		case r < 6:
			s.mu.Lock()
			s.dlDoneLocked(seq)
			s.mu.Unlock()
		case r < 8:
			e.dl.mu.Lock()
			e.holdLocked(awaited, []string{"src/0"})
			e.dl.mu.Unlock()
		case r < 10:
			e.dl.mu.Lock()
			if e.dl.m == nil {
				e.dl.m = make(map[uint64]*DeadLetters)
			}
			e.dl.m[awaited] = handle
			e.dl.mu.Unlock()
		default:
			release(seq)
		}
		got, want := 0, 0
		for _, s := range e.shards {
			s.mu.Lock()
			e.dl.mu.Lock()
			for seq, f := range s.dlFailing {
				_, held := e.dl.held[seq]
				_, watched := e.dl.m[seq]
				if !f.parked && (held || watched) {
					want++
				}
			}
			if s.dlHeld > 0 {
				walks[len(s.dlFailing) <= len(e.dl.held)+len(e.dl.m)]++
			}
			e.dl.mu.Unlock()
			got += s.awaitedFailingLocked()
			s.mu.Unlock()
		}
		if got != want {
			t.Fatalf("step %d: %d awaited dead letters failing counted, want %d", step, got, want)
		}
	}
	if walks[true] == 0 || walks[false] == 0 {
		t.Fatalf("walks of the failing side %d, of the awaited side %d: want both", walks[true], walks[false])
	}
	t.Logf("walks of the failing side %d, of the awaited side %d", walks[true], walks[false])
}

// BenchmarkErrManyFailingDeadLetters: Err (what /readyz reports) with
// 200 000 failing dead letters over 8 shards, none awaited by a source.
func BenchmarkErrManyFailingDeadLetters(b *testing.B) {
	benchErr(b, failingDeadLetters(b, 200_000, 8, false))
}

// BenchmarkErrManyAwaitedDeadLetters: Err with 20 000 failing dead letters
// over 8 shards, each awaited by its source.
func BenchmarkErrManyAwaitedDeadLetters(b *testing.B) {
	benchErr(b, failingDeadLetters(b, 20_000, 8, true))
}

// benchErr times Err on h.
func benchErr(b *testing.B, h *harness) {
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		if h.e.Err() == nil {
			b.Fatal("Err = nil")
		}
	}
}
