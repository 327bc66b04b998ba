package kafka

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// granted reports whether the reservation running in done has returned.
func granted(done <-chan int64) (int64, bool) {
	select {
	case n := <-done:
		return n, true
	default:
		return 0, false
	}
}

// reserveAsync starts a reservation of n and returns where its grant
// arrives (0 when it failed), once it is queued.
func reserveAsync(t *testing.T, m *fetchMem, ctx context.Context, n int64) <-chan int64 {
	t.Helper()
	m.mu.Lock()
	queued := len(m.waiters)
	m.mu.Unlock()
	done := make(chan int64, 1)
	go func() {
		g, err := m.reserve(ctx, n)
		if err != nil {
			g = 0
		}
		done <- g
	}()
	waitFor(t, "the reservation to queue or be granted", func() bool {
		m.mu.Lock()
		defer m.mu.Unlock()
		return len(m.waiters) > queued || len(done) > 0
	})
	return done
}

func TestFetchMemReserveRelease(t *testing.T) {
	held := prometheus.NewGauge(prometheus.GaugeOpts{Name: "held"})
	waits := prometheus.NewCounter(prometheus.CounterOpts{Name: "waits"})
	m := newFetchMem(100, held, nil, waits)
	ctx := context.Background()
	for _, tc := range []struct {
		name       string
		n, want    int64
		heldBefore int64
	}{
		{"fits", 40, 40, 0},
		{"fits to the limit", 60, 60, 40},
	} {
		g, err := m.reserve(ctx, tc.n)
		if err != nil || g != tc.want {
			t.Fatalf("%s: reserve(%d) = %d, %v; want %d", tc.name, tc.n, g, err, tc.want)
		}
	}
	if got := testutil.ToFloat64(held); got != 100 {
		t.Fatalf("held gauge %v, want 100", got)
	}
	if g := m.tryReserve(1); g != 0 {
		t.Fatalf("tryReserve over the limit granted %d", g)
	}
	done := reserveAsync(t, m, ctx, 30)
	if _, ok := granted(done); ok {
		t.Fatal("a reservation over the limit was granted")
	}
	if got := testutil.ToFloat64(waits); got != 1 {
		t.Fatalf("waits %v, want 1", got)
	}
	m.release(20) // 80 held: 30 does not fit yet
	if _, ok := granted(done); ok {
		t.Fatal("granted 30 with 80 of 100 held")
	}
	m.settle(60, 50) // a fetch that used less than it reserved: 70 held
	if g := <-done; g != 30 {
		t.Fatalf("granted %d, want 30", g)
	}
	m.settle(30, 45) // one that used more: taken, whatever the limit
	if h, _, peak := m.state(); h != 115 || peak != 115 {
		t.Fatalf("held %d peak %d, want 115 115", h, peak)
	}
	m.release(115)
	if h, _, _ := m.state(); h != 0 {
		t.Fatalf("held %d after releasing everything", h)
	}
	if got := testutil.ToFloat64(held); got != 0 {
		t.Fatalf("held gauge %v, want 0", got)
	}
}

// A reservation larger than the whole budget is clamped to it and granted
// once nothing else is held: one partition always progresses.
func TestFetchMemRequestLargerThanBudget(t *testing.T) {
	m := newFetchMem(10, nil, nil, nil)
	ctx := context.Background()
	if g, err := m.reserve(ctx, 1000); err != nil || g != 10 {
		t.Fatalf("reserve(1000) on a budget of 10 = %d, %v; want 10", g, err)
	}
	done := reserveAsync(t, m, ctx, 1000)
	m.settle(10, 500) // the fetch got one large batch: over the budget
	if _, ok := granted(done); ok {
		t.Fatal("granted while 500 are held")
	}
	m.release(500) // stored
	if g := <-done; g != 10 {
		t.Fatalf("granted %d, want 10", g)
	}
	// Even a reservation while more than the budget is held is taken once
	// that is released: nothing held always grants.
	m.settle(10, 0)
	if g := m.tryReserve(1 << 40); g != 10 {
		t.Fatalf("tryReserve with nothing held = %d, want 10", g)
	}
}

// Waiters are served in order: a small one that would fit does not pass a
// large one queued before it, so a partition asking for a full fetch is not
// starved by smaller ones.
func TestFetchMemFIFO(t *testing.T) {
	m := newFetchMem(100, nil, nil, nil)
	ctx := context.Background()
	if _, err := m.reserve(ctx, 90); err != nil {
		t.Fatal(err)
	}
	big := reserveAsync(t, m, ctx, 60)
	small := reserveAsync(t, m, ctx, 5) // would fit now (95 <= 100), but queues behind big
	if _, ok := granted(small); ok {
		t.Fatal("a later small reservation passed an earlier one")
	}
	if g := m.tryReserve(5); g != 0 {
		t.Fatal("tryReserve passed the queue")
	}
	m.release(50) // 40 held: big (60) fits, small (5) not beside it
	if g := <-big; g != 60 {
		t.Fatalf("big granted %d", g)
	}
	if _, ok := granted(small); ok {
		t.Fatal("small granted over the limit")
	}
	m.release(5)
	if g := <-small; g != 5 {
		t.Fatalf("small granted %d", g)
	}
	if h, _, _ := m.state(); h != 100 {
		t.Fatalf("held %d, want 100", h)
	}
}

