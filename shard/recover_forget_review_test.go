package shard

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/codec"
)

// Review R193 of 9d60caa (a down group with nothing left waiting is
// forgotten after two probes that find none): the groups that still have
// a task waiting, wherever it waits, must stay down, so that the first
// delivery of one releases the rest.

// idInShard returns an id of source "src" that lands in shard want of n,
// with prefix.
func idInShard(prefix string, want, n int) string {
	for i := 0; ; i++ {
		id := fmt.Sprintf("%s%d", prefix, i)
		if shardOfN("src", id, n) == want {
			return id
		}
	}
}

// stayDown advances d a second at a time and fails as soon as the engine
// does not have exactly want groups down.
func stayDown(t *testing.T, h *harness, d time.Duration, want int) {
	t.Helper()
	for range int(d / time.Second) {
		h.advance(time.Second)
		if gs := downGroups(h.e); len(gs) != want {
			t.Fatalf("at %v: %d groups down, want %d (a task still waits)", h.clk.Now().Sub(t0), len(gs), want)
		}
	}
}

// TestForgetReviewWaitingKept: a group whose only task left waits where
// a probe must see it is not forgotten through 10 min of probe rounds,
// and the target's return is found within probeEvery. Where the probe
// can pull the task forward (past the horizon, last shard, restored), its
// failure puts the group down again at each probe anyway; the clock step
// back is the case where only seen[] keeps the group (a mutation counting
// only due tasks as seen fails it).
func TestForgetReviewWaitingKept(t *testing.T) {
	t.Run("retry past the horizon", func(t *testing.T) {
		// Retry.Max 5 min, horizon 2 min: the waiting task's retry is
		// only in the store (late entry with h == 0).
		h := newHarness(t, func(o *Options) { o.Retry = defaultLikeRetry; o.Horizon = 2 * time.Minute })
		h.sink.setFail(func(*codec.Task) error { return errDown })
		h.run()
		h.ingest(dueAtT0(1))
		pastHorizon := false
		for range 30 * 60 {
			h.advance(time.Second)
			for _, s := range h.e.shards {
				s.mu.Lock()
				for _, lt := range s.late {
					if lt.h == 0 && lt.fire > h.e.nowMs()+h.e.horizonMs() {
						pastHorizon = true
					}
				}
				s.mu.Unlock()
			}
		}
		if !pastHorizon {
			t.Fatal("the waiting task's retry never went past the horizon")
		}
		stayDown(t, h, 10*time.Minute, 1)
		backWithinProbe(t, h, 1)
	})
	t.Run("only task in the last shard", func(t *testing.T) {
		var tasks []codec.Task
		for sh := range 8 {
			tasks = append(tasks, sched(idInShard("k", sh, 8), t0, int64(sh+1)))
		}
		h, _ := outageOf(t, tasks, func(o *Options) { o.Shards = 8 })
		var cancels []codec.Task
		for i := range 7 {
			cancels = append(cancels, cancelTask(tasks[i].ID, int64(100+i)))
		}
		h.ingest(cancels)
		if got := waitingRecords(t, h.e); got != 1 {
			t.Fatalf("%d waiting records after the cancels, want 1", got)
		}
		stayDown(t, h, 10*time.Minute, 1)
		backWithinProbe(t, h, 1)
	})
	t.Run("clock stepped back past its due time", func(t *testing.T) {
		// Not due by the clock, the task is not probed (review R189), so
		// no probe failure marks its group down again: only its being
		// seen keeps the group down until its own retry.
		h, probes := outageOfOne(t)
		p0 := probes.Load()
		h.set(h.clk.Now().Add(-time.Hour))
		stayDown(t, h, 10*time.Minute, 1)
		if n := probes.Load() - p0; n != 0 {
			t.Fatalf("%d probes of a task not due by the clock", n)
		}
		for h.clk.Now().Before(t0) {
			h.advance(time.Minute)
		}
		backWithinProbe(t, h, 1)
	})
	t.Run("restored at Open", func(t *testing.T) {
		h, _ := outageOfOne(t)
		h.reopen()
		h.run() // still down
		stayDown(t, h, 10*time.Minute, 1)
		backWithinProbe(t, h, 1)
	})
}

