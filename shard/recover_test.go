package shard

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// TestOutageEndReleasesWaitingTasks: after a 30 min outage every task
// due for the target waited a backoff grown to Retry.Max (5 min), and
// each shard's held tasks a held backoff as long. Once the broker was
// back the first retry to find it so was delivered and the others waited
// out what was left of their own waits: the last one 4-5 min later, the
// held ones shard by shard (hunt H173). Now the first delivery of a task
// that waited for the target releases the rest in every shard at once. A
// task cancelled and one replaced during the outage stay so.
func TestOutageEndReleasesWaitingTasks(t *testing.T) {
	for _, tc := range []struct {
		name    string
		memory  int           // Options.OutageMemory
		horizon time.Duration // Options.Horizon (0: the default, 10 min)
		// first: the first delivery after the return comes within this
		// (0: a waiting task's own retry, anywhere within Retry.Max).
		first time.Duration
	}{
		{"waiting in memory", 0, 0, 0},
		// Retries past the horizon are only in the store (the loader
		// puts them in the wheel later): released from there.
		{"waiting past the horizon", 0, time.Minute, 0},
		{"held on disk", 3, 0, 0},
		// Only the held probes find the target back: at most
		// heldProbeMax apart, not Retry.Max.
		{"none in memory", -1, 0, heldProbeMax},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, func(o *Options) {
				o.Retry = defaultLikeRetry
				o.OutageMemory = tc.memory
				o.Horizon = tc.horizon
			})
			var releases atomic.Int32
			h.e.testHookRelease = func([]int64) { releases.Add(1) }
			down := fmt.Errorf("broker down: %w", ErrUnavailable)
			h.sink.setFail(func(*codec.Task) error { return down })
			h.run()
			const n = 200
			h.ingest(dueAtT0(n))
			h.advance(time.Minute)
			replaced := sched("t001", t0.Add(time.Minute), n+1)
			replaced.Value = []byte("new")
			h.ingest([]codec.Task{cancelTask("t000", n+2), replaced})
			for range 29 { // the outage, a minute at a time
				h.advance(time.Minute)
			}
			if len(h.sink.acked()) != 0 {
				t.Fatal("delivered during the outage")
			}
			steps := h.backUntilFirstDelivery()
			if tc.first > 0 && time.Duration(steps)*time.Second > tc.first {
				t.Fatalf("first delivery %ds after the broker came back, want within %v", steps, tc.first)
			}
			acked := h.sink.acked()
			if len(acked) != n-1 {
				var downs []string
				for _, sh := range h.e.shards {
					sh.mu.Lock()
					for l := range sh.lanes {
						hs := &sh.lanes[l].hold
						if hs.n > 0 {
							downs = append(downs, fmt.Sprintf("shard %d lane %d: held %d next %d down %v", sh.id, l, hs.n, hs.next, hs.down))
						}
					}
					sh.mu.Unlock()
				}
				t.Fatalf("%d of %d tasks delivered by the time the first was, %ds after the broker came back; want all at once (%d releases); %s; %v",
					len(acked), n-1, steps, releases.Load(), h.e.loopStates(), downs)
			}
			if releases.Load() == 0 {
				t.Fatal("no release recorded")
			}
			for _, d := range h.sink.all() {
				switch {
				case d.Err != nil:
				case d.ID == "t000":
					t.Fatal("t000 was cancelled during the outage and delivered")
				case d.ID == "t001" && d.Value != "new":
					t.Fatalf("t001's old version %q delivered after its replace", d.Value)
				}
			}
			slices.Sort(acked)
			if len(slices.Compact(acked)) != n-1 {
				t.Fatal("a task delivered twice")
			}
			if st := h.e.Stats(); st.Pending != 0 || st.Held != 0 || !st.OldestOverdue.IsZero() {
				t.Fatalf("after the release: pending %d, held %d, oldest overdue %v; want nothing left", st.Pending, st.Held, st.OldestOverdue)
			}
			if err := h.e.Err(); err != nil {
				t.Fatalf("Err = %v once every task was delivered", err)
			}
			h.checkPending()
		})
	}
}

// partSink is a Kafka topic with one partition without a leader: a batch
// holding a task of it (id "bad") fails as a whole as unavailable, as
// kafka-go fails the whole produce; the others are delivered.
type partSink struct {
	mu    sync.Mutex
	tries map[string]int
	acked int
}

func (p *partSink) Deliver(_ context.Context, batch []*codec.Task) []error {
	p.mu.Lock()
	defer p.mu.Unlock()
	bad := slices.ContainsFunc(batch, func(t *codec.Task) bool { return t.ID == "bad" })
	errs := make([]error, len(batch))
	for i, t := range batch {
		p.tries[t.ID]++
		if bad {
			errs[i] = fmt.Errorf("LEADER_NOT_AVAILABLE: %w", ErrUnavailable)
		} else {
			p.acked++
		}
	}
	return errs
}

