package shard

import (
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/logthrottle"
)

// The lines of dlqLines.
const (
	msgDLQFailing   = "dead-letter delivery failing; retrying with backoff, nothing is dropped (a source partition does not commit past a dead letter of its own)"
	msgDLQRecovered = "dead-letter delivery recovered"
	msgDLQDropped   = "dead-letter delivery failure over: its failing dead letters were dropped (or parked), none reached the DLQ since it last failed"
	msgDLQParked    = "dead letter parked: its DLQ refused it as this message at the last attempt of the retry policy; its source commits past it, it stays in the store and is retried with backoff until the DLQ takes it"
)

// dlqLines logs each DLQ's failures once per engine, not once per shard:
// each shard logged "dead-letter delivery failing" when a DLQ began to
// fail in it and "... recovered" when it stopped, so a DLQ that failed
// and came back wrote 2 lines per shard (16 with 8 shards) per flap
// (review R200, TestDLQFlapLinesOncePerEngine). A DLQ's first failure is
// logged at once, then one line per logthrottle.DefaultEvery (a new error
// text at once) with the lines held back and the shards affected. One
// line says it recovered once it took a dead letter after it last failed
// as a whole and no shard has any of its dead letters failing: each shard
// that failed for it delivered to it again, or had its failing ones
// parked (refused as the message they are, reported on their own) or
// dropped. A shard skipped "recovered" in a round that parked one of the
// DLQ's dead letters, and the next round no longer found the DLQ failing
// in it, so the DLQ never logged its recovery (TestDLQRecoveredAfterPark).
// The recovered line waits until the DLQ stayed so for dlqSettle; a
// failure whose failing dead letters were dropped, none delivered, ends
// at once with its own line (msgDLQDropped); parks are throttled per DLQ
// (parked); dead letters failing at a restart are logged at open
// (restored).
type dlqLines struct {
	log *zap.Logger
	// wake wakes a fire loop, to end an episode at settleAt (settle).
	wake func()
	// settleAt: the earliest end of a recovered DLQ's settle time (ms rounded up,
	// engine clock; 0 with none): the fire loops wake for it and call
	// settle.
	settleAt atomic.Int64
	// active counts the DLQs failing: delivered and cleared, called for
	// every DLQ a round delivers dead letters to or a shard stops failing
	// for, look at it only.
	active atomic.Int32
	mu     sync.Mutex
	conds  map[string]*dlqCond // by DLQ ("kafka:NAME", "nats:SUBJECT")
}

// dlqCond is one DLQ's failure under way.
type dlqCond struct {
	episode // failures: the fire rounds that failed for it, all shards
	// failing: the shards that failed for it and still have dead letters
	// of it failing (not parked), with how many as each last said.
	failing map[int]int
	// delivered: the DLQ took a dead letter since it last failed as a
	// whole (a refusal of one message, ErrRefused, says nothing of the
	// others).
	delivered bool
	// text, key: the last failure's text and its throttle key, kept so
	// that the same failure round after round is not shaped again.
	text, key string
	// parks: the DLQ's dead letters parked in the episode, all shards;
	// parkThr throttles their lines (parked).
	parks   int
	parkThr logthrottle.Throttle
	// healthy: when the DLQ last met the end of its failure (it took a
	// dead letter, none of its dead letters fail), zero while it fails;
	// the episode ends dlqSettle later unless it fails again meanwhile,
	// a flap, counted in flaps.
	healthy time.Time
	flaps   int
	// dropped: some of its failing dead letters left the store (an
	// operator dropped them): with none failing and no delivery, the
	// failure ends, saying so.
	dropped bool
}

// dlqSettle is how long a DLQ that recovered must stay so before its
// recovered line: a DLQ flapping every few seconds wrote a failing and a
// recovered line per flap, 40 lines for 20 flaps of 1 s down and 1 s up
// (TestDLQFlapsFolded). A failure within it is the same episode (its
// line throttled as any), counted as a flap in the recovered line.
const dlqSettle = 10 * time.Second

// condLocked is dest's failure under way, begun at now if there is none.
func (l *dlqLines) condLocked(now time.Time, dest string) *dlqCond {
	if l.conds == nil {
		l.conds = make(map[string]*dlqCond)
	}
	c := l.conds[dest]
	if c == nil {
		c = &dlqCond{episode: newEpisode(now), failing: make(map[int]int)}
		l.conds[dest] = c
		l.active.Add(1)
	}
	return c
}

