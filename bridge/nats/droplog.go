package nats

import (
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/internal/logthrottle"
)

// dropLogEvery is how often a connection logs its drops (tests shorten it).
var dropLogEvery = logthrottle.DefaultEvery

// dropLog throttles a connection's "disconnected" lines: a connection that
// drops again and again (a flapping network path, a load balancer
// resetting it, a server restarted in a loop) logged a drop, a failed
// attempt and a reconnect at every drop, 35 lines a minute with one every
// 5 s (hunt H204). A drop is logged once per dropLogEvery with the drops
// held back, and its reconnect only when it or a failed attempt since was
// logged, so a logged outage always has its end; the failed attempts'
// throttle (reset) starts again only with a logged drop.
//
// The drops held back are reported at the end of their interval if no
// drop line came by then (review F211: a second short outage within 30 s
// of a logged one showed nowhere at Info, so an operator saw one outage
// where there were two): as the connection's "disconnected" line if it is
// down then (its reconnect logged), else in one line that it dropped and
// reconnected again. One timer per interval with drops held back, none
// per drop.
type dropLog struct {
	log   *zap.Logger
	every time.Duration
	reset func() // starts the failed attempts' throttle again

	mu         sync.Mutex
	last       time.Time // the last drop line
	held       int       // drops since it, not logged
	lastErr    error     // the last drop's error
	lastAt     time.Time // when it came
	down       bool      // a drop's reconnect is due
	downLogged bool      // that drop or a failed attempt since was logged: log its reconnect
	timer      *time.Timer
	closed     bool
}

// dropped notes a drop of the connection.
func (d *dropLog) dropped(err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	now := time.Now()
	d.down, d.lastErr, d.lastAt = true, err, now
	if d.last.IsZero() || now.Sub(d.last) >= d.every {
		d.lineLocked(now, d.held)
		return
	}
	d.held++
	d.downLogged = false
	d.log.Debug("nats: disconnected; reconnecting", zap.Error(err))
	if d.timer == nil && !d.closed {
		d.timer = time.AfterFunc(d.last.Add(d.every).Sub(now), d.flush)
	}
}

// lineLocked logs the current drop with held drops before it, and f.
func (d *dropLog) lineLocked(now time.Time, held int, f ...zap.Field) {
	d.last, d.held, d.downLogged = now, 0, true
	if d.timer != nil {
		d.timer.Stop()
		d.timer = nil
	}
	d.reset()
	d.log.Warn("nats: disconnected; reconnecting", append([]zap.Field{zap.Error(d.lastErr), zap.Int("held_back", held)}, f...)...)
}

// flush reports the drops held back at the end of their interval, unless
// a drop line did.
func (d *dropLog) flush() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.timer = nil
	if d.closed || d.held == 0 {
		return
	}
	now := time.Now()
	if d.down {
		// The last of them is the drop the connection is in: its line,
		// late, so it says when the drop came (review R212: the line's
		// own time was up to an interval after it), and its reconnect
		// logged.
		d.lineLocked(now, d.held-1, zap.Time("dropped_at", d.lastAt))
		return
	}
	d.log.Warn("nats: disconnected and reconnected again since the last drop logged",
		zap.Error(d.lastErr), zap.Int("held_back", d.held), zap.Time("last_dropped_at", d.lastAt))
	d.last, d.held = now, 0
}

// attemptLogged notes a failed reconnect attempt logged: the reconnect
// that ends it is logged too.
func (d *dropLog) attemptLogged() {
	d.mu.Lock()
	d.downLogged = true
	d.mu.Unlock()
}

// reconnected notes the connection up again, on server.
func (d *dropLog) reconnected(server string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	logged := d.downLogged
	d.down, d.downLogged = false, false
	if !logged {
		d.log.Debug("nats: reconnected", zap.String("server", server))
		return
	}
	d.log.Info("nats: reconnected", zap.String("server", server))
}

// close stops the timer and returns the drops held back, not reported.
func (d *dropLog) close() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.closed = true
	if d.timer != nil {
		d.timer.Stop()
		d.timer = nil
	}
	return d.held
}
