package shard

import (
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/internal/logthrottle"
)

// The lines of dlqLines.
const (
	msgDLQFailing   = "dead-letter delivery failing; retrying with backoff, nothing is dropped (a source partition does not commit past a dead letter of its own)"
	msgDLQRecovered = "dead-letter delivery recovered"
)

// dlqLines logs each DLQ's failures once per engine, not once per shard:
// each shard logged "dead-letter delivery failing" when a DLQ began to
// fail in it and "... recovered" when it stopped, so a DLQ that failed
// and came back wrote 2 lines per shard (16 with 8 shards) per flap
// (review R200, TestDLQFlapLinesOncePerEngine). A DLQ's first failure is
// logged at once, then one line per logthrottle.DefaultEvery (a new error
// text at once) with the lines held back and the shards affected; once
// every shard that failed for it delivered a dead letter to it again and
// has none of its dead letters failing (parked ones aside), one line says
// it recovered. A shard whose failures for a DLQ end in parking (the DLQ
// refused the message) is taken as recovered for it at its next delivery
// to it, not before: the DLQ has not taken anything from it yet.
type dlqLines struct {
	log *zap.Logger
	// active counts the DLQs failing: delivered, called for every DLQ a
	// round delivers dead letters to, looks at it only.
	active atomic.Int32
	mu     sync.Mutex
	conds  map[string]*dlqCond // by DLQ ("kafka:NAME", "nats:SUBJECT")
}

// dlqCond is one DLQ's failure under way.
type dlqCond struct {
	since time.Time
	thr   logthrottle.Throttle
	// failing: the shards that failed for it and have not delivered to it
	// since, with how many of their dead letters of it fail (not parked),
	// as each last said.
	failing  map[int]int
	affected map[int]bool // the shards that failed since it began
	failures int          // fire rounds that failed for it, all shards
	// text, key: the last failure's text and its throttle key, kept so
	// that the same failure round after round is not shaped again.
	text, key string
}

// failed logs (or counts) a fire round of shard in which dead letters of
// dest failed with err (the last one's) and after which n of them fail,
// at now (the engine clock).
func (l *dlqLines) failed(now time.Time, shard int, dest string, n int, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.conds == nil {
		l.conds = make(map[string]*dlqCond)
	}
	c := l.conds[dest]
	if c == nil {
		c = &dlqCond{since: now, failing: make(map[int]int), affected: make(map[int]bool)}
		l.conds[dest] = c
		l.active.Add(1)
	}
	c.failures++
	c.failing[shard], c.affected[shard] = n, true
	if text := err.Error(); text != c.text {
		c.text, c.key = text, logthrottle.Shape(text)
	}
	held, ok := c.thr.AllowKey(now, c.key)
	if !ok {
		return
	}
	if ce := l.log.Check(zap.ErrorLevel, msgDLQFailing); ce != nil {
		total := 0
		for _, k := range c.failing {
			total += k
		}
		f := []zap.Field{zap.Int("shard", shard), zap.String("dlq", dest), zap.Int("dead_letters", total),
			zap.Error(err), zap.Ints("shards_affected", sortedShards(c.affected))}
		if held > 0 {
			f = append(f, zap.Int("held_back", held))
		}
		ce.Write(f...)
	}
}

// delivered notes that shard delivered dead letters to dest in a fire
// round after which left of its dead letters of dest fail (not parked):
// with none left the shard no longer fails for dest, and the DLQ has
// recovered when no shard does.
func (l *dlqLines) delivered(now time.Time, shard int, dest string, left int) {
	if l.active.Load() == 0 {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	c := l.conds[dest]
	if c == nil {
		return
	}
	if _, ok := c.failing[shard]; !ok {
		return
	}
	if left > 0 {
		c.failing[shard] = left
		return
	}
	delete(c.failing, shard)
	if len(c.failing) > 0 {
		return
	}
	delete(l.conds, dest)
	l.active.Add(-1)
	l.log.Info(msgDLQRecovered, zap.String("dlq", dest), zap.Int("failures", c.failures),
		zap.Ints("shards_affected", sortedShards(c.affected)), zap.Duration("lasted", now.Sub(c.since)))
}

// dlqFailure is a DLQ that dead letters of a fire round failed for, with
// the last failure.
type dlqFailure struct {
	dest string
	err  error
}

// noteDLQ records err as dest's last failure in the round's list (a few
// DLQs at most: searched in turn).
func noteDLQ(fs []dlqFailure, dest string, err error) []dlqFailure {
	for i := range fs {
		if fs[i].dest == dest {
			fs[i].err = err
			return fs
		}
	}
	return append(fs, dlqFailure{dest, err})
}
