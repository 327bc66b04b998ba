package shard

import (
	"bufio"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/clock"
)

const holdCrashEnv = "DELAYBRIDGE_HOLDCRASH_CHILD"

// holdOutage is the OutageMemory of round r (child and parent's reopen).
func holdOutage(r int) int { return []int{-1, 1, 3, -1, 0}[r%5] }

func holdCrashOptions(dir string, clk clock.Clock, log *zap.Logger, outage int) Options {
	o := crashOptions(dir, clk, log)
	o.OutageMemory = outage
	o.Retry = RetryPolicy{Initial: 20 * time.Millisecond, Max: 150 * time.Millisecond, Multiplier: 2, MaxAttempts: 1000}
	o.LaneGrace = 5 * time.Millisecond
	return o
}

// heldKeys counts the t keys in the held range and all t keys.
func heldKeys(t testing.TB, e *Engine) (held, all int64) {
	it, err := e.db.NewIter(&pebble.IterOptions{LowerBound: []byte{prefixTask}, UpperBound: []byte{prefixTask + 1}})
	if err != nil {
		t.Fatal(err)
	}
	defer it.Close()
	for ok := it.First(); ok; ok = it.Next() {
		all++
		if _, fire, _, ok := parseTaskKey(it.Key()); ok && isHeld(fire) {
			held++
		}
	}
	return held, all
}

