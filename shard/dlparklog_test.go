package shard

import (
	"fmt"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/codec"
)

// parkedNow is how many dead letters the engine's shards hold parked.
func parkedNow(e *Engine) int {
	n := 0
	for _, s := range e.shards {
		s.mu.Lock()
		n += s.dlParked
		s.mu.Unlock()
	}
	return n
}

// TestDLQParkLinesThrottled: a DLQ that refuses every dead letter as the
// message it is (each too large for it) wrote one "dead letter parked"
// Error line per dead letter: 1000 lines for 1000 parks. Parks are
// logged once per DLQ episode with the first one's fields, then at most
// once per 30 s per DLQ with the parks held back, and the episode's end
// line gives their total. The parked dead letters themselves are as
// before: stored, counted, listed.
func TestDLQParkLinesThrottled(t *testing.T) {
	const n = 1000
	h, logs := dlqLogHarness(t, 0)
	refusal := fmt.Errorf("kafka: publish to \"dlq\": %w: MESSAGE_TOO_LARGE", ErrRefused)
	h.sink.setFail(func(t *codec.Task) error {
		if t.ID != "small" {
			return refusal
		}
		return nil
	})
	h.run()
	var dls []codec.Task
	for i := range n {
		dls = append(dls, deadLetter(fmt.Sprintf("big%04d", i), int64(i+1)))
	}
	h.ingest(dls)
	h.advanceUntil("every dead letter parked", func() bool { return parkedNow(h.e) == n })
	parks := logs.FilterMessageSnippet("dead letter parked").All()
	t.Logf("%d parks on one DLQ: %d park lines", n, len(parks))
	if len(parks) != 1 {
		t.Fatalf("%d park lines for %d parks of one DLQ within a few seconds; want 1 (then one per 30 s)", len(parks), n)
	}
	first := parks[0].ContextMap()
	for _, f := range []string{"dlq", "id", "origin", "code", "error"} {
		if _, ok := first[f]; !ok {
			t.Fatalf("first park line lacks %q: %v", f, first)
		}
	}
	// Later parks of the episode: one line per 30 s with those held back.
	h.ingest([]codec.Task{deadLetter("late1", n+1), deadLetter("late2", n+2)})
	h.advanceUntil("the late ones parked", func() bool { return parkedNow(h.e) == n+2 })
	if l := logs.FilterMessageSnippet("dead letter parked").Len(); l != len(parks) {
		t.Fatalf("%d park lines within 30 s of the first, want %d", l, len(parks))
	}
	h.ingest([]codec.Task{deadLetter("late3", n+3)})
	h.advanceUntil("the last one parked", func() bool { return parkedNow(h.e) == n+3 })
	for range 31 {
		h.advance(1e9)
	}
	h.ingest([]codec.Task{deadLetter("late4", n+4)})
	h.advanceUntil("a park 30 s on", func() bool { return parkedNow(h.e) == n+4 })
	all := logs.FilterMessageSnippet("dead letter parked").All()
	held := int64(0)
	for _, l := range all {
		if v, ok := l.ContextMap()["held_back"].(int64); ok {
			held += v
		}
	}
	if int(held)+len(all) != n+4 {
		t.Fatalf("%d park lines and %d held back, want %d parks in all", len(all), held, n+4)
	}
	// The DLQ takes a dead letter: the episode ends, with the total.
	h.ingest([]codec.Task{deadLetter("small", n+5)})
	h.advanceUntil("the end line", func() bool { return logs.FilterMessage(msgDLQRecovered).Len() == 1 })
	if m := logs.FilterMessage(msgDLQRecovered).All()[0].ContextMap(); m["parked"] != int64(n+4) {
		t.Fatalf("end line %v, want parked=%d", m, n+4)
	}
	if p := parkedNow(h.e); p != n+4 {
		t.Fatalf("%d parked after the end line, want %d (still stored, retried)", p, n+4)
	}
}

// TestUnparkLinesThrottled: a DLQ fixed after it refused many dead
// letters took them with an Info line each ("parked dead letter taken by
// its DLQ at last"): as many lines as parks. They are logged once per
// DLQ, then once per 30 s with those held back.
func TestUnparkLinesThrottled(t *testing.T) {
	const n = 200
	h, logs := dlqLogHarness(t, 0)
	refusal := fmt.Errorf("kafka: publish to \"dlq\": %w: MESSAGE_TOO_LARGE", ErrRefused)
	h.sink.setFail(func(*codec.Task) error { return refusal })
	h.run()
	var dls []codec.Task
	for i := range n {
		dls = append(dls, deadLetter(fmt.Sprintf("big%04d", i), int64(i+1)))
	}
	h.ingest(dls)
	h.advanceUntil("every dead letter parked", func() bool { return parkedNow(h.e) == n })
	h.sink.setFail(nil) // the DLQ's limit raised
	h.advanceUntil("every parked dead letter taken", func() bool { return parkedNow(h.e) == 0 })
	lines := logs.FilterMessage("parked dead letter taken by its DLQ at last").All()
	if len(lines) == 0 || len(lines) > 2 {
		t.Fatalf("%d parked dead letters taken by their DLQ: %d lines, want 1 (then one per 30 s)", n, len(lines))
	}
	if m := lines[0].ContextMap(); m["dlq"] == nil || m["origin"] == nil {
		t.Fatalf("first line lacks dlq or origin: %v", m)
	}
}

// dlqLogHarness is a harness whose dead letters park after parkPolicy's
// attempts, with shards shards (0: the default) and its log observed at
// Info: the set-up of the DLQ line tests.
func dlqLogHarness(t *testing.T, shards int) (*harness, *observer.ObservedLogs) {
	t.Helper()
	core, logs := observer.New(zap.InfoLevel)
	h := newHarness(t, func(o *Options) {
		if shards > 0 {
			o.Shards = shards
		}
		o.Retry = parkPolicy
		o.Logger = zap.New(core)
	})
	return h, logs
}
