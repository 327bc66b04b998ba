package shard

import (
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/codec"
)

// TestSecondFailingDLQLogged (hunt H204): "dead-letter delivery failing"
// was logged when a shard's failing dead letters went from none to some,
// whatever their DLQ, naming the batch's first error only. A second DLQ
// that began to fail while the first still failed in every shard (the
// NATS DLQ stream full for an hour, then the Kafka DLQ's ACL removed) was
// never logged: the log said why only for the first (CONTRACT §3 asks it
// to say why). Each DLQ is logged (naming it) when it begins to fail in a
// shard, and its recovery when it stops.
func TestSecondFailingDLQLogged(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	h := newHarness(t, func(o *Options) {
		o.Retry = RetryPolicy{Initial: 100 * time.Millisecond, Max: 100 * time.Millisecond, Multiplier: 2, Jitter: -1, MaxAttempts: 3}
		o.Logger = zap.New(core)
	})
	var failA, failB atomic.Bool
	failA.Store(true)
	failB.Store(true)
	h.sink.setFail(func(t *codec.Task) error {
		switch {
		case t.Target == "dlqa" && failA.Load():
			return fmt.Errorf("publish to %q: %w", t.Target, errors.New("maximum messages exceeded"))
		case t.Target == "dlqb" && failB.Load():
			return fmt.Errorf("publish to %q: %w", t.Target, errors.New("TOPIC_AUTHORIZATION_FAILED"))
		}
		return nil
	})
	h.run()
	dl := func(target string, n int) []codec.Task {
		var out []codec.Task
		for i := range n {
			d := deadLetter(fmt.Sprintf("%s-%d", target, i), int64(i+1))
			d.Target = target
			out = append(out, d)
		}
		return out
	}
	failing := func(dest string) bool {
		for _, s := range h.e.shards {
			s.mu.Lock()
			_, ok := s.dlByDest[dest]
			s.mu.Unlock()
			if !ok {
				return false
			}
		}
		return true
	}
	h.ingest(dl("dlqa", 64))
	h.advanceUntil("the first DLQ failing in every shard", func() bool { return failing("kafka:dlqa") })
	h.ingest(dl("dlqb", 64))
	h.advanceUntil("the second DLQ failing in every shard", func() bool { return failing("kafka:dlqb") })
	named := func(level zapcore.Level, msg, what string) int {
		n := 0
		for _, l := range logs.FilterLevelExact(level).FilterMessageSnippet(msg).All() {
			m := l.ContextMap()
			if strings.Contains(fmt.Sprint(m["dlq"], m["error"]), what) {
				n++
			}
		}
		return n
	}
	if n := named(zapcore.ErrorLevel, "dead-letter delivery failing", "dlqa"); n == 0 {
		t.Fatal("the first failing DLQ not logged")
	}
	if n := named(zapcore.ErrorLevel, "dead-letter delivery failing", "dlqb"); n == 0 {
		t.Fatal("the DLQ that began to fail while another failed in every shard was not logged")
	}
	failB.Store(false)
	h.advanceUntil("the second DLQ's dead letters delivered", func() bool { return !failing("kafka:dlqb") && h.sink.deliveriesOf("dlqb-0") > 1 })
	h.advanceUntil("its recovery logged", func() bool { return named(zapcore.InfoLevel, "dead-letter delivery recovered", "dlqb") > 0 })
	if n := named(zapcore.InfoLevel, "dead-letter delivery recovered", "dlqa"); n != 0 {
		t.Fatalf("the DLQ still failing logged recovered %d times", n)
	}
}
