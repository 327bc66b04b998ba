package shard

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
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