// TestForgetReviewHeldCollidingLastShard: the group's tasks left are held
// tasks of one target in the last shard only; the tasks of a target that
// shares its group (12-bit hash) were cancelled. Probes with no held
// failure between them (direct calls, as TestHeldGroupOutageNotForgotten)
// must see the held ones, and a held delivery must then release.
func TestForgetReviewHeldCollidingLastShard(t *testing.T) {
	h := newHarness(t, func(o *Options) {
		o.Shards = 4
		o.OutageMemory = -1
		o.FireBatch = 8
		o.Retry = defaultLikeRetry
		o.Retry.Jitter = -1
	})
	other := collidingTarget(int(codec.TransportKafka), "out")
	var batch []codec.Task
	for i := range 4 {
		tk := sched(idInShard(fmt.Sprintf("a%d-", i), 3, 4), t0.Add(time.Second), int64(i+1))
		batch = append(batch, tk)
	}
	for i := range 4 {
		tk := sched(idInShard(fmt.Sprintf("b%d-", i), 0, 4), t0.Add(time.Second), int64(10+i))
		tk.Target = other
		batch = append(batch, tk)
	}
	holdTasks(t, h, batch, 8)
	var cancels []codec.Task
	for i := 4; i < 8; i++ {
		cancels = append(cancels, cancelTask(batch[i].ID, int64(100+i)))
	}
	h.ingest(cancels)
	if st := h.e.Stats(); st.Held != 4 {
		t.Fatalf("held %d after the cancels, want 4", st.Held)
	}
	gs := downGroups(h.e)
	if len(gs) != 1 {
		t.Fatalf("%d groups down, want 1", len(gs))
	}
	for range 3 * unseenToForget {
		h.e.probe(gs, h.e.nowMs())
	}
	if got := downGroups(h.e); len(got) != 1 {
		t.Fatalf("%d groups down after direct probes, want 1 (held tasks in shard 3 wait)", len(got))
	}
	stayDown(t, h, 5*time.Minute, 1)
	backWithinProbe(t, h, 4) // heldProbeMax is 30 s too
}

// TestForgetReviewLogOnce: the Info line is written once per forget, not
// once per probe round, and again only after the group was down again.
func TestForgetReviewLogOnce(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	h := newHarness(t, func(o *Options) { o.Retry = defaultLikeRetry; o.Logger = zap.New(core) })
	h.sink.setFail(func(*codec.Task) error { return errDown })
	h.run()
	count := func() int {
		return logs.FilterMessageSnippet("no task waits for a target group").Len()
	}
	for round := 1; round <= 2; round++ {
		id := fmt.Sprintf("t%d", round)
		h.ingest([]codec.Task{sched(id, h.clk.Now(), int64(round))})
		for range 10 * 60 {
			h.advance(time.Second)
		}
		if gs := downGroups(h.e); len(gs) != 1 {
			t.Fatalf("round %d: %d groups down, want 1", round, len(gs))
		}
		h.ingest([]codec.Task{cancelTask(id, int64(100+round))})
		for range 10 * 60 {
			h.advance(time.Second)
		}
		if n := count(); n != round {
			t.Fatalf("round %d: %d forget lines, want %d", round, n, round)
		}
	}
}

