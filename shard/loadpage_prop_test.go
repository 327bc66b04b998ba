package shard

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/delaybridge/delaybridge/codec"
)

// TestPagedLoaderProperty drives an engine whose loader reads 1-5 tasks
// a call through random herds, replaces, cancels, failing and unavailable
// publishes, clock steps forward and back, and restarts; every schedule
// version still pending at the end is delivered exactly once, none before
// its due, and nothing superseded is delivered.
func TestPagedLoaderProperty(t *testing.T) {
	seeds := 30
	if v := os.Getenv("DELAYBRIDGE_PAGED_SEEDS"); v != "" {
		seeds, _ = strconv.Atoi(v)
	}
	for seed := 0; seed < seeds; seed++ {
		t.Run(fmt.Sprint(seed), func(t *testing.T) { pagedRun(t, uint64(seed)) })
	}
}

type pagedVersion struct {
	id    string
	value string
	due   int64
	seq   int // ingest order
	fails int // generic failures left
	downs int // unavailable failures left
}

func pagedRun(t *testing.T, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 116))
	page := 1 + rng.IntN(5)
	h := newHarness(t, func(o *Options) {
		o.Shards = 1 + rng.IntN(2)
		o.Horizon = 4 * time.Second
		o.FireBatch = 1 + rng.IntN(6)
		o.OutageMemory = rng.IntN(3) - 1
		o.Logger = zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel))
		o.Retry = RetryPolicy{Initial: 300 * time.Millisecond, Max: 2 * time.Second, Multiplier: 2, Jitter: -1, MaxAttempts: 1000}
	})
	h.e.loadPage = page
	var mu sync.Mutex
	versions := map[string]*pagedVersion{} // by value
	pending := map[string]*pagedVersion{}  // by id: the live version
	h.sink.setFail(func(tk *codec.Task) error {
		mu.Lock()
		defer mu.Unlock()
		v := versions[string(tk.Value)]
		if v == nil {
			return nil
		}
		if v.downs > 0 {
			v.downs--
			return errDown
		}
		if v.fails > 0 {
			v.fails--
			return errors.New("boom")
		}
		return nil
	})
	h.run()
	n := int64(0)
	ingestSeq := 0
	base := t0.Add(2 * time.Second)
	herds := []time.Duration{0, 3 * time.Second, 5 * time.Second, 7500 * time.Millisecond, 11 * time.Second, 16 * time.Second}
	ids := 12
	for step := 0; step < 60; step++ {
		switch r := rng.IntN(10); {
		case r < 5: // a batch of schedules
			var batch []codec.Task
			k := 1 + rng.IntN(8)
			for range k {
				id := "i" + strconv.Itoa(rng.IntN(ids))
				var due time.Time
				if rng.IntN(4) == 0 {
					due = h.clk.Now().Add(time.Duration(rng.IntN(6000)-1000) * time.Millisecond)
				} else {
					due = base.Add(herds[rng.IntN(len(herds))])
				}
				n++
				tk := sched(id, due, n)
				ingestSeq++
				v := &pagedVersion{id: id, value: string(tk.Value), due: ms(due), seq: ingestSeq}
				if rng.IntN(5) == 0 {
					v.fails = 1 + rng.IntN(2)
				}
				if rng.IntN(6) == 0 {
					v.downs = 1 + rng.IntN(3)
				}
				mu.Lock()
				versions[v.value] = v
				mu.Unlock()
				pending[id] = v
				batch = append(batch, tk)
			}
			h.ingest(batch)
		case r < 6: // cancel
			id := "i" + strconv.Itoa(rng.IntN(ids))
			n++
			h.ingest([]codec.Task{cancelTask(id, n)})
			delete(pending, id)
		case r < 9:
			h.advance(time.Duration(100+rng.IntN(2500)) * time.Millisecond)
		default:
			if rng.IntN(3) == 0 {
				h.reopen()
				h.e.loadPage = page
				h.run()
			} else {
				h.set(h.clk.Now().Add(-time.Duration(1000+rng.IntN(2000)) * time.Millisecond))
			}
		}
		// Delivered versions leave the model's pending set.
		for _, d := range h.sink.all() {
			if d.Err == nil {
				if v := pending[d.ID]; v != nil && v.value == d.Value {
					delete(pending, d.ID)
				}
			}
		}
	}
	for range 120 {
		h.advance(500 * time.Millisecond)
	}
	// Checks.
	acks := map[string]int{}
	firstTry := map[string]time.Time{}
	for _, d := range h.sink.all() {
		if _, ok := firstTry[d.Value]; !ok {
			firstTry[d.Value] = d.At
		}
		if d.Err == nil {
			acks[d.Value]++
		}
	}
	for val, c := range acks {
		if c != 1 {
			t.Errorf("seed %d page %d: %s delivered %d times", seed, page, val, c)
		}
	}
	for _, v := range pending {
		if acks[v.value] != 1 {
			t.Errorf("seed %d page %d: pending %s (due %v) delivered %d times; stats %+v", seed, page, v.value, time.UnixMilli(v.due).UTC(), acks[v.value], h.e.Stats())
		}
	}
	for val, at := range firstTry {
		v := versions[val]
		if v != nil && ms(at) < v.due {
			t.Errorf("seed %d: %s first tried at %v, before its due %v", seed, val, at, time.UnixMilli(v.due).UTC())
		}
	}
	// No check of the order of equal dues across ids: a replace of a
	// task in flight waits for that flight (same-id order, the only order
	// promised), so later ingests of the same due may go first.
	if st := h.e.Stats(); st.Pending != 0 {
		t.Errorf("seed %d: %d still pending: %+v", seed, st.Pending, st)
	}
	h.checkPending()
}
