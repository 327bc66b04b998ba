package kafka

import (
	"errors"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestRetryLogFlappingThrottled (review R210, failing: bridge/kafka is
// another helper's): since the end line resets the throttle (d8d0aa4), a
// partition that fails and goes on by turns (a store hovering at its
// free-space reserve, where each fire frees room for one batch; a leader
// flapping) logs its failure and its end at every turn: no throttle at
// all. Before d8d0aa4 the throttle held the failures to one per 30 s.
// A run of outages within one interval should cost a few lines, not two
// a turn.
func TestRetryLogFlappingThrottled(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	log := zap.New(core)
	now := time.Unix(1_000_000, 0)
	r := &retryLog{end: "batches stored again", now: func() time.Time { return now }}
	errFull := errors.New("store: volume low on space: 90 MiB free, reserve 100 MiB")
	const turns = 100 // one every 100 ms: 10 s, within one interval
	for range turns {
		r.failed(log, zapcore.WarnLevel, part{"delay", 0}, "handle failed; retrying the same batch", errFull)
		now = now.Add(50 * time.Millisecond)
		r.ok(log, part{"delay", 0}, true)
		now = now.Add(50 * time.Millisecond)
	}
	fails := logs.FilterMessage("handle failed; retrying the same batch").Len()
	ends := logs.FilterMessage("batches stored again").Len()
	if fails > 2 || ends > 2 {
		t.Fatalf("%d turns of fail and store again in %v: %d failure and %d end lines, want at most 2 of each", turns, turns*100*time.Millisecond, fails, ends)
	}
	// Each failure line has an end line after it: the partition is fine.
	open := false
	for _, l := range logs.All() {
		switch l.Message {
		case "handle failed; retrying the same batch":
			open = true
		case "batches stored again":
			open = false
		}
	}
	if open {
		t.Fatal("the last failure line has no end line after it, the partition storing again")
	}
}

// TestHandleFailOneLineAcrossTopics (review R210, failing: bridge/kafka
// is another helper's): ed6f5ac keys the retry lines per topic, the
// handler's too, but a handler that fails is the store (a failed fsync,
// the volume's reserve), one cause for every topic: a source of 10 delay
// topics logs 10 "handle failed" lines per 30 s where one says it all.
// Per topic suits what a topic can have on its own (a read ACL, a leader).
func TestHandleFailOneLineAcrossTopics(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	log := zap.New(core)
	now := time.Unix(1_000_000, 0)
	// The source's own handleFails, as NewSource sets it up.
	s, err := NewSource(testConfig(t, []string{"127.0.0.1:1"}, "g", "delay"))
	if err != nil {
		t.Fatal(err)
	}
	r := &s.handleFails
	r.now = func() time.Time { return now }
	errFull := errors.New("store: volume low on space: 90 MiB free, reserve 100 MiB")
	for i := range 10 {
		now = now.Add(100 * time.Millisecond)
		r.failed(log, zapcore.WarnLevel, part{"tenant" + string(rune('a'+i)) + "-delay", 0}, "handle failed; retrying the same batch", errFull)
	}
	if n := logs.FilterMessage("handle failed; retrying the same batch").Len(); n != 1 {
		t.Fatalf("the store refusing the batches of 10 topics: %d lines, want 1 (then one per 30 s)", n)
	}
	// Fetch failures stay per topic (a read ACL, a leader of one topic).
	for i := range 2 {
		s.retries.now = r.now
		s.retries.failed(log, zapcore.WarnLevel, part{"tenant" + string(rune('a'+i)) + "-delay", 0}, "fetch failed; retrying", errFull)
	}
	if n := logs.FilterMessage("fetch failed; retrying").Len(); n != 2 {
		t.Fatalf("two topics failing to fetch: %d lines, want 2 (one per topic)", n)
	}
}