// TestReleaseOfPartlyDownTargetSpaced: a target partly down (a batch
// with a task of its down partition fails as a whole) delivers, in
// batches of their own, tasks of its healthy part that waited with the
// down one; each such batch ends the outage and releases the down
// partition's task. End to end, over 20 minutes, that task is tried
// about as often as its backoff alone would. (How releases are spaced
// when one fails right after another is TestOutcomeReleasePolicy's: with
// a fake clock that steps a second at a time, a release rarely meets
// due tasks in its batch, as it would in real time.)
func TestReleaseOfPartlyDownTargetSpaced(t *testing.T) {
	h := newHarness(t, func(o *Options) {
		o.Retry = defaultLikeRetry
		o.FireBatch = 2 // so that a release meets due tasks in its batch
	})
	var releases atomic.Int32
	h.e.testHookRelease = func([]int64) { releases.Add(1) }
	sink := &partSink{tries: make(map[string]int)}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.e.Run(ctx, sink) }()
	defer func() { cancel(); <-done }()
	h.settle()
	const minutes, perSecond = 20, 8
	tasks := []codec.Task{sched("bad", t0, 1)}
	for i := range minutes * 60 * perSecond {
		due := t0.Add(time.Duration(i) * time.Second / perSecond)
		tasks = append(tasks, sched(fmt.Sprintf("good%05d", i), due, int64(i+2)))
	}
	h.ingest(tasks)
	for range minutes * 60 {
		h.advance(time.Second)
	}
	sink.mu.Lock()
	bad, acked := sink.tries["bad"], sink.acked
	sink.mu.Unlock()
	// Its backoff alone: 0.5 s doubling to 5 min, about 14 tries in 20
	// min; the releases' spacing about as many again.
	if bad > 40 {
		t.Fatalf("the down partition's task tried %d times in %d min (%d releases): releases not spaced", bad, minutes, releases.Load())
	}
	if releases.Load() == 0 {
		t.Fatal("no release: the test did not exercise them")
	}
	if want := (minutes*60 - 10) * perSecond; acked < want {
		t.Fatalf("%d healthy tasks delivered, want at least %d", acked, want)
	}
	t.Logf("bad tried %d times, %d releases, %d delivered", bad, releases.Load(), acked)
}

// TestOutcomeReleasePolicy: when a batch's outcome releases a target
// group's waiting tasks (Engine.outcome), step by step.
func TestOutcomeReleasePolicy(t *testing.T) {
	a, b := heldGroup(1, "a"), heldGroup(2, "b")
	type step struct {
		at       int64 // ms after t0
		up, down []int64
		want     []int64 // released
	}
	g := func(gs ...int64) []int64 { return gs }
	began := map[string]int64{ // step name and index: when its publish began, if not at
		"a failure of a publish begun before the release: not down again/2": 900,
	}
	for _, tc := range []struct {
		name  string
		steps []step
	}{
		{"not down: nothing to release", []step{{0, g(a), nil, nil}}},
		{"an outage ends at the first delivery", []step{
			{0, nil, g(a), nil}, {60_000, g(a), nil, g(a)}, {60_001, g(a), nil, nil}}},
		{"up and down in one batch: partly down", []step{
			{0, nil, g(a), nil}, {1000, g(a), g(a), nil}, {2000, g(a), nil, g(a)}}},
		{"groups apart", []step{
			{0, nil, g(a, b), nil}, {1000, g(a), nil, g(a)}, {1001, g(b), g(a), g(b)}, {1002, g(a), nil, nil}}},
		{"down again soon after a release: the next waits, doubling to Max", []step{
			{0, nil, g(a), nil}, {1000, g(a), nil, g(a)},
			{1100, nil, g(a), nil}, {1499, g(a), nil, nil}, {1500, g(a), nil, g(a)}, // wait 500 ms
			{1600, nil, g(a), nil}, {2499, g(a), nil, nil}, {2500, g(a), nil, g(a)}, // 1 s
			{2600, nil, g(a), nil}, {4499, g(a), nil, nil}, {4500, g(a), nil, g(a)}, // 2 s
			{4600, nil, g(a), nil}, {8499, g(a), nil, nil}, {8500, g(a), nil, g(a)}, // 4 s: Max
			{8600, nil, g(a), nil}, {12499, g(a), nil, nil}, {12500, g(a), nil, g(a)}}}, // Max
		{"an outage long after the last release starts again", []step{
			{0, nil, g(a), nil}, {1000, g(a), nil, g(a)},
			{1100, nil, g(a), nil}, {1500, g(a), nil, g(a)}, // wait 500 ms
			{60_000, nil, g(a), nil}, {60_001, g(a), nil, g(a)}}},
		{"a failure of a publish begun before the release: not down again", []step{
			{0, nil, g(a), nil}, {1000, g(a), nil, g(a)},
			{1100, nil, g(a), nil},   // began at 900: kafka-go retried it through the return
			{2000, g(a), nil, nil}}}, // not down: nothing to release
		{"down twice before it is up: one wait", []step{
			{0, nil, g(a), nil}, {1000, g(a), nil, g(a)},
			{1100, nil, g(a), nil}, {1200, nil, g(a), nil}, {1500, g(a), nil, g(a)}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, func(o *Options) {
				o.Retry = RetryPolicy{Initial: 500 * time.Millisecond, Max: 4 * time.Second, Multiplier: 2, Jitter: -1, MaxAttempts: 3}
			})
			var got []int64
			h.e.testHookRelease = func(gs []int64) { got = append(got, gs...) }
			for i, st := range tc.steps {
				got = nil
				h.clk.Set(t0.Add(time.Duration(st.at) * time.Millisecond))
				begin, ok := began[fmt.Sprintf("%s/%d", tc.name, i)]
				if !ok {
					begin = st.at
				}
				h.e.outcome(st.up, st.down, nil, ms(t0)+begin)
				if !slices.Equal(got, st.want) {
					t.Fatalf("step %d (at %d ms, up %v, down %v): released %v, want %v", i, st.at, st.up, st.down, got, st.want)
				}
			}
		})
	}
}

