package shard

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// slowKafkaSink holds every Kafka batch until the test lets it go (one
// token per batch).
type slowKafkaSink struct {
	*recSink
	entered chan int
	gate    chan struct{}
}

func (s *slowKafkaSink) Deliver(ctx context.Context, batch []*codec.Task) []error {
	if batch[0].Transport == codec.TransportKafka {
		s.entered <- len(batch)
		<-s.gate
	}
	return s.recSink.Deliver(ctx, batch)
}

// TestLaneStuckBacklogReadOncePerTask: a backlog of due Kafka tasks behind a
// Kafka target slower than LaneGrace (not hung: every batch returns) should
// cost each task a bounded number of store reads. With the change under
// review every stuck period claims, reads and sets aside the whole
// remaining backlog, and the return of the batch puts all of it back in
// the wheel to be read again: with N due tasks and batches of B that is
// about N*N/(2B) envelope reads.
func TestLaneStuckBacklogReadOncePerTask(t *testing.T) {
	const n, batch, rounds = 200, 8, 4
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.FireBatch = batch
		o.LaneGrace = 5 * time.Millisecond
	})
	var reads atomic.Int64
	h.e.testHookClaimRead = func(k int) { reads.Add(int64(k)) }
	var tasks []codec.Task
	for i := 0; i < n; i++ {
		tasks = append(tasks, sched(fmt.Sprint("k", i), t0, int64(i+1)))
	}
	h.ingest(tasks)
	sink := &slowKafkaSink{recSink: h.sink, entered: make(chan int, 1), gate: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.e.Run(ctx, sink) }()
	defer func() { cancel(); close(sink.gate); <-done }()

	for b := 0; b < rounds; b++ {
		<-sink.entered
		// Stuck: the loop goes on until every due task is claimed.
		eventuallyTrue(t, fmt.Sprintf("batch %d stuck, the backlog set aside", b), func() bool {
			s := h.e.shards[0]
			s.mu.Lock()
			empty := s.w.Len() == 0
			s.mu.Unlock()
			return empty && h.e.parkedIn(codec.TransportKafka) > 0
		})
		sink.gate <- struct{}{}
	}
	// Every task read once when set aside, and once more for the batch
	// that takes it: at most 2n, whatever the number of stuck periods.
	if r := reads.Load(); r > 2*n {
		t.Fatalf("%d slow Kafka batches of %d: the fire loop read %d envelopes for %d due tasks; the whole backlog is read again every stuck period", rounds, batch, r, n)
	}
}
