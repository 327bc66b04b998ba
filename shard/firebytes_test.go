package shard

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// batchSink is a recSink that also records each Deliver call's task
// bytes as taskCost counts them (value and headers standing in for the
// envelope).
type batchSink struct {
	*recSink
	mu      sync.Mutex
	batches []int
}

func (s *batchSink) Deliver(ctx context.Context, batch []*codec.Task) []error {
	n := 0
	for _, t := range batch {
		n += len(t.Value) + codec.HeaderMemory*len(t.Headers)
	}
	s.mu.Lock()
	s.batches = append(s.batches, n)
	s.mu.Unlock()
	return s.recSink.Deliver(ctx, batch)
}

// TestFireBatchBytesBounded: a fire round reads at most FireBatchBytes of
// tasks (and at least one, however large), so large messages due at once
// are published in several smaller batches, each task once.
func TestFireBatchBytesBounded(t *testing.T) {
	const budget = 64 << 10
	for _, tc := range []struct {
		name    string
		n, size int
		headers int
	}{
		{"16 KiB values", 40, 16 << 10, 0},
		{"one task over the budget", 3, 100 << 10, 0},
		{"many empty headers", 30, 16, 600}, // 24 KiB of headers each, 16 bytes of value
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, func(o *Options) { o.Shards = 1; o.FireBatchBytes = budget })
			bs := &batchSink{recSink: h.sink}
			ctx, cancel := context.WithCancel(context.Background())
			h.cancel, h.done = cancel, make(chan error, 1)
			go func() { h.done <- h.e.Run(ctx, bs) }()
			h.settle()
			due := t0.Add(time.Second)
			var batch []codec.Task
			var want []string
			for i := range tc.n {
				tk := sched(fmt.Sprint("big", i), due, int64(i+1))
				tk.Value = []byte(strings.Repeat("v", tc.size))
				for range tc.headers {
					tk.Headers = append(tk.Headers, codec.Header{})
				}
				batch = append(batch, tk)
				want = append(want, tk.ID)
			}
			h.ingest(batch)
			h.advance(time.Second)
			one := tc.size + codec.HeaderMemory*tc.headers
			bs.mu.Lock()
			batches := slices.Clone(bs.batches)
			bs.mu.Unlock()
			for _, b := range batches {
				// The budget is checked before each read: the last task
				// read may go over it by its own size.
				if b > max(budget-1+one, one) {
					t.Fatalf("a Deliver call of %d task bytes; the budget is %d, a task %d: %v", b, budget, one, batches)
				}
			}
			got := h.sink.acked()
			slices.Sort(got)
			slices.Sort(want)
			if !slices.Equal(got, want) {
				t.Fatalf("delivered %v, want each of %v once", got, want)
			}
			if len(batches) < tc.n*one/(budget+one) {
				t.Fatalf("%d batches for %d tasks of %d bytes", len(batches), tc.n, one)
			}
			h.checkPending()
		})
	}
}

func TestLogID(t *testing.T) {
	long := strings.Repeat("x", maxLogID+10)
	for _, tc := range []struct{ in, want string }{
		{"order-42", "order-42"},
		{long[:maxLogID], long[:maxLogID]},
		{long, long[:maxLogID] + "..."},
		// A cut inside a multi-byte rune moves back to its start.
		{long[:maxLogID-1] + "é" + "tail", long[:maxLogID-1] + "..."},
	} {
		if got := LogID(tc.in); got != tc.want {
			t.Errorf("LogID(%d bytes) = %q, want %q", len(tc.in), got, tc.want)
		}
	}
}
