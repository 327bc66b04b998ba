package shard

import (
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// TestLoaderPageBoundary walks the loader through a herd of equal dues in
// pages: each call puts at most loadPage tasks in the wheel, the horizon
// stops inside the herd at the next task's key, a task ingested meanwhile
// enters the wheel at once only when its key is before that point, and
// every stored task ends up in the wheel exactly once.
func TestLoaderPageBoundary(t *testing.T) {
	const page = 10
	h := newHarness(t, func(o *Options) { o.Shards = 1; o.Horizon = 10 * time.Minute })
	h.e.loadPage = page
	herd := t0.Add(time.Hour)
	n := int64(0)
	h.ingest([]codec.Task{sched("before", herd.Add(-time.Millisecond), 1)})
	for b := 0; b < 5; b++ {
		n++
		h.ingest(schedBatch(fmt.Sprintf("a%d-", b), 0, 7, herd, n))
	}
	h.ingest([]codec.Task{sched("after", herd.Add(time.Millisecond), 99)})
	const stored = 1 + 35 + 1
	s := h.e.shards[0]
	h.clk.Set(herd.Add(-6 * time.Minute))
	now := ms(h.clk.Now())

	load := func() (added int) {
		t.Helper()
		s.mu.Lock()
		defer s.mu.Unlock()
		before := s.w.Len()
		if err := s.loadLocked(now); err != nil {
			t.Fatalf("load: %v", err)
		}
		return s.w.Len() - before
	}
	if got := load(); got != page {
		t.Fatalf("first page put %d tasks in the wheel, want %d", got, page)
	}
	s.mu.Lock()
	end, seq := s.horizonEnd, s.horizonSeq
	s.mu.Unlock()
	if end != ms(herd) || seq == 0 {
		t.Fatalf("horizon after a page inside the herd: (%d, %d), want (%d, the next task's seq)", end, seq, ms(herd))
	}
	// Keys on either side of the stop point. The loader has passed
	// (herd, seq-1), so a task written there (a retry keeps its seq)
	// must go in the wheel at once; (herd, seq) it reads itself.
	s.mu.Lock()
	below, at := s.belowHorizonLocked(ms(herd), seq-1), s.belowHorizonLocked(ms(herd), seq)
	s.mu.Unlock()
	if !below || at {
		t.Fatalf("belowHorizon(herd, seq-1) = %v, (herd, seq) = %v; want true, false", below, at)
	}
	// What a retry rescheduled there does (the fire loop's settle): a
	// key the loader passed goes in the wheel, one it has not does not.
	// (The entry added is a second one for a loaded seq; this wheel is
	// only counted from here on.)
	s.mu.Lock()
	w := s.w.Len()
	s.addLocked(ms(herd), seq-1)
	passed := s.w.Len() - w
	s.addLocked(ms(herd), seq)
	ahead := s.w.Len() - w - passed
	s.mu.Unlock()
	if passed != 1 || ahead != 0 {
		t.Fatalf("a write at (herd, seq-1) added %d wheel entries (want 1), at (herd, seq) %d (want 0)", passed, ahead)
	}
	// Ingested now: due in the herd (a later seq: the loader's), and
	// due before it (the wheel's at once).
	inWheel := func() int {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.w.Len()
	}
	w0 := inWheel()
	h.ingest([]codec.Task{sched("late-herd", herd, 100)})
	if got := inWheel(); got != w0 {
		t.Fatalf("a task ingested into the unloaded part of the herd went in the wheel (%d -> %d): the loader adds it again", w0, got)
	}
	h.ingest([]codec.Task{sched("early", herd.Add(-2*time.Millisecond), 101)})
	if got := inWheel(); got != w0+1 {
		t.Fatalf("a task due before the horizon is not in the wheel (%d -> %d)", w0, got)
	}
	total := page + 2 // the first page, the retry-like add and the early task
	for i := 0; ; i++ {
		got := load()
		if got > page {
			t.Fatalf("a page put %d tasks in the wheel, at most %d", got, page)
		}
		total += got
		s.mu.Lock()
		done := s.horizonEnd == now+s.e.horizonMs()
		s.mu.Unlock()
		if done {
			break
		}
		if i > stored {
			t.Fatal("the loader does not reach the horizon")
		}
	}
	if want := stored + 3; total != want || inWheel() != want {
		t.Fatalf("%d tasks put in the wheel (%d in it), want each of %d once", total, inWheel(), want)
	}
}

// TestLoaderPagedHerdFiresInOrder runs the fire loop over a herd the
// loader reads in pages, with a task ingested into it while it is being
// read and a retry rescheduled onto its due time: each fires once, the
// herd in ingest order.
func TestLoaderPagedHerdFiresInOrder(t *testing.T) {
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.Horizon = 10 * time.Minute
		o.Retry = RetryPolicy{Initial: 4 * time.Minute, Max: 4 * time.Minute, Multiplier: 2, Jitter: -1, MaxAttempts: 5}
	})
	h.e.loadPage = 3
	var once sync.Once
	h.sink.setFail(func(t *codec.Task) error {
		var err error
		if t.ID == "retry" {
			once.Do(func() { err = errors.New("broker says no, once") })
		}
		return err
	})
	h.run()
	herd := t0.Add(time.Hour)
	var want []string
	h.ingest([]codec.Task{sched("retry", herd.Add(-4*time.Minute), 1)})
	for b := 0; b < 10; b++ {
		batch := schedBatch(fmt.Sprintf("h%d-", b), 0, 5, herd, int64(b+2))
		for _, tk := range batch {
			want = append(want, tk.ID)
		}
		h.ingest(batch)
	}
	// The retry fires at herd-4m and is rescheduled to the herd's due:
	// its seq is older than the whole herd's.
	h.set(herd.Add(-4 * time.Minute))
	h.ingest([]codec.Task{sched("joined", herd, 50)})
	want = append(want, "joined")
	h.set(herd)
	seen := map[string]int{}
	var order []string
	for _, d := range h.sink.all() {
		if d.Err != nil {
			continue
		}
		seen[d.ID]++
		if d.ID != "retry" {
			order = append(order, d.ID)
		} else if !d.At.Equal(herd) {
			t.Fatalf("retry delivered at %v, want at the herd's due %v", d.At, herd)
		}
	}
	if seen["retry"] != 1 {
		t.Fatalf("the retry rescheduled onto the herd was delivered %d times", seen["retry"])
	}
	if fmt.Sprint(order) != fmt.Sprint(want) {
		t.Fatalf("herd delivered as\n%v\nwant once each in ingest order\n%v", order, want)
	}
	h.checkPending()
}
