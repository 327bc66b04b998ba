package shard

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

func TestIDFilter(t *testing.T) {
	for _, tc := range []struct {
		capacity, keys int
		maxFP          float64 // false positives among as many absent keys
	}{
		{capacity: 64, keys: 64, maxFP: 0.05},
		{capacity: 1000, keys: 1000, maxFP: 0.02},
		{capacity: 100000, keys: 100000, maxFP: 0.02},
		{capacity: 100000, keys: 50000, maxFP: 0.002},
	} {
		t.Run(fmt.Sprintf("cap=%d/keys=%d", tc.capacity, tc.keys), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(1, uint64(tc.capacity)))
			f := newIDFilter(tc.capacity)
			in := make([]uint64, tc.keys)
			for i := range in {
				in[i] = filterHash(fmt.Appendf(nil, "isrc\x00%016x", rng.Uint64()))
				f.add(in[i])
			}
			for i, h := range in {
				if !f.mayContain(h) {
					t.Fatalf("key %d added but not found: a false negative", i)
				}
			}
			fp := 0
			for range tc.keys {
				if f.mayContain(filterHash(fmt.Appendf(nil, "iother\x00%016x", rng.Uint64()))) {
					fp++
				}
			}
			if rate := float64(fp) / float64(tc.keys); rate > tc.maxFP {
				t.Fatalf("false positive rate %.4f, want <= %.4f", rate, tc.maxFP)
			}
			if got, want := f.full(), tc.keys > tc.capacity; got != want {
				t.Fatalf("full() = %v with %d of %d keys", got, tc.keys, tc.capacity)
			}
			// Keys it holds again (replaces, retries) fill nothing.
			n := f.n
			for _, h := range in {
				f.add(h)
			}
			if f.n != n {
				t.Fatalf("adding the %d keys again counted %d more", tc.keys, f.n-n)
			}
		})
	}
}

// TestIDFilterHotKeys: a filter of a few ids replaced over and over is
// not full, so it is not rebuilt from a scan of the whole index every
// capacity replaces.
func TestIDFilterHotKeys(t *testing.T) {
	f := newIDFilter(64)
	for i := range 1000 {
		f.add(filterHashString(fmt.Sprintf("isrc\x00hot-%d", i%3)))
	}
	if f.full() || f.n > 3 {
		t.Fatalf("filter of capacity %d counts %d keys (full %v) after 1000 adds of 3 ids", f.capacity, f.n, f.full())
	}
}

// waitFilterBuilds blocks until n index filter builds completed. The
// deadline only turns a build that never starts into a failure.
func waitFilterBuilds(t testing.TB, e *Engine, n int) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		e.fltMu.Lock()
		defer e.fltMu.Unlock()
		for e.fltBuilds < n {
			e.fltCond.Wait()
		}
	}()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		e.fltMu.Lock()
		got := e.fltBuilds
		e.fltMu.Unlock()
		t.Fatalf("%d index filter builds, waited for %d", got, n)
	}
}

func (e *Engine) indexReadCount() int64 {
	var n int64
	for _, s := range e.shards {
		s.mu.Lock()
		n += s.indexReads
		s.mu.Unlock()
	}
	return n
}

func schedBatch(prefix string, from, to int, due time.Time, n int64) []codec.Task {
	var b []codec.Task
	for i := from; i < to; i++ {
		b = append(b, sched(fmt.Sprintf("%s%d", prefix, i), due, n))
	}
	return b
}

// TestFilterSparesLookups: with the filter built, new ids read nothing from
// the store (up to its false positives), and every known id still does.
func TestFilterSparesLookups(t *testing.T) {
	h := newHarness(t, nil)
	waitFilterBuilds(t, h.e, 1)
	const n = 2000
	for i := 0; i < n; i += 100 {
		h.ingest(schedBatch("new-", i, i+100, t0.Add(time.Hour), 1))
	}
	if r := h.e.indexReadCount(); r > n/50 {
		t.Fatalf("%d store lookups for %d new ids, want <= %d", r, n, n/50)
	}
	before := h.e.indexReadCount()
	for i := 0; i < n; i += 100 {
		h.ingest(schedBatch("new-", i, i+100, t0.Add(2*time.Hour), 2))
	}
	if r := h.e.indexReadCount() - before; r != n {
		t.Fatalf("%d store lookups for %d replaces, want every one", r, n)
	}
	if got := h.e.Stats().Pending; got != n {
		t.Fatalf("pending = %d after replacing %d ids, want %d", got, n, n)
	}
	h.checkPending()
}

// TestFilterAtOpen: the filter built at open holds the ids already stored,
// so they are still replaced, not duplicated.
func TestFilterAtOpen(t *testing.T) {
	h := newHarness(t, nil)
	const n = 500
	h.ingest(schedBatch("old-", 0, n, t0.Add(time.Hour), 1))
	h.ingest([]codec.Task{cancelTask("gone", 2)})
	h.reopen()
	waitFilterBuilds(t, h.e, 1)
	for _, s := range h.e.shards {
		if s.flt == nil || s.fltScanned == 0 {
			t.Fatalf("shard %d: filter %v after open with %d keys scanned", s.id, s.flt != nil, s.fltScanned)
		}
	}
	h.ingest(schedBatch("old-", 0, n, t0.Add(2*time.Hour), 3))
	// The cancel marker is in the index too: an older schedule stays dropped.
	h.ingest([]codec.Task{sched("gone", t0.Add(time.Hour), 1)})
	if got := h.e.Stats().Pending; got != n {
		t.Fatalf("pending = %d after replacing %d stored ids, want %d", got, n, n)
	}
	info, err := h.e.Lookup("src", "old-7")
	if err != nil || !info.Due.Equal(t0.Add(2*time.Hour)) {
		t.Fatalf("Lookup(old-7) = %+v, %v; want due %v", info, err, t0.Add(2*time.Hour))
	}
	h.checkPending()
}

