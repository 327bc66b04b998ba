package shard

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"

	"github.com/delaybridge/delaybridge/codec"
)

// TestConcurrentWritersKeepStoreConsistent runs concurrent ingest batches
// (schedules, replaces and cancels of a small id pool from several
// partitions), admin cancels, a moving clock and a fire loop whose sink
// fails some deliveries, then checks the store invariants: the pending
// counters equal the stored tasks, every index entry of a pending task
// points to a stored task, and every stored schedule is the one its index
// points to.
func TestConcurrentWritersKeepStoreConsistent(t *testing.T) {
	for seed := uint64(1); seed <= 3; seed++ {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			h := newHarness(t, func(o *Options) {
				o.Shards = 4
				o.FireBatch = 8
				o.Horizon = 2 * time.Second
				o.Retry = RetryPolicy{Initial: 50 * time.Millisecond, Max: 200 * time.Millisecond, MaxAttempts: 3}
			})
			var sinkMu sync.Mutex
			sinkRng := rand.New(rand.NewPCG(seed, 7))
			h.sink.setFail(func(*codec.Task) error {
				sinkMu.Lock()
				defer sinkMu.Unlock()
				if sinkRng.IntN(5) == 0 {
					return errors.New("flaky broker")
				}
				return nil
			})
			h.run()
			ctx := context.Background()
			var wg sync.WaitGroup
			stop := make(chan struct{})
			for w := 0; w < 4; w++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					rng := rand.New(rand.NewPCG(seed, uint64(w)))
					off := int64(0)
					for b := 0; b < 60; b++ {
						var batch []codec.Task
						for i := 0; i < 10; i++ {
							off++
							id := fmt.Sprint("k", rng.IntN(30))
							now := h.clk.Now()
							var tk codec.Task
							if rng.IntN(5) == 0 {
								tk = cancelTask(id, off)
							} else {
								tk = sched(id, now.Add(time.Duration(rng.IntN(3000))*time.Millisecond), off)
							}
							tk.Partition = int32(w)
							tk.Stamp = ms(now) + int64(rng.IntN(200))
							batch = append(batch, tk)
						}
						if err := h.e.Ingest(ctx, batch, []Checkpoint{{Key: fmt.Sprint("p", w), Offset: off}}); err != nil {
							t.Error(err)
							return
						}
						if rng.IntN(4) == 0 {
							err := h.e.Cancel("src", fmt.Sprint("k", rng.IntN(30)))
							if err != nil && !errors.Is(err, ErrNotFound) {
								t.Error(err)
							}
						}
					}
				}()
			}
			var clockWG sync.WaitGroup
			clockWG.Add(1)
			go func() {
				defer clockWG.Done()
				for {
					select {
					case <-stop:
						return
					default:
					}
					h.clk.Advance(20 * time.Millisecond)
					time.Sleep(200 * time.Microsecond)
				}
			}()
			wg.Wait()
			close(stop)
			clockWG.Wait()
			h.settle()
			checkStoreInvariants(t, h.e)
			for w := 0; w < 4; w++ {
				if off, ok, _ := h.e.Checkpoint(fmt.Sprint("p", w)); !ok || off != 600 {
					t.Fatalf("checkpoint p%d = %d,%v, want 600", w, off, ok)
				}
			}
			// Drain: everything fires or dead-letters.
			h.sink.setFail(nil)
			for i := 0; i < 10; i++ {
				h.advance(time.Second)
			}
			checkStoreInvariants(t, h.e)
			if p := h.e.Stats().Pending; p != 0 {
				t.Fatalf("%d pending after draining", p)
			}
		})
	}
}

func checkStoreInvariants(t *testing.T, e *Engine) {
	t.Helper()
	stored := map[[2]uint64]codec.Task{} // (fire, seq) of schedules -> task
	perShard := make([]int64, len(e.shards))
	it, err := e.db.NewIter(&pebble.IterOptions{LowerBound: []byte{prefixTask}, UpperBound: []byte{prefixTask + 1}})
	if err != nil {
		t.Fatal(err)
	}
	for ok := it.First(); ok; ok = it.Next() {
		sh, fire, seq, _ := parseTaskKey(it.Key())
		perShard[sh]++
		var tk codec.Task
		if err := codec.DecodeTask(it.Value(), &tk); err != nil {
			t.Fatal(err)
		}
		if tk.Kind == codec.KindSchedule {
			stored[[2]uint64{uint64(fire), seq}] = tk
		}
	}
	it.Close()
	for _, s := range e.shards {
		s.mu.Lock()
		p, q, ov := s.pending, len(s.queue), len(s.overlay)
		s.mu.Unlock()
		if p != perShard[s.id] || q != 0 || ov != 0 {
			t.Fatalf("shard %d: pending %d, stored %d, queue %d, overlay %d", s.id, p, perShard[s.id], q, ov)
		}
	}
	indexed := 0
	it, err = e.db.NewIter(&pebble.IterOptions{LowerBound: []byte{prefixIndex}, UpperBound: []byte{prefixIndex + 1}})
	if err != nil {
		t.Fatal(err)
	}
	for ok := it.First(); ok; ok = it.Next() {
		var ie indexEntry
		if err := decodeIndexEntry(it.Value(), &ie); err != nil {
			t.Fatal(err)
		}
		if ie.Cancel {
			continue
		}
		indexed++
		if _, ok := stored[[2]uint64{uint64(ie.Fire), ie.Seq}]; !ok {
			t.Fatalf("index %q points to missing task %d/%d", it.Key(), ie.Fire, ie.Seq)
		}
	}
	it.Close()
	if indexed != len(stored) {
		t.Fatalf("%d indexed pending tasks, %d stored schedules", indexed, len(stored))
	}
}
