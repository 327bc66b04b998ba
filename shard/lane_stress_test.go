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

// stressSink holds Kafka batches at random for longer than LaneGrace, fails
// some tasks (ErrUnavailable or a plain error), and records every acked
// delivery with the number of the Deliver call that carried it. Where each
// publish began is numbered too (begin, from the engine's testHookBeginPublish,
// under the shard lock right after its last supersession check), so a
// publish that began before an op returned numbers <= the begun counter
// read after it: the Deliver call itself comes a moment later, and a
// replace may return in between.
type stressSink struct {
	mu      sync.Mutex
	rng     *rand.Rand
	hold    atomic.Bool
	fail    atomic.Bool
	calls   atomic.Int64
	begun   atomic.Int64
	begins  map[string][]int64 // value -> begin numbers of its publishes as a task
	acks    map[string][]int64 // value -> entry numbers of its acked deliveries
	kinds   map[string]codec.Kind
	mixed   atomic.Int32
	holding atomic.Int32
	holds   int
}

// begin numbers a publish that begins (Engine.testHookBeginPublish).
func (s *stressSink) begin(batch []*codec.Task) {
	n := s.begun.Add(1)
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, t := range batch {
		if t.Kind == codec.KindDeadLetter {
			// A dead letter is not superseded by a replace or cancel:
			// one made before the replace (the last attempt failed) is
			// delivered to its DLQ after it, rightly.
			continue
		}
		s.begins[string(t.Value)] = append(s.begins[string(t.Value)], n)
	}
}