// failed logs (or counts) f, the failures of dest's dead letters in a
// fire round of shard after which n of them fail, at now (the engine
// clock).
func (l *dlqLines) failed(now time.Time, shard int, f dlqFailure, n int) {
	dest, err := f.dest, f.err
	l.mu.Lock()
	defer l.mu.Unlock()
	c := l.condLocked(now, dest)
	if !c.healthy.IsZero() {
		c.healthy = time.Time{}
		c.flaps++
	}
	c.failing[shard] = n
	if f.whole {
		c.delivered = false
	}
	if text := err.Error(); text != c.text {
		c.text, c.key = text, logthrottle.Shape(text)
	}
	fields, ok := c.fail(now, shard, c.key)
	if !ok {
		return
	}
	if ce := l.log.Check(zap.ErrorLevel, msgDLQFailing); ce != nil {
		total := 0
		for _, k := range c.failing {
			total += k
		}
		ce.Write(append([]zap.Field{zap.Int("shard", shard), zap.String("dlq", dest), zap.Int("dead_letters", total), zap.Error(err)}, fields...)...)
	}
}

// parked logs (or counts) the park of shard's dead letter t, refused by
// its DLQ with err, at now. A DLQ that refuses every dead letter (each
// too large for it) parked them one by one, each with its own Error line:
// 1000 lines for 1000 dead letters (TestDLQParkLinesThrottled). The
// first park of the DLQ's episode is logged with its fields, then one
// line per logthrottle.DefaultEvery with the parks held back; the line
// that ends the episode gives their total. A park begins an episode if
// none is under way (it ends as any: once the DLQ takes a dead letter and
// none of its dead letters fail).
func (l *dlqLines) parked(now time.Time, shard int, t *codec.Task, err error) {
	dest := t.Destination()
	l.mu.Lock()
	defer l.mu.Unlock()
	c := l.condLocked(now, dest)
	c.parks++
	held, ok := c.parkThr.AllowEach(now, "")
	if !ok {
		return
	}
	if ce := l.log.Check(zap.ErrorLevel, msgDLQParked); ce != nil {
		fields := []zap.Field{zap.Int("shard", shard), zap.String("source", t.Source), zap.String("dlq", dest),
			zap.String("id", LogID(t.ID)), zap.String("origin", t.Origin), zap.String("code", string(t.Code)),
			zap.Uint32("attempts", t.Attempts), zap.Error(err), zap.Int("parked", c.parks)}
		if held > 0 {
			fields = append(fields, zap.Int("held_back", held))
		}
		ce.Write(fields...)
	}
}

// delivered notes that shard delivered dead letters to dest in a fire
// round after which left of its dead letters of dest fail (not parked):
// with none left the shard no longer fails for dest.
func (l *dlqLines) delivered(now time.Time, shard int, dest string, left int) {
	l.withCond(dest, func(c *dlqCond) {
		c.delivered = true
		if _, ok := c.failing[shard]; ok {
			if left > 0 {
				c.failing[shard] = left
				return
			}
			delete(c.failing, shard)
		}
		l.overLocked(now, dest, c)
	})
}

