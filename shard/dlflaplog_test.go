package shard

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/codec"
)

// dlqsFailing is how many of the engine's shards have dead letters of
// dest failing (dlByDest).
func dlqsFailing(e *Engine, dest string) int {
	n := 0
	for _, s := range e.shards {
		s.mu.Lock()
		if _, ok := s.dlByDest[dest]; ok {
			n++
		}
		s.mu.Unlock()
	}
	return n
}

// settling is 1 if dest's failure is over and waits for dlqSettle to
// say so, else 0.
func settling(e *Engine, dest string) int {
	e.dlqLines.mu.Lock()
	defer e.dlqLines.mu.Unlock()
	if c := e.dlqLines.conds[dest]; c != nil && !c.healthy.IsZero() {
		return 1
	}
	return 0
}

// TestDLQFlapLinesOncePerEngine (review R200): "dead-letter delivery
// failing" and "... recovered" were logged by each shard on its own, so a
// DLQ that failed and came back wrote 2 lines per shard and flap: 80 lines
// for 5 flaps with 8 shards. A DLQ's failure is logged once per engine
// (then throttled, with the shards affected and the lines held back) and
// its recovery once, when every shard that failed for it delivered to it
// again: 2 lines a flap.
func TestDLQFlapLinesOncePerEngine(t *testing.T) {
	h, logs, fail := flappingDLQ(t, 8)
	h.run()
	const flaps = 5
	var failing, recovered []observer.LoggedEntry
	for f := range flaps {
		fail.Store(true)
		var dls []codec.Task
		for i := range 64 {
			dls = append(dls, deadLetter(fmt.Sprintf("f%d-%02d", f, i), int64(f*100+i+1)))
		}
		h.ingest(dls)
		h.advanceUntil("the DLQ failing in every shard", func() bool { return dlqsFailing(h.e, "kafka:dlq") == 8 })
		fail.Store(false)
		h.advanceUntil("the DLQ taking them again in every shard", func() bool { return dlqsFailing(h.e, "kafka:dlq") == 0 })
		h.advance(dlqSettle) // healthy long enough: each flap its own episode
		for _, l := range logs.TakeAll() {
			switch {
			case strings.HasPrefix(l.Message, "dead-letter delivery failing"):
				failing = append(failing, l)
			case strings.HasPrefix(l.Message, "dead-letter delivery recovered"):
				recovered = append(recovered, l)
			}
		}
	}
	t.Logf("%d flaps, 8 shards: %d failing lines, %d recovered lines (%.1f a flap)", flaps, len(failing), len(recovered), float64(len(failing)+len(recovered))/flaps)
	if len(failing) != flaps || len(recovered) != flaps {
		t.Fatalf("%d failing and %d recovered lines for %d flaps; want one of each a flap", len(failing), len(recovered), flaps)
	}
	for _, l := range append(failing, recovered...) {
		m := l.ContextMap()
		if m["dlq"] != "kafka:dlq" {
			t.Fatalf("%q names dlq %v", l.Message, m["dlq"])
		}
		if n := len(m["shards_affected"].([]interface{})); l.Level == zapcore.InfoLevel && n != 8 {
			t.Fatalf("recovered line: %d shards affected, want 8: %v", n, m)
		}
	}
}

// BenchmarkFailingDLQRound: one fire round (an op) of a shard whose 64
// dead letters fail, to dlqs DLQs, all failing (review R200: the round
// copied the shard's failing DLQs twice to compare them).
func BenchmarkFailingDLQRound(b *testing.B) {
	for _, dlqs := range []int{1, 64} {
		b.Run(fmt.Sprintf("dlqs=%d", dlqs), func(b *testing.B) {
			h := newHarness(b, func(o *Options) {
				o.Shards = 1
				o.FS = vfs.NewMem()
				o.Retry = RetryPolicy{Initial: 100 * time.Millisecond, Max: 100 * time.Millisecond, Multiplier: 2, Jitter: -1, MaxAttempts: 3}
				o.Logger = zap.NewNop()
			})
			h.sink.setFail(func(t *codec.Task) error { return errors.New("TOPIC_AUTHORIZATION_FAILED") })
			h.run()
			var dls []codec.Task
			for i := range 64 {
				d := deadLetter(fmt.Sprintf("d%02d", i), int64(i+1))
				d.Target = fmt.Sprintf("dlq%02d", i%dlqs)
				dls = append(dls, d)
			}
			h.ingest(dls)
			h.advance(200 * time.Millisecond)
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				h.advance(100 * time.Millisecond)
				h.sink.reset()
			}
		})
	}
}

