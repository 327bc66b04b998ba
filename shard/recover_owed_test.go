package shard

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// blipSink fails the first batch after blip is set as a whole, as
// unavailable: a target that fails once right after it came back.
type blipSink struct {
	*recSink
	blip atomic.Bool
	down error
}

func (b *blipSink) Deliver(ctx context.Context, batch []*codec.Task) []error {
	if b.blip.CompareAndSwap(true, false) {
		errs := make([]error, len(batch))
		for i := range errs {
			errs[i] = b.down
		}
		return errs
	}
	return b.recSink.Deliver(ctx, batch)
}

// TestReleaseHeldBackBySpacingGoesWhenItEnds (hunt H175): a target back
// after a 10 min outage fails one batch right after the release (a
// broker's blip), which puts the group down with a wait before its next
// release (Retry.Initial), and is back for good at once: the next batches
// deliver, within the wait. Their release was refused as too soon and
// nothing asked again after the wait: the blip's tasks waited out their
// own backoff, 5 min, with the target back. The release goes when the
// wait ends.
func TestReleaseHeldBackBySpacingGoesWhenItEnds(t *testing.T) {
	h := newHarness(t, func(o *Options) {
		o.Shards = 1 // one lane: its batches' outcomes come in order
		o.FireBatch = 2
		o.Retry = RetryPolicy{Initial: 500 * time.Millisecond, Max: 5 * time.Minute, Multiplier: 2, Jitter: -1, MaxAttempts: 30}
	})
	down := fmt.Errorf("broker down: %w", ErrUnavailable)
	sink := &blipSink{recSink: h.sink, down: down}
	var releases atomic.Int32
	h.e.testHookRelease = func([]int64) {
		if releases.Add(1) == 1 {
			sink.blip.Store(true) // the batch after the release's
		}
	}
	h.sink.setFail(func(*codec.Task) error { return down })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.e.Run(ctx, sink) }()
	defer func() { cancel(); <-done }()
	h.settle()
	const n = 10
	var tasks []codec.Task
	for i := range n {
		tasks = append(tasks, sched(fmt.Sprintf("t%02d", i), t0, int64(i+1)))
	}
	h.ingest(tasks)
	for range 10 { // the outage
		h.advance(time.Minute)
	}
	if len(h.sink.acked()) != 0 {
		t.Fatal("delivered during the outage")
	}
	h.sink.setFail(nil)
	for len(h.sink.acked()) == 0 { // a retry finds it back
		h.advance(100 * time.Millisecond)
	}
	first := h.e.nowMs()
	if releases.Load() != 1 || sink.blip.Load() {
		t.Fatalf("%d releases, blip pending %v: the test did not exercise a release followed by a failure", releases.Load(), sink.blip.Load())
	}
	var last int64
	for range 40 { // 4 s
		h.advance(100 * time.Millisecond)
		if got := h.sink.acked(); len(got) == n {
			slices.Sort(got)
			if len(slices.Compact(got)) != n {
				t.Fatalf("a task delivered twice: %v", h.sink.acked())
			}
			last = h.e.nowMs()
			break
		}
	}
	if last == 0 {
		s := h.e.shards[0]
		s.mu.Lock()
		var left []string
		for seq, lt := range s.late {
			left = append(left, fmt.Sprintf("seq %d retry in %v", seq, time.Duration(lt.fire-h.e.nowMs())*time.Millisecond))
		}
		s.mu.Unlock()
		t.Fatalf("%d of %d delivered 4 s after the target was back for good (%d releases); waiting: %v", len(h.sink.acked()), n, releases.Load(), left)
	}
	t.Logf("all delivered %v after the first delivery, %d releases", time.Duration(last-first)*time.Millisecond, releases.Load())
}