// TestForgetReviewRace: probes (direct calls, no shard lock held, as the
// fire loops make them) race the lanes' outcomes, cancels and new tasks of
// several down targets; run with -race. Afterwards every target with a
// task waiting is down.
//
// The prober makes probesPerStep probes (one a millisecond) after each
// step (an ingest, a move of the clock), while the loops work on it, then
// waits for the next step: a probe wakes the loop of the task it pulls
// forward, and settle needs a moment with every loop parked. Probing every
// millisecond for the whole test, it gave none on a starved machine
// (-cpu 1 beside CPU burners): settle timed out.
func TestForgetReviewRace(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.Retry = defaultLikeRetry; o.Retry.Max = 2 * time.Second })
	h.sink.setFail(func(*codec.Task) error { return errDown })
	h.run()
	const probesPerStep = 20
	e := h.e // the harness's cleanup sets h.e to nil
	var budget atomic.Int64
	stopped := make(chan struct{})
	var wg sync.WaitGroup
	// Stopped before the harness's cleanup closes the engine (cleanups
	// run last first), also when the test fails half way: the prober
	// used the closed engine, and read h.e as the cleanup set it to nil.
	stopProber := sync.OnceFunc(func() { close(stopped); wg.Wait() })
	t.Cleanup(stopProber)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stopped:
				return
			default:
			}
			if budget.Load() > 0 {
				budget.Add(-1)
				if gs := downGroups(e); len(gs) > 0 {
					e.probe(gs, e.nowMs())
				}
			}
			time.Sleep(time.Millisecond)
		}
	}()
	step := func(f func()) {
		budget.Store(probesPerStep)
		f()
	}
	targets := []string{"a", "b", "c", "d"}
	n := int64(0)
	for round := range 20 {
		var tasks []codec.Task
		for i, tg := range targets {
			n++
			tk := sched(fmt.Sprintf("r%d-%d", round, i), h.clk.Now(), n)
			tk.Target = tg
			tasks = append(tasks, tk)
		}
		step(func() { h.ingest(tasks) })
		step(func() { h.advance(time.Second) })
		if round > 0 && round%3 == 0 {
			// Cancel the previous round's task of target "a".
			n++
			step(func() { h.ingest([]codec.Task{cancelTask(fmt.Sprintf("r%d-0", round-1), n)}) })
		}
	}
	stopProber()
	for range 10 {
		h.advance(time.Second)
	}
	if gs := downGroups(h.e); len(gs) != len(targets) {
		t.Fatalf("%d groups down with tasks of %d targets waiting", len(gs), len(targets))
	}
}

// TestForgetReviewRestoredBeyondMemory: a group with a task
// genuinely waiting that is neither in a late map nor held: after a
// restart with a smaller OutageMemory, Open drops the waiting records
// past it (their tasks go at their retry times). The only restored task
// is cancelled; the group is then forgotten (after 9d60caa), and the
// other task is found back only at its own retry, as it was before the
// change (it was never in a late map to be probed or released).
func TestForgetReviewRestoredBeyondMemory(t *testing.T) {
	h, _ := outageOf(t, dueAtT0(2), func(o *Options) { o.Shards = 1; o.OutageMemory = 2 })
	h.stop()
	h.opts.OutageMemory = 1
	h.reopen()
	h.run()
	var restored int64
	h.e.shards[0].mu.Lock()
	for _, lt := range h.e.shards[0].late {
		restored = lt.fire
	}
	n := len(h.e.shards[0].late)
	h.e.shards[0].mu.Unlock()
	if n != 1 {
		t.Fatalf("%d tasks restored in memory, want 1", n)
	}
	var ids []string
	for _, tk := range dueAtT0(2) {
		if info, err := h.e.Lookup("src", tk.ID); err == nil && info.NextFire.UnixMilli() == restored {
			ids = append(ids, tk.ID)
		}
	}
	if len(ids) != 1 {
		t.Fatalf("%d tasks at the restored one's retry time, want 1", len(ids))
	}
	id := ids[0]
	h.ingest([]codec.Task{cancelTask(id, 100)})
	for range 2 * 60 {
		h.advance(time.Second)
	}
	t.Logf("2 min after the cancel of the only restored task: %d groups down", len(downGroups(h.e)))
	h.sink.setFail(nil)
	steps := secondsUntilAcked(h, 1, 400)
	t.Logf("the task not restored delivered %ds after the return (Retry.Max %v)", steps, h.e.opts.Retry.Max)
	if limit := int(h.e.opts.Retry.Max/time.Second) + 1; steps > limit {
		t.Fatalf("the task not restored delivered %ds after the return; want at its own retry, within Retry.Max (%ds)", steps, limit)
	}
}