// TestDLQRecoveredAfterPark (review R200): a shard skipped "dead-letter
// delivery recovered" for a DLQ in a round where one of its dead letters
// was parked, and the next round found the DLQ no longer failing in it,
// so a DLQ logged failing never logged its recovery, though it took the
// shard's next dead letters. The recovery is logged once the shard
// delivers to the DLQ again, and not when the refused one is parked.
func TestDLQRecoveredAfterPark(t *testing.T) {
	refusal := fmt.Errorf("kafka: publish to \"dlq\": %w: message too large", ErrRefused)
	for _, c := range []struct {
		name string
		// sameRound: the other dead letter fails while the refused one
		// is tried, and is taken in the round that parks it; otherwise
		// it comes after the park.
		sameRound bool
	}{{"later", false}, {"same round", true}} {
		t.Run(c.name, func(t *testing.T) {
			h, logs := dlqLogHarness(t, 1)
			var bigTries atomic.Int32
			h.sink.setFail(func(t *codec.Task) error {
				switch {
				case t.ID == "big":
					bigTries.Add(1)
					return refusal
				case t.ID == "small" && bigTries.Load() < int32(parkPolicy.MaxAttempts):
					return errors.New("TOPIC_AUTHORIZATION_FAILED")
				}
				return nil
			})
			h.run()
			count := func(msg string) int {
				return logs.FilterMessage(msg).FilterField(zap.String("dlq", "kafka:dlq")).Len()
			}
			if c.sameRound {
				h.ingest([]codec.Task{deadLetter("big", 1), deadLetter("small", 2)})
			} else {
				h.ingest([]codec.Task{deadLetter("big", 1)})
			}
			h.advanceUntil("the park", func() bool { return logs.FilterMessageSnippet("dead letter parked").Len() == 1 })
			if n := count(msgDLQFailing); n != 1 {
				t.Fatalf("%d failing lines, want 1", n)
			}
			if !c.sameRound {
				if n := count(msgDLQRecovered) + settling(h.e, "kafka:dlq"); n != 0 {
					t.Fatalf("recovered logged %d times after the park, before the DLQ took anything", n)
				}
				h.ingest([]codec.Task{deadLetter("small", 2)})
			}
			h.advanceUntil("small taken", func() bool { return slices.Contains(h.sink.acked(), "small") })
			if n := settling(h.e, "kafka:dlq"); n != 1 {
				t.Fatalf("recovery not under way once the DLQ took the next dead letter")
			}
			h.advance(dlqSettle)
			if n := count(msgDLQRecovered); n != 1 {
				t.Fatalf("recovered logged %d times once the DLQ took the next dead letter, want 1", n)
			}
		})
	}
}