// A reservation whose ctx ends while it waits takes nothing, and those
// queued behind it are served.
func TestFetchMemCancelWhileWaiting(t *testing.T) {
	m := newFetchMem(100, nil, nil, nil)
	if _, err := m.reserve(context.Background(), 50); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	head := reserveAsync(t, m, ctx, 80) // blocks those behind it
	behind := reserveAsync(t, m, context.Background(), 40)
	cancel()
	if g := <-head; g != 0 {
		t.Fatalf("a cancelled reservation was granted %d", g)
	}
	if g := <-behind; g != 40 {
		t.Fatalf("behind granted %d, want 40", g)
	}
	if h, _, _ := m.state(); h != 90 {
		t.Fatalf("held %d, want 90", h)
	}
	_, err := m.reserve(ctx, 1000)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("reserve on an ended ctx with no room: %v", err)
	}
}

// Many reservers, releasing what they took, in random interleavings: the
// budget ends at 0 and never held more than the limit (every request fits).
func TestFetchMemConcurrent(t *testing.T) {
	m := newFetchMem(1000, nil, nil, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	for i := range 32 {
		wg.Go(func() {
			for j := range 200 {
				n := int64(1 + (i*7+j*13)%300)
				g, err := m.reserve(ctx, n)
				if err != nil {
					t.Error(err)
					return
				}
				used := g - int64(j%3) // settle less, or the same
				m.settle(g, used)
				m.release(used)
			}
		})
	}
	wg.Wait()
	held, _, peak := m.state()
	if held != 0 || peak > 1000 {
		t.Fatalf("held %d peak %d: want 0 and at most 1000", held, peak)
	}
}

// A partition whose batch waits for its DLQ (or is retried after an error
// other than the store's) has all its bytes moved out of the budget, so
// others go on, however many such partitions there are; they count again
// once stored. One the store refuses keeps them counted (the store refuses
// every partition alike). releaseAll gives everything back.
func TestPartMemStall(t *testing.T) {
	stuckG := prometheus.NewGauge(prometheus.GaugeOpts{Name: "stuck"})
	m := newFetchMem(100, nil, stuckG, nil)
	ctx := context.Background()
	a, b, c := &partMem{m: m}, &partMem{m: m}, &partMem{m: m}
	take := func(p *partMem, n int64) {
		t.Helper()
		g, err := m.reserve(ctx, n)
		if err != nil {
			t.Fatal(err)
		}
		m.settle(g, n)
		p.fetched(n)
	}
	want := func(held, stuck int64) {
		t.Helper()
		if h, st, _ := m.state(); h != held || st != stuck {
			t.Fatalf("held %d stuck %d, want %d %d", h, st, held, stuck)
		}
		if got := testutil.ToFloat64(stuckG); got != float64(stuck) {
			t.Fatalf("stuck gauge %v, want %d", got, stuck)
		}
	}
	take(a, 70)
	take(b, 30)
	waiting := reserveAsync(t, m, ctx, 50)
	a.stall(false) // a's 70 out of the budget: 30 held, 50 fits
	if g := <-waiting; g != 50 {
		t.Fatalf("granted %d", g)
	}
	m.settle(50, 50)
	b.fetched(50)
	want(80, 70)
	b.stall(false) // all of b's 80 too: stuck bytes are not capped
	want(0, 150)
	take(c, 60)
	c.stall(true) // the store refused it: stays counted
	want(60, 150)
	a.stored(40) // part of a's retried batch stored
	a.unstall()  // the rest counts again
	want(90, 80)
	a.releaseAll()
	b.releaseAll()
	c.releaseAll()
	want(0, 0)
}

func TestMemSizer(t *testing.T) {
	e := newMemSizer(1 << 20)
	if w := e.want(); w != 1<<20 {
		t.Fatalf("first want %d", w)
	}
	// 1 MiB decoded held 1.5 MiB (small records: their Items).
	e.observe(3<<19, 1<<20, false)
	if w := e.want(); w != 3<<19 {
		t.Fatalf("want %d, want 1.5 MiB", w)
	}
	if l := e.limitFor(3<<19, 1<<20, false); l != 1<<20 {
		t.Fatalf("a full grant shrank the limit to %d", l)
	}
	if l := e.limitFor(3<<18, 1<<20, false); l != 1<<19 {
		t.Fatalf("half a grant: limit %d, want 512 KiB", l)
	}
	if l := e.limitFor(1, 1<<20, false); l != minFetchBytes {
		t.Fatalf("a tiny grant: limit %d, want the floor", l)
	}
	if l := e.limitFor(1, 1<<20, true); l != 1<<20 {
		t.Fatalf("stepping: limit %d, want it kept", l)
	}
	// Caught up with little: the next (a long poll) reserves little.
	e.observe(3000, 2000, true)
	if w := e.want(); w != idleFetchMemory {
		t.Fatalf("idle want %d", w)
	}
	e.observe(100<<10, 80<<10, true)
	if w := e.want(); w != 200<<10 {
		t.Fatalf("caught-up want %d, want twice the last", w)
	}
}

// tryReserveWithin keeps what is held within its ceiling: idle partitions'
// long polls take full fetches only while the budget is less than half used.
func TestFetchMemTryReserveWithin(t *testing.T) {
	m := newFetchMem(100, nil, nil, nil)
	if g := m.tryReserveWithin(40, 50); g != 40 {
		t.Fatalf("granted %d, want 40", g)
	}
	if g := m.tryReserveWithin(20, 50); g != 0 {
		t.Fatalf("granted %d past the ceiling", g)
	}
	if g := m.tryReserve(20); g != 20 {
		t.Fatalf("tryReserve granted %d, want 20", g)
	}
}
