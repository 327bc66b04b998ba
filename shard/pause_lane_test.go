package shard

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// TestPauseFiringStuckDLQLane: while firing is paused, an awaited dead
// letter claimed while its DLQ's lane is stuck waits aside in the lane;
// once the lane's batch returns it must go out still during the pause, as
// the source that waits for it (and with it the end of the pause) cannot
// go on before.
func TestPauseFiringStuckDLQLane(t *testing.T) {
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.LaneGrace = 20 * time.Millisecond
	})
	sink, release := newLaneSink(h)
	defer release()
	h.ingest([]codec.Task{sched("stored", t0, 1)}) // overdue at start: waits for the pause
	h.e.PauseFiring()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.e.Run(ctx, sink) }()
	defer func() { release(); cancel(); <-done }()

	dl := func(n int) codec.Task {
		return codec.Task{Kind: codec.KindDeadLetter, ID: fmt.Sprintf("bad%d", n), Source: "src", Origin: fmt.Sprintf("kafka:src/0@%d", n),
			Transport: codec.TransportKafka, Target: "dlq", Code: codec.CodeBadDue, Detail: "nope"}
	}
	d1, err := h.e.IngestAwait(context.Background(), []codec.Task{dl(10)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	<-sink.entered // the DLQ broker holds bad10's produce: the lane goes stuck
	d2, err := h.e.IngestAwait(context.Background(), []codec.Task{dl(11)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	eventuallyTrue(t, "bad11 set aside behind the stuck lane", func() bool { return h.e.parkedIn(codec.TransportKafka) == 1 })
	release()

	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer wcancel()
	if err := d1.Wait(wctx); err != nil {
		t.Fatalf("bad10: %v", err)
	}
	if err := d2.Wait(wctx); err != nil {
		t.Fatalf("bad11, set aside while its lane was stuck, not delivered while firing is paused: %v (delivered %v)", err, h.sink.acked())
	}
	if !h.e.FiringPaused() {
		t.Fatal("not paused any more")
	}
	if got := h.sink.acked(); !slices.Equal(got, []string{"bad10", "bad11"}) {
		t.Fatalf("delivered %v while paused, want the two dead letters only", got)
	}
	h.e.ResumeFiring()
	eventuallyTrue(t, "stored delivered once resumed", func() bool { return slices.Contains(h.sink.acked(), "stored") })
}

// TestPauseParkDrainsAwaitedDeadLetter: an awaited dead letter whose batch
// becomes durable while a paused fire loop is between its decision to park
// and the park itself goes out at once. The park took the batch's wake-up
// as stale and drained the batch into the wheel, then slept until its
// wake time (a second on a real clock, never on this fake one): found as
// a one-in-a-few-hundred hang of TestPauseFiringStuckDLQLane.
func TestPauseParkDrainsAwaitedDeadLetter(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.Shards = 1 })
	h.e.PauseFiring()
	var dls atomic.Pointer[DeadLetters]
	var once sync.Once
	h.e.testHookPausedPark = func() {
		once.Do(func() {
			d, err := h.e.IngestAwait(context.Background(), []codec.Task{{Kind: codec.KindDeadLetter, ID: "bad", Source: "src",
				Origin: "kafka:src/0@1", Transport: codec.TransportKafka, Target: "dlq", Code: codec.CodeBadDue, Detail: "nope"}}, nil)
			if err != nil {
				t.Error(err)
				return
			}
			dls.Store(d)
		})
	}
	t.Cleanup(func() { h.stop(); h.e.testHookPausedPark = nil })
	h.run()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := dls.Load().Wait(ctx); err != nil {
		t.Fatalf("the awaited dead letter, durable while the paused loop went to park: %v (delivered %v)", err, h.sink.acked())
	}
}