// TestReleasedPastHorizonNotLoadedTwice: a waiting task whose retry is
// past the horizon is released from the store, not from the wheel. While
// it is in the sink the clock passes its retry time and the loader reads
// its key: it must not put it in the wheel as well (each stored task
// enters the wheel once; a second claim of a task in flight overwrote
// its in-flight state, and only the lane's one batch at a time kept it
// from being published twice).
func TestReleasedPastHorizonNotLoadedTwice(t *testing.T) {
	h, sink, lt, waiting, _ := waitingAfterOutage(t, "slow", time.Minute)
	s := h.e.shards[0]
	s.mu.Lock()
	below := s.belowHorizonLocked(lt.fire, 1)
	s.mu.Unlock()
	if !waiting || below || lt.group() == 0 {
		t.Fatalf("slow: waiting %v, retry below the horizon %v, group %d; want a retry past the horizon", waiting, below, lt.group())
	}
	h.sink.setFail(nil)
	h.sink.reset()
	slow := "slow"
	sink.gate.Store(&slow)
	h.e.outcome([]int64{lt.group()}, nil, nil, h.e.nowMs()) // another task of its target was delivered
	<-sink.entered
	h.clk.Advance(6 * time.Minute) // past its retry time: the loader reads its key
	eventuallyTrue(t, "the loader past slow's retry", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.belowHorizonLocked(lt.fire, 1) && s.parked
	})
	s.mu.Lock()
	inWheel, aside := s.w.Len(), len(s.lanes[transportSlot(codec.TransportKafka)].parked)
	s.mu.Unlock()
	close(sink.release)
	if inWheel != 0 || aside != 0 {
		t.Fatalf("while slow is in the sink: %d wheel entries, %d tasks set aside for its lane; want none (claimed twice)", inWheel, aside)
	}
	h.settle()
	if n := h.sink.deliveriesOf("slow"); n != 1 {
		t.Fatalf("slow delivered %d times after its release, want 1", n)
	}
	h.checkPending()
	if st := h.e.Stats(); st.Pending != 0 {
		t.Fatalf("pending %d, want 0", st.Pending)
	}
}

// TestFailureBegunBeforeReleaseRetriedSoon: a publish that began while
// the target was down and failed after its return was found (a produce
// kafka-go retried through the return) failed with what the target said
// before. Its tasks came back at the outage backoff, 5 min, after every
// other task of the target had gone (hunt H173's harness: one task 1m30s
// after the return, the others within a second). They are tried again
// within Retry.Initial, and the failure does not put the group down again.
func TestFailureBegunBeforeReleaseRetriedSoon(t *testing.T) {
	h, sink, lt, _, down := waitingAfterOutage(t, "stale", 0)
	s := h.e.shards[0]
	if lt.group() == 0 {
		t.Fatal("stale does not wait for an outage")
	}
	stale := "stale"
	sink.gate.Store(&stale)
	h.clk.Set(time.UnixMilli(lt.fire)) // its retry: the publish begins, the broker holds it
	<-sink.entered
	h.clk.Advance(time.Second)
	h.e.outcome([]int64{lt.group()}, nil, nil, h.e.nowMs()) // another task of its target was delivered
	// The release passes stale by (in flight) before its publish fails.
	eventuallyTrue(t, "the release queue looked at", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return len(s.released) == 0
	})
	var once atomic.Bool
	h.sink.setFail(func(*codec.Task) error { // the held produce fails with what the broker said before; then it is back
		if once.CompareAndSwap(false, true) {
			return down
		}
		return nil
	})
	h.sink.reset()
	close(sink.release)
	h.settle()
	h.e.outages.mu.Lock()
	st := h.e.outages.m[lt.group()]
	h.e.outages.mu.Unlock()
	if st.down {
		t.Fatal("the failure of a publish begun before the release put the group down again")
	}
	h.advance(500 * time.Millisecond)
	if got := h.sink.acked(); !slices.Equal(got, []string{"stale"}) {
		s.mu.Lock()
		lt, waiting := s.late[1]
		s.mu.Unlock()
		t.Fatalf("delivered %v 500 ms after its publish begun before the release failed, want [stale] (waiting %v, retry %v after)",
			got, waiting, time.Duration(lt.fire-h.e.nowMs())*time.Millisecond)
	}
}