// TestFilterBuildRacesIngest: ids decided while a build runs are in the
// new filter whether they were decided before it installed its filters
// (then in the overlay) or between that and its scan, and applied only
// after the scan.
func TestFilterBuildRacesIngest(t *testing.T) {
	h := newHarness(t, nil)
	e := h.e
	waitFilterBuilds(t, e, 1)
	ctx := context.Background()

	// gate blocks the next Ingest after its decision until released.
	type gate struct{ decided, release chan struct{} }
	var mu sync.Mutex
	var gates []gate
	e.testHookIngestDecided = func() {
		mu.Lock()
		if len(gates) == 0 {
			mu.Unlock()
			return
		}
		g := gates[0]
		gates = gates[1:]
		mu.Unlock()
		close(g.decided)
		<-g.release
	}
	ingestHeld := func(id string) (gate, chan error) {
		g := gate{make(chan struct{}), make(chan struct{})}
		mu.Lock()
		gates = append(gates, g)
		mu.Unlock()
		done := make(chan error, 1)
		go func() { done <- e.Ingest(ctx, []codec.Task{sched(id, t0.Add(time.Hour), 1)}, nil) }()
		<-g.decided
		return g, done
	}

	before, beforeDone := ingestHeld("before-install")
	var during gate
	var duringDone chan error
	e.testHookFilterScan = func() error {
		during, duringDone = ingestHeld("before-scan")
		return nil
	}
	if err := e.buildFilters(ctx); err != nil {
		t.Fatal(err)
	}
	e.testHookFilterScan = nil
	close(before.release)
	close(during.release)
	for _, done := range []chan error{beforeDone, duringDone} {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	h.ingest([]codec.Task{sched("before-install", t0.Add(2*time.Hour), 2), sched("before-scan", t0.Add(2*time.Hour), 2)})
	if got := e.Stats().Pending; got != 2 {
		t.Fatalf("pending = %d after replacing both ids, want 2 (a replace took a stored id for new)", got)
	}
	h.checkPending()
}

// TestFilterRebuildWhenFull: a filter that took as many keys as it was
// sized for is rebuilt, larger, and the ids stay known.
func TestFilterRebuildWhenFull(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.Shards, o.filterMinKeys = 1, 256 })
	waitFilterBuilds(t, h.e, 1)
	const n = 1000
	for i := 0; i < n; i += 50 {
		h.ingest(schedBatch("id-", i, i+50, t0.Add(time.Hour), 1))
	}
	waitFilterBuilds(t, h.e, 2)
	s := h.e.shards[0]
	s.mu.Lock()
	capacity := s.flt.capacity
	s.mu.Unlock()
	if capacity <= 256 {
		t.Fatalf("filter capacity %d after a rebuild with up to %d keys, want it grown", capacity, n)
	}
	for i := 0; i < n; i += 50 {
		h.ingest(schedBatch("id-", i, i+50, t0.Add(2*time.Hour), 2))
	}
	if got := h.e.Stats().Pending; got != n {
		t.Fatalf("pending = %d after replacing %d ids, want %d", got, n, n)
	}
	h.checkPending()
}

// TestFilterBuildRetried: a failed build keeps the filters it would have
// replaced, drops the one it was building, and is tried again a minute
// later.
func TestFilterBuildRetried(t *testing.T) {
	h := newHarness(t, nil)
	e := h.e
	waitFilterBuilds(t, e, 1)
	var calls atomic.Int32
	e.fltBuildMu.Lock() // the hook is read by the loop's next build
	e.testHookFilterScan = func() error {
		if calls.Add(1) == 1 {
			return errors.New("injected")
		}
		return nil
	}
	e.fltBuildMu.Unlock()
	e.kickFilter()
	deadline := time.Now().Add(20 * time.Second)
	for h.clk.Timers() == 0 { // the loop waits for its retry
		if time.Now().After(deadline) {
			t.Fatal("no retry timer after a failed build")
		}
		time.Sleep(50 * time.Microsecond)
	}
	for _, s := range e.shards {
		s.mu.Lock()
		old, next := s.flt != nil, s.fltNext != nil
		s.mu.Unlock()
		if !old || next {
			t.Fatalf("shard %d after a failed build: filter %v, building %v; want the old one kept, none building", s.id, old, next)
		}
	}
	h.clk.Advance(filterRetry)
	waitFilterBuilds(t, e, 2)
	if got := calls.Load(); got != 2 {
		t.Fatalf("%d builds reached the scan, want 2 (the failed one and its retry)", got)
	}
}

// TestShardOfIndexKey: a build files each scanned key in the shard Ingest
// routes its (source, id) to.
func TestShardOfIndexKey(t *testing.T) {
	for _, tc := range []struct{ source, id string }{
		{"src", "a"}, {"orders", "0f3c9e6a-7b1d-4c2e-9a8f-1d2e3f4a5b6c"}, {"s", ""}, {"s", "with\x00nul"}, {"kafka-topic.x", "ü"},
	} {
		for _, n := range []int{1, 4, 8, 1000} {
			if got, want := shardOfIndexKey(appendIndexKey(nil, tc.source, tc.id), n), shardOfN(tc.source, tc.id, n); got != want {
				t.Errorf("shardOfIndexKey(%q/%q, %d) = %d, shardOfN = %d", tc.source, tc.id, n, got, want)
			}
		}
	}
}