// TestDLQFailingThrottled: a DLQ failing for 2 minutes in every shard is
// logged once, then once per 30 s with the lines held back, and a new
// error text at once.
func TestDLQFailingThrottled(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	h := newHarness(t, func(o *Options) {
		o.Shards = 8
		o.Retry = RetryPolicy{Initial: 100 * time.Millisecond, Max: time.Second, Multiplier: 2, Jitter: -1, MaxAttempts: 3}
		o.Logger = zap.New(core)
	})
	var why atomic.Value
	why.Store("TOPIC_AUTHORIZATION_FAILED")
	h.sink.setFail(func(t *codec.Task) error {
		return fmt.Errorf("publish to %q: %s", t.Target, why.Load())
	})
	h.run()
	var dls []codec.Task
	for i := range 64 {
		dls = append(dls, deadLetter(fmt.Sprintf("d%02d", i), int64(i+1)))
	}
	h.ingest(dls)
	for range 120 {
		h.advance(time.Second)
	}
	var lines []observer.LoggedEntry
	for _, l := range logs.TakeAll() {
		if l.Message == msgDLQFailing {
			lines = append(lines, l)
		}
	}
	heldBack := int64(0)
	for _, l := range lines {
		if n, ok := l.ContextMap()["held_back"].(int64); ok {
			heldBack += n
		}
	}
	t.Logf("2 min failing, 8 shards: %d lines, %d held back", len(lines), heldBack)
	if len(lines) < 2 || len(lines) > 5 || heldBack == 0 {
		t.Fatalf("%d lines, %d held back; want 1 at once, then one per 30 s with the lines held back", len(lines), heldBack)
	}
	if m := lines[len(lines)-1].ContextMap(); m["dead_letters"] != int64(64) || len(m["shards_affected"].([]interface{})) != 8 {
		t.Fatalf("last line %v, want the 64 dead letters of the 8 shards", m)
	}
	why.Store("UNKNOWN_TOPIC_OR_PARTITION")
	h.advance(time.Second)
	if l := logs.FilterMessage(msgDLQFailing).All(); len(l) != 1 {
		for _, l := range l {
			t.Log(l.ContextMap())
		}
		t.Fatalf("%d lines for a new error text within 30 s of the last, want 1", len(l))
	}
	if n := logs.FilterMessage(msgDLQRecovered).Len(); n != 0 {
		t.Fatalf("recovered logged %d times while failing", n)
	}
}

// TestDLQRecoveredAcrossShards: a DLQ fails in two shards and comes back;
// one shard delivers to it again, the other's failing dead letter is
// parked (refused as the message it is) or dropped by an operator rather
// than delivered. The DLQ recovered then: it took a dead letter after its
// last failure and no shard has one of its dead letters failing. Waiting
// for each shard to deliver to it again left the DLQ failing in the log
// for good when no other dead letter of that shard came.
func TestDLQRecoveredAcrossShards(t *testing.T) {
	refusal := fmt.Errorf("kafka: publish to \"dlq\": %w: message too large", ErrRefused)
	// dead letters in shard 0 and shard 1 of 2 (by their origin)
	ids := [2]string{"d0", "d1"}
	var origin [2]int64
	for n := int64(1); origin[0] == 0 || origin[1] == 0; n++ {
		if k := shardOfN("src", deadLetter("", n).Origin, 2); origin[k] == 0 {
			origin[k] = n
		}
	}
	for _, how := range []string{"parked", "dropped"} {
		t.Run(how, func(t *testing.T) {
			h, logs := dlqLogHarness(t, 2)
			var down atomic.Bool
			down.Store(true)
			h.sink.setFail(func(t *codec.Task) error {
				switch {
				case t.ID == ids[0] && how == "parked":
					return refusal
				case down.Load():
					return errors.New("TOPIC_AUTHORIZATION_FAILED")
				}
				return nil
			})
			h.run()
			h.ingest([]codec.Task{deadLetter(ids[0], origin[0]), deadLetter(ids[1], origin[1])})
			h.advanceUntil("the DLQ failing in both shards", func() bool { return dlqsFailing(h.e, "kafka:dlq") == 2 })
			count := func(msg string) int { return logs.FilterMessage(msg).FilterField(zap.String("dlq", "kafka:dlq")).Len() }
			if how == "dropped" {
				s := h.e.shards[0]
				s.mu.Lock()
				var seq uint64
				for q := range s.dlFailing {
					seq = q
				}
				s.mu.Unlock()
				if err := h.e.DropStuck(0, seq); err != nil {
					t.Fatal(err)
				}
				h.settle()
			}
			down.Store(false)
			h.advanceUntil("shard 1's dead letter taken", func() bool { return slices.Contains(h.sink.acked(), ids[1]) })
			if how == "parked" {
				if n := count(msgDLQRecovered) + settling(h.e, "kafka:dlq"); n != 0 {
					t.Fatalf("recovered logged %d times while shard 0's dead letter still fails", n)
				}
				h.advanceUntil("the park", func() bool { return logs.FilterMessageSnippet("dead letter parked").Len() == 1 })
			}
			h.settle()
			h.advance(dlqSettle)
			if n := count(msgDLQRecovered); n != 1 {
				t.Fatalf("recovered logged %d times, want 1", n)
			}
			// Parked: the refusal and the other failure, each error text
			// once.
			if n, want := count(msgDLQFailing), map[string]int{"parked": 2, "dropped": 1}[how]; n != want {
				t.Fatalf("failing logged %d times, want %d", n, want)
			}
		})
	}
}