// withCond calls f, under l.mu, with dest's failure if one is under way
// (one atomic load while none is).
func (l *dlqLines) withCond(dest string, f func(c *dlqCond)) {
	if l.active.Load() == 0 {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if c := l.conds[dest]; c != nil {
		f(c)
	}
}

// restored begins dest's failure at open with failing, the dead letters
// of each shard that were failing at the last restart, the last with err,
// and logs it.
func (l *dlqLines) restored(now time.Time, dest string, failing map[int]int, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	c := l.condLocked(now, dest)
	total, first := 0, -1
	for shard, n := range failing {
		c.failing[shard] = n
		c.affected[shard] = true
		total += n
		if first < 0 || shard < first {
			first = shard
		}
	}
	// Throttled as the failure recorded, not as its text at open: the
	// DLQ still failing after the restart wrote a second line at its
	// first try, its error text being new
	// (TestDLQFailingAcrossRestartThrottled).
	c.text = dlFailedText(err.Error())
	c.key = logthrottle.Shape(c.text)
	fields, ok := c.fail(now, first, c.key)
	if !ok {
		return
	}
	if ce := l.log.Check(zap.ErrorLevel, msgDLQFailing); ce != nil {
		ce.Write(append([]zap.Field{zap.String("dlq", dest), zap.Int("dead_letters", total), zap.Error(err)}, fields...)...)
	}
}

// cleared notes that shard has no dead letter of dest failing any more
// (parked ones aside): its last one was acknowledged, parked or dropped
// (gone: one left the store).
func (l *dlqLines) cleared(now time.Time, shard int, dest string, gone bool) {
	l.withCond(dest, func(c *dlqCond) {
		if _, ok := c.failing[shard]; !ok {
			return
		}
		c.dropped = c.dropped || gone
		delete(c.failing, shard)
		l.overLocked(now, dest, c)
	})
}

// parkGone notes that a parked dead letter of dest left the store (an
// operator dropped it): as for failing ones dropped (cleared), a failure
// with none of its dead letters failing and no delivery since ends,
// saying they were dropped. A failure whose failing dead letters were
// parked stays open for a delivery, and dropping the parked ones then
// left it open for good, with no end line
// (TestDLQFailureEndsWhenParkedDropped).
func (l *dlqLines) parkGone(now time.Time, dest string) {
	l.withCond(dest, func(c *dlqCond) {
		c.dropped = true
		l.overLocked(now, dest, c)
	})
}

// overLocked marks dest's failure c healthy at now if no shard fails for
// it and it took a dead letter since it last failed: it ends, with its
// line, once it stayed so for dlqSettle (settle).
func (l *dlqLines) overLocked(now time.Time, dest string, c *dlqCond) {
	if len(c.failing) > 0 || !c.healthy.IsZero() {
		return
	}
	if !c.delivered {
		if c.dropped {
			// Nothing is left to deliver: said now, not as a recovery.
			delete(l.conds, dest)
			l.active.Add(-1)
			l.log.Info(msgDLQDropped, append([]zap.Field{zap.String("dlq", dest)}, c.dlqEndFields(now)...)...)
		}
		return
	}
	c.healthy = now
	at := ceilMs(now.Add(dlqSettle))
	if cur := l.settleAt.Load(); cur == 0 || at < cur {
		l.settleAt.Store(at)
		if l.wake != nil {
			l.wake() // its fire loop may be parked for longer
		}
	}
}

// settle ends, with their recovered lines, the failures that stayed
// healthy for dlqSettle at now; all of them with all (Run returning).
func (l *dlqLines) settle(now time.Time, all bool) {
	if l.settleAt.Load() == 0 {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	next := int64(0)
	for dest, c := range l.conds {
		if c.healthy.IsZero() {
			continue
		}
		if at := c.healthy.Add(dlqSettle); !all && now.Before(at) {
			if ms := ceilMs(at); next == 0 || ms < next {
				next = ms
			}
			continue
		}
		delete(l.conds, dest)
		l.active.Add(-1)
		fields := append([]zap.Field{zap.String("dlq", dest)}, c.dlqEndFields(c.healthy)...)
		if c.flaps > 0 {
			fields = append(fields, zap.Int("flaps", c.flaps))
		}
		l.log.Info(msgDLQRecovered, fields...)
	}
	l.settleAt.Store(next)
}

// ceilMs is t in whole milliseconds rounded up: settleAt, a fire loop's
// wake time, is not before the settle end it stands for, or a loop woken
// in its last millisecond found nothing due and parked for a time already
// come, spinning until the clock passed the end
// (TestDLQSettleWakeSubMillisecond).
func ceilMs(t time.Time) int64 {
	ms := t.UnixMilli()
	if t.Sub(time.UnixMilli(ms)) > 0 {
		ms++
	}
	return ms
}

// dlqEndFields are the fields of the line that ends c, which ended at
// end.
func (c *dlqCond) dlqEndFields(end time.Time) []zap.Field {
	fields := c.endFields(end)
	if c.parks > 0 {
		fields = append(fields, zap.Int("parked", c.parks))
	}
	return fields
}

// dlqFailure is a DLQ that dead letters of a fire round failed for, with
// the last failure.
type dlqFailure struct {
	dest string
	err  error
	// whole: one of the failures was not a refusal of the message
	// (ErrRefused): the DLQ failed as a whole.
	whole bool
}

// noteDLQ records err as dest's last failure in the round's list (a few
// DLQs at most: searched in turn).
func noteDLQ(fs []dlqFailure, dest string, err error) []dlqFailure {
	whole := !errors.Is(err, ErrRefused)
	for i := range fs {
		if fs[i].dest == dest {
			fs[i].err = err
			fs[i].whole = fs[i].whole || whole
			return fs
		}
	}
	return append(fs, dlqFailure{dest, err, whole})
}
