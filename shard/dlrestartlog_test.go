package shard

import (
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/logthrottle"
)

// TestDLQFailingAcrossRestart: a DLQ that failed before a restart and
// took its dead letters after it had no line in the new process: not
// failing (its dead letters were read at open with no DLQ known), so not
// recovered either. The engine logs at open, per DLQ, the dead letters
// that were failing at the restart, and their recovery once they go out.
func TestDLQFailingAcrossRestart(t *testing.T) {
	h, logs := dlqLogHarness(t, 2)
	var down atomic.Bool
	down.Store(true)
	h.sink.setFail(func(t *codec.Task) error {
		if down.Load() {
			return errors.New("kafka: publish to \"dlq\": TOPIC_AUTHORIZATION_FAILED")
		}
		return nil
	})
	h.run()
	h.ingest([]codec.Task{deadLetter("a", 1), deadLetter("b", 2), deadLetter("c", 3)})
	h.advanceUntil("the DLQ failing", func() bool { return dlqsFailing(h.e, "kafka:dlq") > 0 })
	h.stop()
	logs.TakeAll()
	h.reopen()
	open := logs.FilterMessage(msgDLQFailing).FilterField(zap.String("dlq", "kafka:dlq")).All()
	if len(open) != 1 {
		t.Fatalf("%d failing lines for the DLQ at open, want 1", len(open))
	}
	if m := open[0].ContextMap(); m["dead_letters"] != int64(3) || !strings.Contains(fmt.Sprint(m["error"]), "before the last restart") {
		t.Fatalf("failing line at open %v, want its 3 dead letters and the error before the restart", m)
	}
	down.Store(false)
	h.run()
	h.advanceUntil("all delivered", func() bool { return len(h.sink.acked()) == 3 })
	h.advance(dlqSettle)
	if n := logs.FilterMessage(msgDLQRecovered).FilterField(zap.String("dlq", "kafka:dlq")).Len(); n != 1 {
		t.Fatalf("%d recovered lines once the dead letters failing before the restart went out, want 1", n)
	}
}

// TestDLQFailureEndsWhenDropped: a DLQ failing as a whole whose failing
// dead letters were all dropped by an operator kept its failure open for
// good (no delivery came to end it). It ends, with a line that says they
// were dropped, not that the DLQ recovered.
func TestDLQFailureEndsWhenDropped(t *testing.T) {
	h, logs := dlqLogHarness(t, 1)
	h.sink.setFail(func(t *codec.Task) error {
		return errors.New("kafka: publish to \"dlq\": TOPIC_AUTHORIZATION_FAILED")
	})
	h.run()
	h.ingest([]codec.Task{deadLetter("a", 1), deadLetter("b", 2)})
	h.advanceUntil("the DLQ failing", func() bool { return dlqsFailing(h.e, "kafka:dlq") == 1 })
	s := h.e.shards[0]
	s.mu.Lock()
	var seqs []uint64
	for q := range s.dlFailing {
		seqs = append(seqs, q)
	}
	s.mu.Unlock()
	for _, q := range seqs {
		if err := h.e.DropStuck(0, q); err != nil {
			t.Fatal(err)
		}
	}
	h.settle()
	h.advance(dlqSettle)
	if n := logs.FilterMessage(msgDLQRecovered).Len(); n != 0 {
		t.Fatalf("recovered logged %d times for a DLQ that took nothing", n)
	}
	if n := logs.FilterMessage(msgDLQDropped).FilterField(zap.String("dlq", "kafka:dlq")).Len(); n != 1 {
		t.Fatalf("%d lines ending the failure of dropped dead letters, want 1", n)
	}
	if n := h.e.dlqLines.active.Load(); n != 0 {
		t.Fatalf("%d DLQ failures still under way", n)
	}
}

// TestDLQFailingAcrossRestartThrottled (review R211): a DLQ failing at a
// restart and still failing after it wrote two failing lines within a
// second: the one at open (its error "... before the last restart: X")
// and, at the first try after it, one for X, a new error text to the
// throttle. The line at open is throttled as X: the next comes 30 s on,
// with the failures held back.
func TestDLQFailingAcrossRestartThrottled(t *testing.T) {
	h, logs := dlqLogHarness(t, 2)
	h.sink.setFail(func(t *codec.Task) error {
		return errors.New("kafka: publish to \"dlq\": TOPIC_AUTHORIZATION_FAILED")
	})
	h.run()
	h.ingest([]codec.Task{deadLetter("a", 1), deadLetter("b", 2), deadLetter("c", 3)})
	h.advanceUntil("the DLQ failing", func() bool { return dlqsFailing(h.e, "kafka:dlq") > 0 })
	h.stop()
	logs.TakeAll()
	h.reopen()
	h.run()
	tries := len(h.sink.all())
	h.advanceUntil("tried again", func() bool { return len(h.sink.all()) > tries })
	h.advance(10 * time.Second)
	failing := logs.FilterMessage(msgDLQFailing).FilterField(zap.String("dlq", "kafka:dlq")).All()
	if len(failing) != 1 {
		t.Fatalf("%d failing lines within 10 s of a restart, the DLQ failing as before it, want 1 (at open)", len(failing))
	}
	h.advance(logthrottle.DefaultEvery)
	failing = logs.FilterMessage(msgDLQFailing).FilterField(zap.String("dlq", "kafka:dlq")).All()
	if len(failing) != 2 {
		t.Fatalf("%d failing lines %v after a restart, want 2", len(failing), logthrottle.DefaultEvery+10*time.Second)
	}
	if held, ok := failing[1].ContextMap()["held_back"].(int64); !ok || held == 0 {
		t.Fatalf("failing line 30 s on %v, want the failures held back since open", failing[1].ContextMap())
	}
}
