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
// 100). Each line is logged once per logthrottle.DefaultEvery per message
// and shape of its error (offsets, batch sizes and other numbers aside)
// across the source's partitions, with the count held back; and an
// outage, from a first failing partition until none fails, ends with one
// Info line (end) if any of its lines was logged, so the log says when
// the partitions go on.
type retryLog struct {
	end string // the Info line at the end of an outage
	th  logthrottle.Throttle

	mu      sync.Mutex
	failing map[string]bool // checkpoint keys whose last try failed
	tries   int             // failed tries of this outage
	parts   map[string]bool // the partitions that failed in this outage
	since   time.Time       // the outage's first failure
	logged  bool            // a line of this outage was logged
}

// failed notes a failed try of the partition key and logs msg at level
// unless a line of that message and error shape was logged within the
// throttle's interval.
func (r *retryLog) failed(log *zap.Logger, level zapcore.Level, key, msg string, err error, fields ...zap.Field) {
	now := time.Now()
	shape := msg
	if err != nil {
		shape += "\x00" + logthrottle.Shape(err.Error())
		fields = append(fields, zap.Error(err))
	}
	suppressed, ok := r.th.AllowEach(now, shape)
	r.mu.Lock()
	if len(r.failing) == 0 {
		r.failing, r.parts = map[string]bool{}, map[string]bool{}
		r.tries, r.since, r.logged = 0, now, false
	}
	r.failing[key], r.parts[key] = true, true
	r.tries++
	r.logged = r.logged || ok
	r.mu.Unlock()
	if ok {
		log.Log(level, msg, append(fields, zap.Int("suppressed", suppressed))...)
	}
}

// ok notes that the partition key goes on (read is true) or that this
// member stopped reading it (its next owner reports it). When no
// partition fails any more, a read logs the end of the outage.
func (r *retryLog) ok(log *zap.Logger, key string, read bool) {
	r.mu.Lock()
	if !r.failing[key] {
		r.mu.Unlock()
		return
	}
	delete(r.failing, key)
	if len(r.failing) > 0 || !read || !r.logged {
		r.mu.Unlock()
		return
	}
	parts, tries, since := len(r.parts), r.tries, r.since
	r.mu.Unlock()
	log.Info(r.end,
		zap.Int("partitions_failed", parts), zap.Int("failed_tries", tries),
		zap.Duration("failing_for", time.Since(since).Round(time.Millisecond)))
}
