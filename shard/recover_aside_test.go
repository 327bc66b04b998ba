package shard

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// TestReleasedSetAsideStayReleased (hunt H174): a release claimed while
// the shard's lane was still publishing a batch begun in the outage (a
// produce kafka-go retries; the loop does not wait for a lane in an
// outage) sets the released tasks aside. Taken back once the lane
// returned, those past the round's byte budget went back to the wheel at
// their retry time, no longer released: with 16 KB tasks under load,
// H174's harness saw some delivered 1m12s after the return, their
// backoff, not within seconds as the rest.
func TestReleasedSetAsideStayReleased(t *testing.T) {
	h := newHarness(t, func(o *Options) {
		o.Shards = 2
		o.Retry = RetryPolicy{Initial: 500 * time.Millisecond, Max: 5 * time.Minute, Multiplier: 2, Jitter: -1, MaxAttempts: 10}
		o.FireBatchBytes = 8 << 10 // about 7 of the 1 KiB tasks a round
	})
	var releases atomic.Int32
	h.e.testHookRelease = func([]int64) { releases.Add(1) }
	// a: the one in shard 0 whose delivery releases the group; g: the one
	// in shard 1 whose produce is in flight at the release; rest: shard
	// 1's other waiting tasks.
	var a, g string
	var rest []string
	for i := 0; a == "" || g == "" || len(rest) < 30; i++ {
		id := fmt.Sprintf("x%03d", i)
		switch sh := h.e.shardOf("src", id); {
		case sh == 0 && a == "":
			a = id
		case sh == 1 && g == "":
			g = id
		case sh == 1 && len(rest) < 30:
			rest = append(rest, id)
		}
	}
	task := func(id string, due time.Time, n int64) codec.Task {
		tk := sched(id, due, n)
		tk.Value = []byte(strings.Repeat("v", 1024))
		return tk
	}
	down := fmt.Errorf("broker down: %w", ErrUnavailable)
	h.sink.setFail(func(*codec.Task) error { return down })
	sink := &gateSink{recSink: h.sink, entered: make(chan struct{}, 4), release: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.e.Run(ctx, sink) }()
	gateOpen := false
	defer func() {
		if !gateOpen {
			close(sink.release)
		}
		cancel()
		<-done
	}()
	h.settle()
	// The rest come due first and wait longest, a later, g last: their
	// retries come in the order g, a, the rest.
	var tasks []codec.Task
	for i, id := range rest {
		tasks = append(tasks, task(id, t0.Add(time.Second), int64(i+1)))
	}
	h.ingest(tasks)
	h.advance(5 * time.Minute)
	h.ingest([]codec.Task{task(a, t0.Add(5*time.Minute+time.Second), 100)})
	h.advance(2 * time.Minute)
	h.ingest([]codec.Task{task(g, t0.Add(7*time.Minute+time.Second), 101)})
	for range 20 {
		h.advance(time.Second)
	}
	fires := func(sh int) map[uint64]int64 {
		s := h.e.shards[sh]
		s.mu.Lock()
		defer s.mu.Unlock()
		m := map[uint64]int64{}
		for seq, lt := range s.late {
			m[seq] = lt.fire
		}
		return m
	}
	fa := int64(0)
	for _, f := range fires(0) {
		fa = f
	}
	f1 := fires(1)
	if len(f1) != len(rest)+1 || fa == 0 {
		t.Fatalf("waiting: %d in shard 1, want %d; a's retry at %d", len(f1), len(rest)+1, fa)
	}
	fg, fRest := int64(-1), int64(-1)
	for _, f := range f1 {
		if fg < 0 || f < fg {
			fg = f
		}
	}
	for _, f := range f1 {
		if f != fg && (fRest < 0 || f < fRest) {
			fRest = f
		}
	}
	if !(fg < fa && fa < fRest) {
		t.Fatalf("retries at g %d, a %d, the rest from %d: want that order", fg, fa, fRest)
	}
	// g's produce begins while the broker is down and hangs (kafka-go
	// retrying it)...
	sink.gate.Store(&g)
	h.clk.Set(time.UnixMilli(fg))
	<-sink.entered
	// ...the broker is back, and a's delivery releases the group.
	h.sink.setFail(nil)
	h.clk.Set(time.UnixMilli(fa))
	eventuallyTrue(t, a+" delivered and the group released", func() bool { return len(h.sink.acked()) == 1 && releases.Load() > 0 })
	// Shard 1 claims its released tasks while g's batch is in its lane,
	// and sets them aside.
	s := h.e.shards[1]
	eventuallyTrue(t, "shard 1's released tasks set aside", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		n := 0
		for l := range s.lanes {
			n += len(s.lanes[l].parked)
		}
		return len(s.released) == 0 && n == len(rest)
	})
	gateOpen = true
	close(sink.release)
	h.settle()
	for range 10 {
		h.advance(time.Second)
	}
	if n := len(h.sink.acked()); n != len(rest)+2 {
		t.Fatalf("%d of %d tasks delivered 10 s after the release: the released tasks set aside while the lane was busy waited out their backoff", n, len(rest)+2)
	}
	h.checkPending()
}
