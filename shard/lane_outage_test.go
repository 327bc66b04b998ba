package shard

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// gatedDownKafkaSink answers every Kafka batch, when the test lets it,
// with a connection failure (ErrUnavailable): a Kafka that is down fails
// each batch quickly, well within LaneGrace. NATS batches deliver.
type gatedDownKafkaSink struct {
	*recSink
	entered chan struct{}
	gate    chan struct{}
}

func (s *gatedDownKafkaSink) Deliver(ctx context.Context, batch []*codec.Task) []error {
	if batch[0].Transport == codec.TransportKafka {
		s.entered <- struct{}{}
		<-s.gate
		errs := make([]error, len(batch))
		for i := range errs {
			errs[i] = fmt.Errorf("dial tcp: connection refused: %w", ErrUnavailable)
		}
		return errs
	}
	return s.recSink.Deliver(ctx, batch)
}

// TestKafkaOutageLaneDoesNotGateNATS: while Kafka is down (its last batch
// failed as unavailable), the loop does not wait for the Kafka lane's
// next batch before it claims again: a due NATS task behind a Kafka
// backlog is delivered while that batch is still in the sink. Before, a
// lane was passed by only once stuck for LaneGrace, and a down broker
// fails each batch well within it (kafka-go: about 55 ms), so every round
// waited for one failing Kafka batch and the NATS task waited backlog /
// FireBatch of them (13.7 s for 2000 tasks in batches of 8).
func TestKafkaOutageLaneDoesNotGateNATS(t *testing.T) {
	const kafkaTasks, batch = 2000, 8
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.FireBatch = batch
		o.LaneGrace = time.Hour // every failing Kafka batch returns within the grace
		o.Retry = RetryPolicy{Initial: 500 * time.Millisecond, Max: 5 * time.Minute, Multiplier: 2, Jitter: -1, MaxAttempts: 10}
	})
	var tasks []codec.Task
	for i := 0; i < kafkaTasks; i++ {
		tasks = append(tasks, sched(fmt.Sprint("k", i), t0, int64(i+1)))
	}
	tasks = append(tasks, natsTask("n1", t0, kafkaTasks+1))
	h.ingest(tasks)
	sink := &gatedDownKafkaSink{recSink: h.sink, entered: make(chan struct{}), gate: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.e.Run(ctx, sink) }()
	defer func() {
		cancel()
		close(sink.gate)
		for {
			select {
			case <-sink.entered:
			case <-done:
				return
			}
		}
	}()
	<-sink.entered
	sink.gate <- struct{}{} // the first Kafka batch fails: Kafka is down
	<-sink.entered          // the second is in the sink (held)
	deadline := time.Now().Add(5 * time.Second)
	for !slices.Contains(h.sink.acked(), "n1") {
		if time.Now().After(deadline) {
			t.Fatalf("NATS task n1 (due) not delivered while a Kafka batch of a known Kafka outage is in the sink; %d Kafka tasks parked: the fire loop waits for the down lane every round", h.e.parkedIn(codec.TransportKafka))
		}
		time.Sleep(time.Millisecond)
	}
}