func (s *stressSink) Deliver(ctx context.Context, batch []*codec.Task) []error {
	n := s.calls.Add(1)
	for _, t := range batch {
		if transportSlot(t.Transport) != transportSlot(batch[0].Transport) {
			s.mixed.Add(1)
		}
	}
	s.mu.Lock()
	holdFor := time.Duration(0)
	if batch[0].Transport == codec.TransportKafka && s.hold.Load() && s.rng.IntN(3) == 0 {
		holdFor = time.Duration(5+s.rng.IntN(30)) * time.Millisecond
		s.holds++
	}
	errs := make([]error, len(batch))
	for i, t := range batch {
		if s.fail.Load() && t.Kind != codec.KindDeadLetter {
			switch s.rng.IntN(8) {
			case 0:
				errs[i] = fmt.Errorf("no leader: %w", ErrUnavailable)
			case 1:
				errs[i] = errors.New("flaky broker")
			}
		}
	}
	s.mu.Unlock()
	if holdFor > 0 {
		s.holding.Add(1)
		select {
		case <-time.After(holdFor):
		case <-ctx.Done():
		}
		s.holding.Add(-1)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, t := range batch {
		if errs[i] != nil {
			continue
		}
		v := string(t.Value)
		s.acks[v] = append(s.acks[v], n)
		s.kinds[v] = t.Kind
	}
	return errs
}

// superseded: a version replaced or cancelled by an op that had returned
// when the sink's begun counter was at.
type superseded struct {
	value string
	at    int64
	how   string
}

// TestLaneStress runs concurrent ingest (schedules that replace each other
// across transports, source cancels) and admin cancels against a sink that
// holds Kafka batches past a small LaneGrace at random and fails some
// tasks, with a moving clock, a small horizon and one stop/Run again. Then
// it checks: no version acked twice; no replaced or cancelled version
// delivered by a Deliver call that began after the replace or cancel
// returned (its dead letter, made before, may go to the DLQ after); every
// id's last live version delivered (as a task or dead letter); nothing
// pending; store invariants.
func TestLaneStress(t *testing.T) {
	for seed := uint64(1); seed <= 3; seed++ {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			h := newHarness(t, func(o *Options) {
				o.Shards = 2
				o.FireBatch = 8
				o.Horizon = 2 * time.Second
				o.LaneGrace = 3 * time.Millisecond
				o.Retry = RetryPolicy{Initial: 20 * time.Millisecond, Max: 100 * time.Millisecond, MaxAttempts: 4}
				// Tasks waiting for an unavailable target: in memory
				// (seed 1), all held on disk (2), two in memory per
				// shard and the rest held (3), see hold.go.
				o.OutageMemory = []int{0, 0, -1, 2}[seed]
			})
			sink := &stressSink{rng: rand.New(rand.NewPCG(seed, 99)), acks: map[string][]int64{}, begins: map[string][]int64{}, kinds: map[string]codec.Kind{}}
			h.e.testHookBeginPublish = sink.begin
			sink.hold.Store(true)
			sink.fail.Store(true)
			var runMu sync.Mutex
			var runCancel context.CancelFunc
			var runDone chan error
			startRun := func() {
				ctx, cancel := context.WithCancel(context.Background())
				done := make(chan error, 1)
				go func() { done <- h.e.Run(ctx, sink) }()
				runMu.Lock()
				runCancel, runDone = cancel, done
				runMu.Unlock()
			}
			stopRun := func() {
				runMu.Lock()
				cancel, done := runCancel, runDone
				runMu.Unlock()
				cancel()
				if err := <-done; err != nil {
					t.Errorf("Run: %v", err)
				}
			}
			startRun()

			const writers, idsPer, ops = 4, 15, 400
			var supMu sync.Mutex
			var sups []superseded
			lives := make([]map[string]string, writers) // id -> live value
			var wg sync.WaitGroup
			for w := 0; w < writers; w++ {
				lives[w] = map[string]string{}
				wg.Add(1)
				go func() {
					defer wg.Done()
					rng := rand.New(rand.NewPCG(seed, uint64(w)))
					live := lives[w]
					off := int64(0)
					for op := 0; op < ops; op++ {
						id := fmt.Sprintf("w%d-k%d", w, rng.IntN(idsPer))
						off++
						now := h.clk.Now()
						stamp := ms(now) + 10_000_000 + off
						prev, had := live[id]
						var how string
						var err error
						switch r := rng.IntN(10); {
						case r < 7:
							tk := sched(id, now.Add(time.Duration(rng.IntN(300))*time.Millisecond), off)
							tk.Value = []byte(fmt.Sprintf("%s#%d", id, off))
							if rng.IntN(2) == 0 {
								tk.Transport, tk.Target = codec.TransportNATS, "orders.x"
							}
							if rng.IntN(2) == 0 {
								tk.DLQTransport, tk.DLQ = codec.TransportNATS, "dlq.x"
							}
							tk.Partition, tk.Stamp = int32(w), stamp
							err = h.e.Ingest(context.Background(), []codec.Task{tk}, nil)
							if err == nil {
								live[id] = string(tk.Value)
							}
							how = "replace"
						case r < 8:
							tk := cancelTask(id, off)
							tk.Partition, tk.Stamp = int32(w), stamp
							err = h.e.Ingest(context.Background(), []codec.Task{tk}, nil)
							if err == nil {
								delete(live, id)
							}
							how = "source cancel"
						default:
							err = h.e.Cancel("src", id)
							if errors.Is(err, ErrNotFound) {
								continue // delivered or dead-lettered already (checked at the end)
							}
							if err == nil {
								delete(live, id)
							}
							how = "admin cancel"
						}
						if err != nil {
							t.Errorf("%s %s: %v", how, id, err)
							return
						}
						if had {
							at := sink.begun.Load()
							supMu.Lock()
							sups = append(sups, superseded{prev, at, how})
							supMu.Unlock()
						}
						time.Sleep(time.Duration(rng.IntN(2000)) * time.Microsecond)
					}
				}()
			}
			stop := make(chan struct{})
			var restarts, parkedSeen atomic.Int32
			var clockWG sync.WaitGroup
			clockWG.Add(1)
			go func() {
				defer clockWG.Done()
				for i := 0; ; i++ {
					select {
					case <-stop:
						return
					default:
					}
					h.clk.Advance(5 * time.Millisecond)
					if n := h.e.parkedIn(codec.TransportKafka); n > 0 {
						parkedSeen.Add(1)
					}
					time.Sleep(500 * time.Microsecond)
					if i%400 == 399 { // stop while batches may be held, and Run again
						stopRun()
						startRun()
						restarts.Add(1)
					}
				}
			}()
			wg.Wait()
			close(stop)
			clockWG.Wait()

			// Drain: no more holds or failures; everything fires.
			sink.hold.Store(false)
			sink.fail.Store(false)
			deadline := time.Now().Add(30 * time.Second)
			for {
				h.clk.Advance(200 * time.Millisecond)
				time.Sleep(2 * time.Millisecond)
				if h.e.Stats().Pending == 0 && sink.holding.Load() == 0 {
					h.settle()
					if h.e.Stats().Pending == 0 {
						break
					}
				}
				if time.Now().After(deadline) {
					t.Fatalf("not drained: %+v", h.e.Stats())
				}
			}
			stopRun()

			sink.mu.Lock()
			defer sink.mu.Unlock()
			if n := sink.mixed.Load(); n != 0 {
				t.Errorf("%d batches mixed transports", n)
			}
			for v, at := range sink.acks {
				if len(at) > 1 {
					t.Errorf("%s acked %d times (calls %v)", v, len(at), at)
				}
			}
			for _, s := range sups {
				for _, n := range sink.begins[s.value] {
					if n > s.at {
						t.Errorf("%s handed to the sink by publish %d, begun after the %s that superseded it returned (publishes were at %d)", s.value, n, s.how, s.at)
					}
				}
			}
			for w := range lives {
				for id, v := range lives[w] {
					if len(sink.acks[v]) == 0 {
						t.Errorf("%s: live version %s never delivered", id, v)
					}
				}
			}
			checkStoreInvariants(t, h.e)
			h.checkPending()
			t.Logf("%d Deliver calls (%d held), %d versions acked, %d superseded, %d restarts, parked seen %d times", sink.calls.Load(), sink.holds, len(sink.acks), len(sups), restarts.Load(), parkedSeen.Load())
		})
	}
}
