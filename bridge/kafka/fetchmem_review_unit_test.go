package kafka

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/bridge"
	"github.com/delaybridge/delaybridge/metrics"
	"github.com/delaybridge/delaybridge/shard"
)

// Review R220: what the budget and a partition's share hold, and the
// gauges, through stall and unstall interleavings, idle polls and a
// cancelled head waiter.
func TestFetchMemReviewInterleavings(t *testing.T) {
	heldG := prometheus.NewGauge(prometheus.GaugeOpts{Name: "held"})
	stuckG := prometheus.NewGauge(prometheus.GaugeOpts{Name: "stuck"})
	m := newFetchMem(100, heldG, stuckG, nil)
	ctx := context.Background()
	want := func(what string, held, stuck int64) {
		t.Helper()
		if h, st, _ := m.state(); h != held || st != stuck {
			t.Fatalf("%s: held %d stuck %d, want %d %d", what, h, st, held, stuck)
		}
		if g, s := testutil.ToFloat64(heldG), testutil.ToFloat64(stuckG); g != float64(held) || s != float64(stuck) {
			t.Fatalf("%s: gauges counted %v stuck %v, want %d %d", what, g, s, held, stuck)
		}
	}
	p := &partMem{m: m}
	g, err := m.reserve(ctx, 40)
	if err != nil {
		t.Fatal(err)
	}
	m.settle(g, 30)
	p.fetched(30) // batch 1, fetched before the stall
	p.unstall()   // nothing stuck: nothing changes
	want("unstall with nothing stuck", 30, 0)
	p.stall(false)
	p.stall(false) // again (a second attempt's DLQ wait): nothing more moves
	want("stalled", 0, 30)
	g, _ = m.reserve(ctx, 20)
	m.settle(g, 20)
	p.fetched(20) // batch 2, fetched ahead while stalled: stuck at once
	want("read-ahead while stalled", 0, 50)
	p.stall(true) // a store-wide error on a later attempt: stays as it is
	want("store-wide after the stall", 0, 50)
	p.unstall() // batch 1 stored: everything counts again
	want("unstalled", 50, 0)
	p.stored(30)
	p.stored(20)
	want("both stored", 0, 0)
	p.stored(10) // more than it holds: never below nothing
	want("over-stored", 0, 0)

	// An idle poll: outside the budget, shown in the counted gauge, never
	// waiting, and what it fetched counted.
	if g, _ = m.reserve(ctx, 100); g != 100 { // the whole budget
		t.Fatalf("granted %d, want 100", g)
	}
	n := m.poll(1 << 20)
	if n != idleFetchMemory {
		t.Fatalf("poll took %d, want %d", n, idleFetchMemory)
	}
	want("a poll beside a full budget", 100+idleFetchMemory, 0)
	m.settlePoll(n, 7)
	want("poll settled", 107, 0)
	m.release(g + 7)
	want("released", 0, 0)

	// The head waiter cancelled: the one behind it, which fits, is
	// granted.
	g, _ = m.reserve(ctx, 90)
	hctx, cancel := context.WithCancel(ctx)
	head := reserveAsync(t, m, hctx, 50)
	behind := reserveAsync(t, m, ctx, 10)
	if _, ok := granted(behind); ok {
		t.Fatal("a later reservation passed the head")
	}
	cancel()
	if got := <-head; got != 0 {
		t.Fatalf("cancelled head granted %d", got)
	}
	if got := <-behind; got != 10 {
		t.Fatalf("behind the cancelled head: granted %d, want 10", got)
	}
	m.release(g + 10)
	want("all released", 0, 0)
}

// stallHandler calls the batch's DeadLetterWait and returns err, as
// Pipeline.Handle does for a batch whose dead letters the DLQ took.
type stallHandler struct {
	err error
	pm  *partMem // when set, Handle returns once pm is stalled
}

func (stallHandler) Checkpoint(string) (int64, bool, error) { return 0, false, nil }

func (h stallHandler) Handle(_ context.Context, b *bridge.Batch) error {
	if b.DeadLetterWait != nil {
		b.DeadLetterWait()
	}
	for h.pm != nil {
		h.pm.mu.Lock()
		stalled := h.pm.stalled
		h.pm.mu.Unlock()
		if stalled {
			break
		}
		time.Sleep(time.Millisecond)
	}
	return h.err
}

// A DLQ wait's stall (after deadLetterStallAfter, here at once), whether
// it lands while Handle waits (every other attempt waits for it) or races
// Handle's return, is over when handle returns: the partition is not left
// stalled with its bytes out of the budget. (The race is rarely hit: with
// dlEnd not waiting for the stall, 3 runs passed.)
func TestHandleDeadLetterStallEndsWithHandle(t *testing.T) {
	old := deadLetterStallAfter
	t.Cleanup(func() { deadLetterStallAfter = old })
	deadLetterStallAfter = 0
	s := &Source{cfg: Config{RetryMin: time.Millisecond, RetryMax: time.Millisecond, Metrics: metrics.New(prometheus.NewRegistry())}}
	m := newFetchMem(1<<20, nil, nil, nil)
	b := &bridge.Batch{Items: []bridge.Item{{}}, Checkpoints: []shard.Checkpoint{{Key: "k"}}}
	for i := range 200 {
		p := &partMem{m: m}
		g, _ := m.reserve(context.Background(), 100)
		m.settle(g, 100)
		p.fetched(100)
		h := stallHandler{}
		if i%2 == 0 {
			h.pm = p
		}
		if !s.handle(context.Background(), h, b, part{"t", 0}, p, zap.NewNop()) {
			t.Fatal("handle returned false")
		}
		p.mu.Lock()
		stalled, counted, stuck := p.stalled, p.counted, p.stuck
		p.mu.Unlock()
		if stalled || counted != 100 || stuck != 0 {
			t.Fatalf("attempt %d: after handle: stalled %v counted %d stuck %d, want false 100 0", i, stalled, counted, stuck)
		}
		p.stored(100)
	}
	// Handle fails (ctx ended): no stall after handle returned either.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	p := &partMem{m: m}
	if s.handle(ctx, stallHandler{err: errors.New("ended")}, b, part{"t", 0}, p, zap.NewNop()) {
		t.Fatal("handle returned true with ctx ended")
	}
	p.releaseAll()
	if h, st, _ := m.state(); h != 0 || st != 0 {
		t.Fatalf("held %d stuck %d, want nothing", h, st)
	}
}