// BenchmarkReleaseScan: what one release costs a shard holding the
// default bound of waiting tasks per shard (65536, of 8 shards): the scan
// of its late map under its lock (scan), then the sort of the matching
// tasks without it (sort), when all match (one target) or none (another
// target's release).
func BenchmarkReleaseScan(b *testing.B) {
	for _, bc := range []struct {
		name  string
		match bool
	}{{"all-match", true}, {"none-match", false}} {
		b.Run(bc.name, func(b *testing.B) {
			h := newHarness(b, func(o *Options) { o.Shards = 1 })
			s := h.e.shards[0]
			g, other := heldGroup(1, "orders"), heldGroup(1, "other")
			for i := range defaultOutageMemory {
				s.late = mapSet(s.late, uint64(i+1), lateTask{dg: packLate(ms(t0)+int64(i%1000), g), fire: ms(t0) + 300_000})
			}
			rel := []int64{other}
			if bc.match {
				rel = []int64{g}
			}
			var scan, sort time.Duration
			b.ResetTimer()
			for range b.N {
				start := time.Now()
				s.mu.Lock()
				got := s.releaseLocked(rel)
				s.mu.Unlock()
				scan += time.Since(start)
				start = time.Now()
				sortReleased(got)
				sort += time.Since(start)
			}
			b.ReportMetric(float64(scan.Microseconds())/float64(b.N), "scan-µs")
			b.ReportMetric(float64(sort.Microseconds())/float64(b.N), "sort-µs")
		})
	}
}

func mapSet(m map[uint64]lateTask, k uint64, v lateTask) map[uint64]lateTask {
	if m == nil {
		m = make(map[uint64]lateTask)
	}
	m[k] = v
	return m
}

// runGatedDown runs the engine with a gateSink over the harness's sink,
// which fails every delivery as unavailable (down) until told otherwise.
func (h *harness) runGatedDown() (sink *gateSink, down error) {
	h.t.Helper()
	down = fmt.Errorf("broker down: %w", ErrUnavailable)
	h.sink.setFail(func(*codec.Task) error { return down })
	sink = &gateSink{recSink: h.sink, entered: make(chan struct{}, 4), release: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.e.Run(ctx, sink) }()
	h.t.Cleanup(func() { cancel(); <-done })
	h.settle()
	return sink, down
}

// backUntilFirstDelivery brings the broker back (the sink fails nothing)
// and steps the clock a second at a time until a task is delivered; it
// returns how many seconds that took.
func (h *harness) backUntilFirstDelivery() int {
	h.t.Helper()
	h.sink.setFail(nil)
	steps := 0
	for len(h.sink.acked()) == 0 {
		if steps++; steps > 301 {
			h.t.Fatal("nothing delivered 5 min after the broker came back")
		}
		h.advance(time.Second)
	}
	return steps
}

// waitingAfterOutage runs one shard (lane grace 1 ms: the loop goes on
// while a batch is held in the gated sink; no jitter; horizon as given, 0
// the default) against a target down for 10 min, with task id due at its
// start; it returns the task's late entry (store seq 1) after the outage.
func waitingAfterOutage(t *testing.T, id string, horizon time.Duration) (h *harness, sink *gateSink, lt lateTask, waiting bool, down error) {
	t.Helper()
	h = newHarness(t, func(o *Options) {
		o.Shards = 1
		o.Horizon = horizon
		o.LaneGrace = time.Millisecond
		o.Retry = RetryPolicy{Initial: 500 * time.Millisecond, Max: 5 * time.Minute, Multiplier: 2, Jitter: -1, MaxAttempts: 3}
	})
	sink, down = h.runGatedDown()
	h.ingest([]codec.Task{sched(id, t0, 1)})
	for range 10 {
		h.advance(time.Minute)
	}
	s := h.e.shards[0]
	s.mu.Lock()
	lt, waiting = s.late[1]
	s.mu.Unlock()
	return h, sink, lt, waiting, down
}
