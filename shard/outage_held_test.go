package shard

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// heldRetrySink refuses the first Kafka delivery as unavailable and holds
// every later one until release is closed: a target that refuses writes,
// then takes the retry's produce and does not answer.
type heldRetrySink struct {
	*recSink
	calls   atomic.Int32
	entered chan struct{}
	release chan struct{}
}

func (s *heldRetrySink) Deliver(ctx context.Context, batch []*codec.Task) []error {
	if s.calls.Add(1) > 1 {
		select {
		case s.entered <- struct{}{}:
		default:
		}
		<-s.release
	}
	return s.recSink.Deliver(ctx, batch)
}

// TestOutageNotStaleWhileRetryInSink: the outage of a Kafka target
// must stay reported while the retry of its waiting task is still in the
// sink: the task was not delivered, nothing "left the store some other way".
func TestOutageNotStaleWhileRetryInSink(t *testing.T) {
	down := fmt.Errorf("NOT_ENOUGH_REPLICAS: %w", ErrUnavailable)
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.LaneGrace = 20 * time.Millisecond
		o.Retry = RetryPolicy{Initial: time.Second, Max: 10 * time.Second, Multiplier: 2, Jitter: -1, MaxAttempts: 2}
	})
	h.sink.setFail(func(*codec.Task) error { return down })
	sink := &heldRetrySink{recSink: h.sink, entered: make(chan struct{}, 1), release: make(chan struct{})}
	h.ingest([]codec.Task{sched("x", t0, 1)})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.e.Run(ctx, sink) }()
	defer func() { close(sink.release); cancel(); <-done }()

	eventuallyTrue(t, "the first delivery refused", func() bool { return errors.Is(h.e.Err(), ErrUnavailable) })
	h.clk.Advance(time.Second) // the retry is due
	<-sink.entered             // and held by the broker
	h.clk.Advance(25 * time.Second)
	if st := h.e.Stats(); st.Pending != 1 {
		t.Fatalf("pending %d, want 1 (x)", st.Pending)
	}
	if err := h.e.Err(); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Err = %v while x's retry is still in the sink of the target that refused it; want the outage reported", err)
	}
}
