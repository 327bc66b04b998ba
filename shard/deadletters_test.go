package shard

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/metrics"
)

// IngestAwait's DeadLetters: done once the sink acknowledged every dead
// letter of the batch, not before; a batch without one needs no wait; a
// Wait that gives up stops watching its dead letters.
func TestIngestAwaitDeadLetters(t *testing.T) {
	dl := func(off int64) codec.Task {
		return codec.Task{Kind: codec.KindDeadLetter, ID: "bad", Source: "src", Origin: "kafka:src/0@" + strconv.FormatInt(off, 10),
			Transport: codec.TransportKafka, Target: "dlq", Code: codec.CodeBadDue, Detail: "nope"}
	}
	ctx := context.Background()

	t.Run("no dead letter", func(t *testing.T) {
		h := newHarness(t, nil)
		d, err := h.e.IngestAwait(ctx, []codec.Task{sched("a", t0.Add(time.Hour), 1)}, nil)
		if err != nil || d != nil || d.Len() != 0 {
			t.Fatalf("IngestAwait = %v, %v; want nil, nil", d, err)
		}
		if err := d.Wait(ctx); err != nil {
			t.Fatalf("Wait of nil = %v", err)
		}
	})

	t.Run("acknowledged", func(t *testing.T) {
		h := newHarness(t, nil)
		fail := errors.New("dlq down")
		h.sink.setFail(func(*codec.Task) error { return fail })
		h.run()
		d, err := h.e.IngestAwait(ctx, []codec.Task{dl(1), sched("a", t0.Add(time.Hour), 2), dl(3)}, nil)
		if err != nil || d.Len() != 2 {
			t.Fatalf("IngestAwait = %d dead letters, %v; want 2", d.Len(), err)
		}
		h.settle() // the first delivery failed
		short, cancel := context.WithCancel(ctx)
		cancel()
		if err := d.Wait(short); err == nil {
			t.Fatal("Wait returned nil while the sink refused the dead letters")
		}
		// The failed Wait stopped watching: a second batch's wait is
		// independent of it.
		d2, err := h.e.IngestAwait(ctx, []codec.Task{dl(4)}, nil)
		if err != nil {
			t.Fatal(err)
		}
		h.e.dl.mu.Lock()
		watched := len(h.e.dl.m)
		h.e.dl.mu.Unlock()
		if watched != 1 {
			t.Fatalf("%d dead letters watched, want 1 (the second batch's)", watched)
		}
		h.sink.setFail(nil)
		waited := make(chan error, 1)
		go func() { waited <- d2.Wait(ctx) }()
		for {
			select {
			case err := <-waited:
				if err != nil {
					t.Fatalf("Wait after the DLQ recovered = %v", err)
				}
				h.settle()
				if n := len(h.sink.acked()); n != 3 {
					t.Fatalf("%d dead letters acknowledged, want 3 (the given-up wait's too)", n)
				}
				return
			default:
				h.advance(time.Second) // the retry of the failed deliveries
			}
		}
	})
}

// A dead letter its DLQ refuses (a permanent error, not ErrUnavailable)
// every attempt of the retry policy is parked: the source's wait ends so
// the partition moves on (CONTRACT §3: one bad message never stalls its
// partition), the dead letter stays in the store and is retried, and the
// engine reports the failing DLQ until it takes it. A DLQ that is only
// unreachable parks nothing, however long it lasts.
func TestDeadLetterParked(t *testing.T) {
	ctx := context.Background()
	dl := codec.Task{Kind: codec.KindDeadLetter, ID: "bad", Source: "src", Origin: "kafka:src/0@1",
		Transport: codec.TransportKafka, Target: "dlq", Code: codec.CodeBadDue, Detail: "nope"}
	for _, tc := range []struct {
		name   string
		err    error
		parked bool
	}{
		{"refused", errors.New("message too large for the DLQ topic"), true},
		{"unreachable", fmt.Errorf("dial: connection refused: %w", ErrUnavailable), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := metrics.New(nil)
			h := newHarness(t, func(o *Options) {
				o.Retry = RetryPolicy{Initial: 100 * time.Millisecond, Max: time.Second, Multiplier: 2, Jitter: -1, MaxAttempts: 3}
				o.Metrics = m
			})
			h.sink.setFail(func(*codec.Task) error { return tc.err })
			h.run()
			d, err := h.e.IngestAwait(ctx, []codec.Task{dl}, nil)
			if err != nil || d.Len() != 1 {
				t.Fatalf("IngestAwait = %d dead letters, %v; want 1", d.Len(), err)
			}
			h.settle()
			for range 10 { // well past three attempts
				h.advance(time.Second)
			}
			short, cancel := context.WithCancel(ctx)
			cancel()
			werr := d.Wait(short)
			if tc.parked {
				if werr != nil || d.Parked() != 1 {
					t.Fatalf("Wait = %v, parked %d; want nil, 1", werr, d.Parked())
				}
			} else if werr == nil || d.Parked() != 0 {
				t.Fatalf("Wait = %v, parked %d; want the wait still on, nothing parked", werr, d.Parked())
			}
			if got := testutil.ToFloat64(m.DeadLettersParked); (got == 1) != tc.parked || got > 1 {
				t.Fatalf("parked counter %v", got)
			}
			if h.e.Err() == nil {
				t.Fatal("engine healthy while its DLQ fails")
			}
			if n := len(h.sink.acked()); n != 0 {
				t.Fatalf("%d acknowledged", n)
			}
			if p := h.e.Stats().Pending; p != 1 {
				t.Fatalf("%d pending, want the dead letter kept", p)
			}
			// The DLQ takes it at last: delivered, the engine healthy again.
			h.sink.setFail(nil)
			h.advance(2 * time.Second)
			if n := len(h.sink.acked()); n != 1 {
				t.Fatalf("%d acknowledged after the DLQ recovered, want 1", n)
			}
			if err := h.e.Err(); err != nil {
				t.Fatalf("Err after the DLQ recovered: %v", err)
			}
		})
	}
}
