package shard

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/metrics"
)

// laneSink delivers NATS tasks at once and holds every Kafka batch until
// release is closed: a Kafka target that takes a produce and never
// answers. mixed counts batches that carried both transports (a lane
// hands the sink one transport at a time).
type laneSink struct {
	*recSink
	entered chan struct{}
	release chan struct{}
	mixed   atomic.Int32
}

func (s *laneSink) Deliver(ctx context.Context, batch []*codec.Task) []error {
	if slices.ContainsFunc(batch, func(t *codec.Task) bool { return t.Transport != batch[0].Transport }) {
		s.mixed.Add(1)
	}
	if batch[0].Transport == codec.TransportKafka {
		select {
		case s.entered <- struct{}{}:
		default:
		}
		<-s.release
	}
	return s.recSink.Deliver(ctx, batch)
}

// newLaneSink returns a laneSink over h's sink that holds Kafka batches
// until release is called (once; again it does nothing, so it may also be
// deferred).
func newLaneSink(h *harness) (sink *laneSink, release func()) {
	sink = &laneSink{recSink: h.sink, entered: make(chan struct{}, 1), release: make(chan struct{})}
	var once sync.Once
	return sink, func() { once.Do(func() { close(sink.release) }) }
}

func natsTask(id string, due time.Time, n int64) codec.Task {
	t := sched(id, due, n)
	t.Transport, t.Target = codec.TransportNATS, "orders.x"
	return t
}

// parkedIn counts the tasks set aside in the lanes of transport tr.
func (e *Engine) parkedIn(tr codec.Transport) int {
	n := 0
	for _, s := range e.shards {
		s.mu.Lock()
		n += len(s.lanes[transportSlot(tr)].parked)
		s.mu.Unlock()
	}
	return n
}

// eventuallyTrue polls cond (real time: the sink's hold is real) until it
// holds; the deadline only turns a hang into a failure.
func eventuallyTrue(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestLaneStuckTargetDoesNotHoldTheOther: a Kafka target that holds its
// produce delays only the Kafka tasks of the shard. Once the Kafka batch
// has been in the sink for LaneGrace, NATS tasks that fall due are
// delivered; Kafka tasks that fall due meanwhile wait aside (Stats counts
// them overdue), a cancel that meets one of them holds, and when the held
// produce returns every other Kafka task is delivered once.
func TestLaneStuckTargetDoesNotHoldTheOther(t *testing.T) {
	m := metrics.New(nil)
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.LaneGrace = 20 * time.Millisecond
		o.Metrics = m
	})
	sink, release := newLaneSink(h)
	defer release()
	h.ingest([]codec.Task{sched("k1", t0, 1), natsTask("n1", t0, 2),
		sched("k2", t0.Add(10*time.Second), 3), sched("k3", t0.Add(10*time.Second), 4),
		natsTask("n2", t0.Add(10*time.Second), 5)})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.e.Run(ctx, sink) }()
	defer func() { release(); cancel(); <-done }()

	<-sink.entered // k1 is held by the broker
	eventuallyTrue(t, "n1, due with k1", func() bool { return slices.Contains(h.sink.acked(), "n1") })
	h.clk.Advance(10 * time.Second)
	eventuallyTrue(t, "n2, due while k1 is held", func() bool { return slices.Contains(h.sink.acked(), "n2") })
	eventuallyTrue(t, "k2 and k3 set aside", func() bool {
		return h.e.parkedIn(codec.TransportKafka) == 2 && h.e.Stats().Pending == 3 // n2's delete durable
	})
	st := h.e.Stats()
	if !st.OldestOverdue.Equal(t0) || st.NextDue.After(t0.Add(10*time.Second)) || st.Pending != 3 {
		t.Fatalf("while k1 is held and k2, k3 wait: %+v; want oldest overdue %v (k1), next due by k2's, 3 pending", st, t0)
	}
	if err := h.e.Cancel("src", "k2"); err != nil {
		t.Fatalf("Cancel of a task set aside: %v", err)
	}
	if got := h.sink.acked(); !slices.Equal(got, []string{"n1", "n2"}) {
		t.Fatalf("delivered %v while the Kafka target holds its produce, want n1, n2", got)
	}

	release()
	eventuallyTrue(t, "k1 and k3", func() bool { return h.e.Stats().Pending == 0 })
	got := h.sink.acked()
	slices.Sort(got)
	if !slices.Equal(got, []string{"k1", "k3", "n1", "n2"}) {
		t.Fatalf("delivered %v, want k1, k3, n1, n2 once each (k2 was cancelled)", got)
	}
	if n := sink.mixed.Load(); n != 0 {
		t.Fatalf("%d batches carried both transports", n)
	}
	if c := testutil.ToFloat64(m.Cancelled.WithLabelValues("src")); c != 1 {
		t.Fatalf("cancelled_total = %v, want 1", c)
	}
	h.checkPending()
}

// TestLaneShutdownWhileStuck: Run stops while a lane is stuck and tasks
// wait aside: it returns once the held batch returns, and the tasks set
// aside are still pending, delivered by the next Run.
func TestLaneShutdownWhileStuck(t *testing.T) {
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.LaneGrace = 20 * time.Millisecond
	})
	sink := &laneSink{recSink: h.sink, entered: make(chan struct{}, 1), release: make(chan struct{})}
	h.ingest([]codec.Task{sched("k1", t0, 1), sched("k2", t0.Add(time.Second), 2)})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.e.Run(ctx, sink) }()
	<-sink.entered
	h.clk.Advance(time.Second)
	eventuallyTrue(t, "k2 set aside", func() bool { return h.e.parkedIn(codec.TransportKafka) == 1 })
	cancel()
	close(sink.release)
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	if got := h.sink.acked(); !slices.Equal(got, []string{"k1"}) {
		t.Fatalf("delivered %v by the stopped Run, want k1", got)
	}
	if p := h.e.Stats().Pending; p != 1 {
		t.Fatalf("pending %d after the stop, want 1 (k2)", p)
	}
	h.run() // a plain sink now
	if got := h.sink.acked(); !slices.Equal(got, []string{"k1", "k2"}) {
		t.Fatalf("delivered %v after Run again, want k1, k2", got)
	}
}

// TestCancelBetweenClaimAndPublish: a cancel that returns after its task
// was claimed but before its lane hands it to the sink (here: after the
// fire loop read the claimed envelopes) holds: the task is not
// published, and it is counted cancelled.
func TestCancelBetweenClaimAndPublish(t *testing.T) {
	m := metrics.New(nil)
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.Metrics = m
	})
	h.ingest([]codec.Task{sched("x", t0, 1)})
	var once atomic.Bool
	h.e.testHookClaimRead = func(int) {
		if once.CompareAndSwap(false, true) {
			if err := h.e.Cancel("src", "x"); err != nil {
				t.Errorf("Cancel while x is claimed: %v", err)
			}
		}
	}
	h.run()
	eventuallyTrue(t, "x gone", func() bool { return h.e.Stats().Pending == 0 })
	h.settle()
	if !once.Load() {
		t.Fatal("x was never claimed")
	}
	if got := h.sink.all(); len(got) != 0 {
		t.Fatalf("published %+v although its cancel returned before the publish began", got)
	}
	if c := testutil.ToFloat64(m.Cancelled.WithLabelValues("src")); c != 1 {
		t.Fatalf("cancelled_total = %v, want 1", c)
	}
	h.checkPending()
}