// TestHoldCrashSafety: TestCrashSafety with a sink whose targets go down
// (ErrUnavailable) and come back at random, and OutageMemory small, so
// tasks are moved to held and released all the time when the kill comes.
func TestHoldCrashSafety(t *testing.T) {
	if dir := os.Getenv(holdCrashEnv); dir != "" {
		holdCrashChild(dir)
		return
	}
	rounds := 4 // one of each OutageMemory but the default; DELAYBRIDGE_LONG: 25
	if longTests() {
		rounds = 25
	}
	if v := os.Getenv("HOLDCRASH_ROUNDS"); v != "" {
		rounds, _ = strconv.Atoi(v)
	}
	dir := t.TempDir()
	seed := uint64(time.Now().UnixNano())
	t.Logf("random seed %d (kill times are real time: a seed repeats the choices, not the run)", seed)
	rng := rand.New(rand.NewPCG(seed, 1))
	acked := map[string]bool{}
	maxHeld := int64(0)
	for round := 0; round < rounds; round++ {
		killAfter := 20 + rng.IntN(120)
		runChildUntilKill(t, "TestHoldCrashSafety", holdCrashEnv+"="+dir, round, killAfter, func(line string) bool {
			if !strings.HasPrefix(line, "ACK ") {
				return false
			}
			for _, id := range strings.Fields(line[4:]) {
				acked[id] = true
			}
			return true
		})
		// After each kill: the held count is the held range, the pending
		// count the t keys, and every acknowledged task is stored or was
		// delivered.
		clk := clock.NewFake(time.Now())
		e, err := Open(holdCrashOptions(dir, clk, zap.NewNop(), holdOutage(round+1)))
		if err != nil {
			t.Fatalf("round %d: Open: %v", round, err)
		}
		held, all := heldKeys(t, e)
		st := e.Stats()
		if st.Held != held || st.Pending != all {
			e.Close()
			t.Fatalf("round %d after kill: Stats held %d pending %d; store holds %d held keys, %d t keys", round, st.Held, st.Pending, held, all)
		}
		delivered := map[string]bool{}
		for _, id := range readDeliveries(t, dir) {
			delivered[id] = true
		}
		for id := range acked {
			if delivered[id] {
				continue
			}
			if _, err := e.Lookup("crash", id); err != nil {
				e.Close()
				t.Fatalf("round %d: acknowledged %s neither delivered nor stored: %v", round, id, err)
			}
		}
		maxHeld = max(maxHeld, held)
		t.Logf("round %d: killed after %d acks; pending %d, held %d (OutageMemory next %d)", round, killAfter, all, held, holdOutage(round+1))
		if err := e.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if maxHeld == 0 {
		t.Fatalf("no kill found a held task: the test did not exercise holding")
	}

	clk := clock.NewFake(time.Now().Add(time.Hour))
	h := &harness{t: t, clk: clk, opts: holdCrashOptions(dir, clk, zap.NewNop(), holdOutage(rounds)), sink: newRecSink(clk)}
	h.open()
	t.Cleanup(h.close)
	pendingAtRecovery := h.e.Stats().Pending
	h.checkPending()
	h.run()
	for i := 0; i < 50 && h.e.Stats().Pending > 0; i++ {
		h.advance(time.Second)
	}
	if st := h.e.Stats(); st.Pending != 0 || st.Held != 0 {
		t.Fatalf("after draining: pending %d, held %d", st.Pending, st.Held)
	}
	distinct, dups := tallyDeliveries(t, dir, h.sink.acked(), acked)
	t.Logf("%d rounds: %d acknowledged, %d pending at final recovery, %d distinct delivered, %d duplicates, max held at a kill %d",
		rounds, len(acked), pendingAtRecovery, distinct, dups, maxHeld)
	if limit := rounds * crashShards * 2 * crashBatch * (2 + fireCommitDepth); dups > limit {
		t.Fatalf("%d duplicates, more than the %d that can be in flight at %d kills", dups, limit, rounds)
	}
}

// flakySink: each target is down (ErrUnavailable) or up, switched at
// random every 50-400 ms; up, it records each delivery durably before
// acknowledging it.
type flakySink struct {
	f    fileSink
	mu   sync.Mutex
	down map[string]bool
}

func (s *flakySink) Deliver(ctx context.Context, batch []*codec.Task) []error {
	s.mu.Lock()
	errs := make([]error, len(batch))
	var ok []*codec.Task
	var okIdx []int
	for i, t := range batch {
		if s.down[t.Target] {
			errs[i] = fmt.Errorf("broker down: %w", ErrUnavailable)
			continue
		}
		ok = append(ok, t)
		okIdx = append(okIdx, i)
	}
	s.mu.Unlock()
	if len(ok) > 0 {
		if e := s.f.Deliver(ctx, ok); e != nil {
			for j, i := range okIdx {
				errs[i] = e[j]
			}
		}
	}
	return errs
}

var holdTargets = []struct {
	tr     codec.Transport
	target string
}{{codec.TransportKafka, "a"}, {codec.TransportKafka, "b"}, {codec.TransportNATS, "c"}}

func holdCrashChild(dir string) {
	fail := func(err error) {
		fmt.Fprintln(os.Stderr, "holdcrash child:", err)
		os.Exit(2)
	}
	round := os.Getenv("DELAYBRIDGE_CRASH_ROUND")
	r, _ := strconv.Atoi(round)
	e, err := Open(holdCrashOptions(dir, clock.Real{}, zap.NewNop(), holdOutage(r)))
	if err != nil {
		fail(err)
	}
	f, err := os.OpenFile(filepath.Join(dir, "delivered"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		fail(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 2))
	sink := &flakySink{f: fileSink{f}, down: map[string]bool{"a": true, "b": true, "c": true}}
	go func() {
		rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 3))
		for {
			time.Sleep(time.Duration(50+rng.IntN(350)) * time.Millisecond)
			sink.mu.Lock()
			for _, tg := range holdTargets {
				if rng.IntN(2) == 0 {
					sink.down[tg.target] = !sink.down[tg.target]
				}
			}
			sink.mu.Unlock()
		}
	}()
	go e.Run(ctx, sink)
	w := bufio.NewWriter(os.Stdout)
	for n := 0; ctx.Err() == nil; {
		now := time.Now().UnixMilli()
		batch := make([]codec.Task, 10)
		var line strings.Builder
		line.WriteString("ACK")
		for i := range batch {
			n++
			id := fmt.Sprintf("r%s-%d", round, n)
			tg := holdTargets[rng.IntN(len(holdTargets))]
			due := now - 50 + rng.Int64N(500)
			batch[i] = codec.Task{Kind: codec.KindSchedule, ID: id, Source: "crash", Stamp: now, Offset: int64(n),
				Due: due, Transport: tg.tr, Target: tg.target, Value: make([]byte, 100)}
			line.WriteString(" " + id)
		}
		if err := e.Ingest(ctx, batch, nil); err != nil {
			fail(err)
		}
		w.WriteString(line.String() + "\n")
		w.Flush()
		time.Sleep(time.Duration(5+rng.IntN(10)) * time.Millisecond)
	}
	os.Exit(3)
}