// TestDLQFlapsFolded: a DLQ flapping every second (1 s down, 1 s up)
// wrote a failing and a recovered line per flap: 40 lines for 20 flaps.
// Its recovery is logged once it stayed healthy for dlqSettle, and a
// failure within that time is the same episode (its failing lines
// throttled), counted in the recovered line's flaps.
func TestDLQFlapsFolded(t *testing.T) {
	h, logs, fail := flappingDLQ(t, 2)
	h.run()
	const flaps = 20
	for f := range flaps {
		start := h.clk.Now()
		fail.Store(true)
		h.ingest([]codec.Task{deadLetter(fmt.Sprintf("f%d", f), int64(f+1))})
		h.advanceUntil("the DLQ failing", func() bool { return dlqsFailing(h.e, "kafka:dlq") == 1 })
		h.advance(start.Add(time.Second).Sub(h.clk.Now()))
		fail.Store(false)
		h.advanceUntil("the DLQ taking it", func() bool { return dlqsFailing(h.e, "kafka:dlq") == 0 })
		h.advance(start.Add(2 * time.Second).Sub(h.clk.Now()))
	}
	h.advance(dlqSettle)
	failing, recovered := logs.FilterMessage(msgDLQFailing).All(), logs.FilterMessage(msgDLQRecovered).All()
	t.Logf("%d flaps of 1 s down, 1 s up: %d failing lines, %d recovered lines", flaps, len(failing), len(recovered))
	// The first failure, then one line 30 s on (the flaps last 40 s)
	// with those held back; one recovered line.
	if len(recovered) != 1 || len(failing) != 2 {
		t.Fatalf("%d failing and %d recovered lines for %d flaps within %v of each other; want 2 and 1: one episode", len(failing), len(recovered), flaps, dlqSettle)
	}
	if held, ok := failing[1].ContextMap()["held_back"].(int64); !ok || held == 0 {
		t.Fatalf("second failing line %v, want the failures held back since the first", failing[1].ContextMap())
	}
	if m := recovered[0].ContextMap(); m["flaps"] != int64(flaps-1) || m["failures"].(int64) < flaps {
		t.Fatalf("recovered line %v, want flaps=%d and every failure counted", m, flaps-1)
	}
}

// flappingDLQ is a harness of shards shards whose dead letters are
// retried every 100 ms and whose DLQ refuses them as unauthorized while
// fail is set, with its log observed at Info: the set-up of the flap
// tests.
func flappingDLQ(t *testing.T, shards int) (*harness, *observer.ObservedLogs, *atomic.Bool) {
	t.Helper()
	core, logs := observer.New(zap.InfoLevel)
	h := newHarness(t, func(o *Options) {
		o.Shards = shards
		o.Retry = RetryPolicy{Initial: 100 * time.Millisecond, Max: 100 * time.Millisecond, Multiplier: 2, Jitter: -1, MaxAttempts: 3}
		o.Logger = zap.New(core)
	})
	fail := new(atomic.Bool)
	h.sink.setFail(func(t *codec.Task) error {
		if t.Kind == codec.KindDeadLetter && fail.Load() {
			return fmt.Errorf("publish to %q: %w", t.Target, errors.New("TOPIC_AUTHORIZATION_FAILED"))
		}
		return nil
	})
	return h, logs, fail
}
