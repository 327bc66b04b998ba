package kafka

import (
	"sync"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/delaybridge/delaybridge/internal/logthrottle"
)

// retryLog keeps the partition workers' retry lines from flooding the
// log. A broker that leads the partitions down, a read ACL removed or a
// partition without a leader fails every partition's fetch at every
// retry, and a store that refuses writes every partition's batch, each
// worker backing off to RetryMax on its own: one Warn line per partition
// and retry (hunt H204: 28 a minute with 3 partitions, about 600 with
// 100). Each line is logged once per logthrottle.DefaultEvery per message,
// topic and shape of its error (offsets, batch sizes and other numbers
// aside) across the topic's partitions (across all topics with anyTopic),
// with the count held back; and an
// outage, from a first failing partition until a partition goes on with
// none failing, ends with one Info line (end), so the log says when the
// partitions go on: at once if a failure line was logged since the last
// end line, else (an outage whose lines were all held back) once per
// logthrottle.DefaultEvery with the count of ends held back
// (logthrottle.Episode). The end line does not restart the throttle
// (review R210: it did, since d8d0aa4, so a partition failing and going
// on by turns, a store at its free-space reserve or a flapping leader,
// logged a failure and an end line at every turn).
//
// An outage outlives the partitions revoked from this member while they
// failed (a rebalance, a rolling restart of the other members): it goes
// on with the next generation's failures and ends at its next partition
// that goes on (review R200: ended at the revocation, its logged start
// never had an end line when the new generation's failures were held back
// by the throttle and the outage ended within DefaultEvery).
type retryLog struct {
	end string // the Info line at the end of an outage
	// anyTopic keys the lines without their topic: for failures that are
	// not the topic's but one cause for all (the handler's, the store's:
	// a failed fsync, the volume's reserve), one line per interval for
	// the source's topics (review R210: 10 topics logged 10 lines per
	// 30 s). The line still names its partition's topic (the worker's
	// logger).
	anyTopic bool
	now      func() time.Time // nil: time.Now (tests set it)
	th       logthrottle.Throttle
	ep       logthrottle.Episode // the end lines

	mu      sync.Mutex
	open    bool          // an outage is on: a try failed, no partition went on since with none failing
	failing map[part]bool // partitions whose last try failed
	tries   int           // failed tries of this outage
	parts   map[part]bool // the partitions that failed in this outage
	since   time.Time     // the outage's first failure
}

// part is a topic partition, as the worker that logs its lines knows it
// (not cut from its checkpoint key, whose format is bridge's).
type part struct {
	topic string
	id    int
}

func (r *retryLog) clock() time.Time {
	if r.now != nil {
		return r.now()
	}
	return time.Now()
}

// failed notes a failed try of partition p and logs msg at level
// unless a line of that message and error shape was logged within the
// throttle's interval.
func (r *retryLog) failed(log *zap.Logger, level zapcore.Level, p part, msg string, err error, fields ...zap.Field) {
	now := r.clock()
	// The throttle's key: the message, the partition's topic (whole: a
	// shape would fold tenant1 and tenant2) and the error's shape, so the
	// first failure of another topic is logged at once (review R200: a
	// read ACL removed from a second topic was held back behind the first
	// topic's line of the same shape).
	shape := msg + "\x00" + p.topic
	if r.anyTopic {
		shape = msg
	}
	if err != nil {
		shape += "\x00" + logthrottle.Shape(err.Error())
		fields = append(fields, zap.Error(err))
	}
	r.mu.Lock()
	if !r.open {
		r.open = true
		r.failing, r.parts = map[part]bool{}, map[part]bool{}
		r.tries, r.since = 0, now
	}
	r.failing[p], r.parts[p] = true, true
	r.tries++
	// Under r.mu: an end line between this try's verdict and its note
	// in r.ep would let the line out with no end line after it.
	suppressed, forgotten, ok := r.th.AllowEachForgotten(now, shape)
	if ok {
		r.ep.Logged()
	}
	r.mu.Unlock()
	if ok {
		log.Log(level, msg, append(fields, zap.Int("held_back", suppressed), logthrottle.Forgotten(forgotten))...)
	}
}

// ok notes that partition p goes on (read is true) or that this
// member stopped reading it (its next owner reports it). A partition that
// goes on while none fails ends the outage, logging its end as r.ep lets
// it.
func (r *retryLog) ok(log *zap.Logger, p part, read bool) {
	r.mu.Lock()
	if !r.open {
		// Outages whose end lines were held back are said once their
		// interval is over (logthrottle.Episode.Owed).
		var held int
		var owed bool
		if read {
			held, owed = r.ep.Owed(r.clock())
		}
		r.mu.Unlock()
		if owed {
			log.Info(r.end, zap.Int("held_back", held))
		}
		return
	}
	delete(r.failing, p)
	if len(r.failing) > 0 || !read {
		r.mu.Unlock()
		return
	}
	r.open = false
	now := r.clock()
	held, ok := r.ep.End(now)
	parts, tries, since := len(r.parts), r.tries, r.since
	r.mu.Unlock()
	if !ok {
		return
	}
	log.Info(r.end,
		zap.Int("partitions_failed", parts), zap.Int("failed_tries", tries),
		zap.Duration("failing_for", now.Sub(since).Round(time.Millisecond)),
		zap.Int("held_back", held))
}
