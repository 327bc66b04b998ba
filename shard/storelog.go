package shard

import (
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/delaybridge/delaybridge/internal/logthrottle"
)

// storeLines logs the store failures each shard meets on its own (a read
// failing on a bad disk, a commit refused) once per engine and condition,
// not once per shard and round: with 8 shards, a store refusing reads
// for 2 minutes wrote 957 "fire loop: store read failed" lines, about one
// per shard and second (TestStoreOutageLinesOncePerEngine). The first
// failure of a condition is logged at once, then one line per
// logthrottle.DefaultEvery (a new error text at once) with the lines held
// back and the shards affected; once every shard that failed has done the
// same work again without error, one line says the condition ended.
type storeLines struct {
	log *zap.Logger
	// active counts the conditions under way: ok, called on every round
	// of every fire loop, looks at it only.
	active atomic.Int32
	mu     sync.Mutex
	conds  map[string]*storeCond // by message
}

// The conditions, each logged by storeLines.
const (
	msgFireReadFailed   = "fire loop: store read failed"
	msgHeldReadFailed   = "fire loop: reading held tasks failed"
	msgFireCommitFailed = "fire: commit failed"
	msgSweepFailed      = "cancel-marker sweep failed"
	msgClearReadFailed  = "clearing fired-task tombstones skipped: reading the shard's first task failed"
	msgClearFailed      = "clearing fired-task tombstones failed"
	msgStatsReadFailed  = "stats: reading the store failed; reporting the next due and oldest overdue last read"
)

// storeCond is one condition (one message) under way.
type storeCond struct {
	episode
	failing map[int]bool // the shards whose last try failed
}

// episode is what storeLines and dlqLines keep of one condition under
// way across the shards: since when, the throttle of its lines, the
// shards it met and how often it failed.
type episode struct {
	since    time.Time
	thr      logthrottle.Throttle
	affected map[int]bool // the shards that failed since it began
	failures int
}

func newEpisode(now time.Time) episode {
	return episode{since: now, affected: make(map[int]bool)}
}

// fail counts shard's failure, throttled by key (the shape of its
// error): when it is to be logged, ok and the fields the line adds to
// its own (the shards affected, the lines held back).
func (c *episode) fail(now time.Time, shard int, key string) (fields []zap.Field, ok bool) {
	c.failures++
	c.affected[shard] = true
	held, ok := c.thr.AllowKey(now, key)
	if !ok {
		return nil, false
	}
	fields = []zap.Field{zap.Ints("shards_affected", sortedShards(c.affected))}
	if held > 0 {
		fields = append(fields, zap.Int("held_back", held))
	}
	return fields, true
}

// endFields are the fields of the line that says the condition ended at
// now.
func (c *episode) endFields(now time.Time) []zap.Field {
	return []zap.Field{zap.Int("failures", c.failures), zap.Ints("shards_affected", sortedShards(c.affected)),
		zap.Duration("lasted", now.Sub(c.since))}
}

// failed logs (or counts) shard's failure err of condition msg at level,
// at now (the engine clock).
func (l *storeLines) failed(now time.Time, level zapcore.Level, msg string, shard int, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.conds == nil {
		l.conds = make(map[string]*storeCond)
	}
	c := l.conds[msg]
	if c == nil {
		c = &storeCond{episode: newEpisode(now), failing: make(map[int]bool)}
		l.conds[msg] = c
		l.active.Add(1)
	}
	c.failing[shard] = true
	fields, ok := c.fail(now, shard, logthrottle.Shape(err.Error()))
	if !ok {
		return
	}
	if ce := l.log.Check(level, msg); ce != nil {
		ce.Write(append([]zap.Field{zap.Int("shard", shard), zap.Error(err)}, fields...)...)
	}
}

// ok notes that shard did the work of condition msg without error: the
// condition ends when no shard's last try failed.
func (l *storeLines) ok(now time.Time, msg string, shard int) {
	if l.active.Load() == 0 {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	c := l.conds[msg]
	if c == nil || !c.failing[shard] {
		return
	}
	delete(c.failing, shard)
	if len(c.failing) > 0 {
		return
	}
	delete(l.conds, msg)
	l.active.Add(-1)
	l.log.Info("store failure over: every shard that failed does it again without error",
		append([]zap.Field{zap.String("failure", msg)}, c.endFields(now)...)...)
}

func sortedShards(m map[int]bool) []int {
	out := make([]int, 0, len(m))
	for s := range m {
		out = append(out, s)
	}
	slices.Sort(out)
	return out
}
