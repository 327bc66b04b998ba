package shard

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/codec"
)

// slowPubSink is recSink whose publish of the task with id slowID takes
// took of the (fake) clock, as a real publish takes real time; the
// readiness seen at the start of each later publish of badID is kept.
type slowPubSink struct {
	*recSink
	h      *harness
	slowID string
	took   time.Duration
	badID  string
	mu     sync.Mutex
	slowed bool
	ready  []error // Engine.Err at each publish of badID after the slow one
}

func (s *slowPubSink) Deliver(ctx context.Context, batch []*codec.Task) []error {
	for _, t := range batch {
		s.mu.Lock()
		switch {
		case t.ID == s.slowID && !s.slowed:
			s.slowed = true
			s.mu.Unlock()
			s.h.clk.Advance(s.took)
			continue
		case t.ID == s.badID && s.slowed:
			s.mu.Unlock()
			err := s.h.e.outageErr()
			s.mu.Lock()
			s.ready = append(s.ready, err)
		}
		s.mu.Unlock()
	}
	return s.recSink.Deliver(ctx, batch)
}

// TestOutageNotEndedByPublishAcrossRetry: a target partly down (task bad
// always fails as unavailable, its retries at retry.max apart) stays one
// outage while tasks of it that did not wait are delivered. A publish of
// such a task that begins just before bad's retry is due and is
// acknowledged just after (a publish takes time; the lane holds bad's
// retry behind it) ends the outage: "reachable again", readiness ready,
// then "unreachable" again at bad's retry.
func TestOutageNotEndedByPublishAcrossRetry(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.Logger = zap.New(core)
		o.Retry = RetryPolicy{Initial: time.Second, Max: 4 * time.Second, Multiplier: 2, Jitter: -1, MaxAttempts: 3}
	})
	down := fmt.Errorf("NOT_LEADER_FOR_PARTITION: %w", ErrUnavailable)
	h.sink.setFail(func(t *codec.Task) error {
		if t.ID == "bad" {
			return down
		}
		return nil
	})
	sink := &slowPubSink{recSink: h.sink, h: h, slowID: "h", took: 1500 * time.Millisecond, badID: "bad"}
	h.ingest([]codec.Task{sched("bad", t0, 1)})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.e.Run(ctx, sink) }()
	defer func() { cancel(); <-done }()
	h.settle()
	// bad fails until its outage backoff is retry.max (4 s).
	for range 20 {
		h.advance(time.Second)
	}
	var lastFail time.Time
	for _, d := range h.sink.all() {
		if d.ID == "bad" && d.Err != nil {
			lastFail = d.At
		}
	}
	if lastFail.IsZero() {
		t.Fatal("bad never failed")
	}
	// The next retry of bad is at lastFail+4s. A task of the same target
	// that never waited, due 1 s before it, whose publish takes 1.5 s.
	h.set(lastFail.Add(3 * time.Second))
	h.ingest([]codec.Task{sched("h", lastFail.Add(2500*time.Millisecond), 2)})
	h.settle()
	h.advance(time.Second)
	h.advance(time.Second)
	warn := logs.FilterMessageSnippet("target broker unreachable").Len()
	info := logs.FilterMessageSnippet("target broker reachable again").Len()
	sink.mu.Lock()
	ready := append([]error(nil), sink.ready...)
	sink.mu.Unlock()
	t.Logf("%d Warn unreachable, %d Info reachable again; readiness at bad's retries after h: %v", warn, info, ready)
	if warn != 1 || info != 0 {
		t.Errorf("one partition down: %d Warn \"unreachable\", %d Info \"reachable again\", want 1 and 0", warn, info)
	}
	for i, err := range ready {
		if err == nil {
			t.Errorf("readiness at bad's retry %d after h: ready while bad waits for its partition", i+1)
		}
	}
}
