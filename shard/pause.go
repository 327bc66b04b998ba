package shard

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/cockroachdb/pebble/v2"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/clock"
)

// Firing paused while the sources catch up (bridge/service, catch_up_wait).
//
// A bridge that was down finds overdue tasks in its store and a backlog in
// its sources that may cancel or replace them: a cancel its publisher sent
// before a task's due time, while the bridge was down. Fired at once, the
// task would be delivered before the cancel is read, though a bridge that
// had been up would never have delivered it. So the service pauses firing
// until its sources have read what they held when it started (or for at
// most catch_up_wait), and the engine meanwhile takes due tasks out of the
// wheel and sets them aside, in memory (16 bytes each, like a wheel
// entry): a cancel or replace read meanwhile deletes the stored task, and
// the fire loop drops it when it reads the store after the pause. Dead
// letters a source waits for still go out: the source's progress, and so
// the end of the pause, may depend on their DLQ acknowledgement.

// PauseFiring stops the fire loops from firing tasks until ResumeFiring,
// except the dead letters a source waits for (see IngestAwait and
// AwaitStored). Tasks that come due meanwhile wait in memory, and fire
// first, in due order, when firing resumes; a cancel or replace ingested
// meanwhile stops them. Meant for the start of a run, before the sources
// have read their backlog. It is independent of an operator's pause
// (PauseFiringByOperator): firing resumes when neither holds it.
func (e *Engine) PauseFiring() {
	e.pauseMu.Lock()
	defer e.pauseMu.Unlock()
	e.catchUpPaused = true
	e.setPausedLocked()
}

// ResumeFiring ends a pause of PauseFiring; without one it does nothing.
// An operator's pause (PauseFiringByOperator) still holds firing.
func (e *Engine) ResumeFiring() {
	e.pauseMu.Lock()
	defer e.pauseMu.Unlock()
	e.catchUpPaused = false
	e.setPausedLocked()
}

// FiringPaused reports whether firing is paused, for either reason.
func (e *Engine) FiringPaused() bool { return e.paused.Load() }

// setOpPauseLocked sets the operator's pause (nil: none), its gauges and
// e.paused.
func (e *Engine) setOpPauseLocked(p *OperatorPause) {
	e.opPause = p
	if p == nil {
		e.m.FiringPausedByOperator.Set(0)
		e.m.FiringPausedByOperatorSince.Set(0)
	} else {
		e.m.FiringPausedByOperator.Set(1)
		e.m.FiringPausedByOperatorSince.Set(float64(p.Since.UnixMilli()) / 1000)
	}
	e.setPausedLocked()
}

// clearPauseGauges takes the engine's pause out of the gauges when it
// closes or its Open fails (a reopened store counts its own again).
func (e *Engine) clearPauseGauges() {
	if e.paused.Load() {
		e.m.FiringPaused.Set(0)
	}
	e.pauseMu.Lock()
	defer e.pauseMu.Unlock()
	if e.opPause != nil {
		e.m.FiringPausedByOperator.Set(0)
		e.m.FiringPausedByOperatorSince.Set(0)
	}
}

// setPausedLocked makes e.paused say whether either reason holds firing,
// and wakes the fire loops when it ends.
func (e *Engine) setPausedLocked() {
	want := e.catchUpPaused || e.opPause != nil
	if e.paused.Swap(want) == want {
		return
	}
	if want {
		e.m.FiringPaused.Set(1)
		return
	}
	e.m.FiringPaused.Set(0)
	for _, s := range e.shards {
		s.mu.Lock()
		s.parked = false // not idle: it has tasks to fire (tests wait on parked)
		s.wake()
		s.mu.Unlock()
	}
}

// An operator's pause of firing (admin POST /v1/firing/pause): for an
// incident downstream, a migration of a target, a deploy of its
// consumers. It holds firing as the catch-up pause does (due tasks wait,
// in memory, 16 bytes each; dead letters a source waits for still go to
// their DLQ so the sources keep reading), and it is kept in the store,
// so a restart, a crash or a rescheduled pod stays paused until the
// operator resumes it. A batch being published when the pause comes
// finishes.

// MaxPauseReason is the longest reason an operator's pause keeps, in bytes.
const MaxPauseReason = 1024

// ErrPauseReason is returned by PauseFiringByOperator for a reason it does
// not keep: longer than MaxPauseReason, not UTF-8, or with control,
// format (bidi overrides, zero-width) or line or paragraph separator
// characters.
var ErrPauseReason = errors.New("shard: pause reason must be at most 1024 bytes of UTF-8 text without control, format (bidi, zero-width) or line-separator characters")

// OperatorPause is an operator's pause of firing.
type OperatorPause struct {
	// Since is when the pause began (the engine's clock, to the
	// millisecond); a pause asked for again keeps it.
	Since Time `json:"since"`
	// Reason is the operator's note, "" if none was given.
	Reason string `json:"reason"`
}

// FiringState says whether firing is paused, and why.
type FiringState struct {
	Paused bool `json:"paused"` // for either reason below
	// CatchingUp: paused at start until the sources have read their
	// backlog (PauseFiring).
	CatchingUp bool `json:"catching_up"`
	// Operator is the operator's pause, nil if none.
	Operator *OperatorPause `json:"operator,omitempty"`
	// InFlight counts the tasks and dead letters the fire loops have
	// taken for delivery and whose outcome is not settled yet. A pause
	// does not stop the batches already taken: once it holds, InFlight
	// falls to 0 as they go out (dead letters a source waits for may
	// still come and go).
	InFlight int `json:"in_flight"`
}

// Firing reports whether firing is paused, and why.
func (e *Engine) Firing() FiringState {
	e.pauseMu.Lock()
	defer e.pauseMu.Unlock()
	return e.firingLocked()
}

func (e *Engine) firingLocked() FiringState {
	st := FiringState{Paused: e.catchUpPaused || e.opPause != nil, CatchingUp: e.catchUpPaused}
	if e.opPause != nil {
		p := *e.opPause
		st.Operator = &p
	}
	for _, s := range e.shards {
		s.mu.Lock()
		st.InFlight += len(s.inflight)
		s.mu.Unlock()
	}
	return st
}

// PauseFiringByOperator pauses firing until ResumeFiringByOperator, and
// returns once the pause is durable in the store: from then on the fire
// loops take no task for delivery, after a restart too (the batches they
// took before still go out: FiringState.InFlight counts them; dead letters
// a source waits for go too). A pause asked for while one
// holds keeps its start; a non-empty reason replaces the one it had. It
// returns ErrPauseReason for a reason it does not keep, ErrClosed on a
// closed engine, and the store's error (ErrStoreFailed) when the record
// cannot be written; firing is not paused then, but the failed store
// stops firing until a restart, and the record may have reached the
// disk before its sync failed: the restart may come back paused
// (TestOperatorPauseFailedWriteAfterRestart).
func (e *Engine) PauseFiringByOperator(reason string) (FiringState, error) {
	if !validPauseReason(reason) {
		return FiringState{}, ErrPauseReason
	}
	e.closeMu.RLock()
	defer e.closeMu.RUnlock()
	if e.closed {
		return FiringState{}, ErrClosed
	}
	// opMu orders the operator's pauses and resumes with their records;
	// pauseMu is taken only for the change in memory, so Firing and the
	// catch-up's PauseFiring and ResumeFiring never wait for a store
	// write (a stalled fsync: a full or hung disk).
	e.opMu.Lock()
	defer e.opMu.Unlock()
	old := e.opPause // changed only under opMu (and pauseMu)
	p := OperatorPause{Since: msTime(e.nowMs()), Reason: reason}
	if old != nil {
		if reason == "" || reason == old.Reason {
			return e.Firing(), nil
		}
		p.Since = old.Since
	}
	if err := e.failed(); err != nil {
		return FiringState{}, fmt.Errorf("shard: pause firing: %w", err)
	}
	if err := safeCall(func() error { return e.db.Set(pauseKey, appendPause(nil, p), pebble.Sync) }); err != nil {
		return FiringState{}, fmt.Errorf("shard: pause firing: %w", e.fail("pause", err))
	}
	if old == nil {
		e.log.Warn("firing paused by the operator: due tasks wait until POST /v1/firing/resume (kept across restarts)",
			zap.String("reason", reason))
	} else {
		e.log.Info("operator's pause of firing: reason changed", zap.String("reason", reason), zap.Time("since", p.Since.Time))
	}
	e.pauseMu.Lock()
	defer e.pauseMu.Unlock()
	e.setOpPauseLocked(&p)
	return e.firingLocked(), nil
}

// ResumeFiringByOperator ends an operator's pause (PauseFiringByOperator)
// once its record is deleted from the store; without one it does
// nothing. Firing resumes unless the catch-up at start still holds it
// (FiringState.CatchingUp). It returns the pause it ended, nil if none,
// ErrClosed on a closed engine, and the store's error (ErrStoreFailed)
// when the record cannot be deleted; the pause holds then, until the
// restart the failed store needs, which may come back resumed (the
// deletion may have reached the disk before its sync failed).
func (e *Engine) ResumeFiringByOperator() (FiringState, *OperatorPause, error) {
	e.closeMu.RLock()
	defer e.closeMu.RUnlock()
	if e.closed {
		return FiringState{}, nil, ErrClosed
	}
	e.opMu.Lock() // see PauseFiringByOperator
	defer e.opMu.Unlock()
	old := e.opPause
	if old == nil {
		return e.Firing(), nil, nil
	}
	if err := e.failed(); err != nil {
		return FiringState{}, nil, fmt.Errorf("shard: resume firing: %w", err)
	}
	if err := safeCall(func() error { return e.db.Delete(pauseKey, pebble.Sync) }); err != nil {
		return FiringState{}, nil, fmt.Errorf("shard: resume firing: %w", e.fail("resume", err))
	}
	e.pauseMu.Lock()
	defer e.pauseMu.Unlock()
	e.setOpPauseLocked(nil)
	e.log.Info("firing resumed by the operator", zap.Time("paused_since", old.Since.Time),
		zap.Duration("paused_for", time.UnixMilli(e.nowMs()).Sub(old.Since.Time)), zap.String("reason", old.Reason))
	return e.firingLocked(), old, nil
}

// The zero-width non-joiner and joiner, format characters that ordinary
// text needs.
const (
	zwnj = '\u200c'
	zwj  = '\u200d'
)

// validPauseReason reports whether PauseFiringByOperator keeps reason.
func validPauseReason(reason string) bool {
	if len(reason) > MaxPauseReason || !utf8.ValidString(reason) {
		return false
	}
	for _, r := range reason {
		// Control characters, and the line and paragraph separators and
		// format characters (bidi overrides, zero-width ones) that would
		// let a reason break or disguise a log line or a terminal's
		// display of it (R224).
		if r == zwnj || r == zwj {
			continue // joiners of ordinary Persian and Indic text, emoji sequences (R226)
		}
		if unicode.IsControl(r) || unicode.In(r, unicode.Zl, unicode.Zp, unicode.Cf) {
			return false
		}
	}
	return true
}

// appendPause appends the stored form of an operator's pause: its start
// in ms (u64, big-endian), then its reason.
func appendPause(dst []byte, p OperatorPause) []byte {
	dst = binary.BigEndian.AppendUint64(dst, fireU64(p.Since.UnixMilli()))
	return append(dst, p.Reason...)
}

// errPauseRecord is returned by decodePause for a record it cannot read.
var errPauseRecord = errors.New("shard: corrupt operator pause record")

// decodePause reads a record of appendPause.
func decodePause(v []byte) (OperatorPause, error) {
	if len(v) < 8 {
		return OperatorPause{}, fmt.Errorf("%w: %d bytes", errPauseRecord, len(v))
	}
	ms := binary.BigEndian.Uint64(v)
	reason := string(v[8:])
	if ms > uint64(codec.MaxDue) || !validPauseReason(reason) {
		return OperatorPause{}, fmt.Errorf("%w: since %d ms, reason %q", errPauseRecord, ms, reason)
	}
	return OperatorPause{Since: msTime(int64(ms)), Reason: reason}, nil
}

// loadOperatorPause restores an operator's pause at Open. A record it
// cannot read still pauses (the operator asked for a pause; firing would
// be the surprise), with the time of this Open and a reason that says so.
func (e *Engine) loadOperatorPause() error {
	v, found, err := getCopy(e.db, pauseKey)
	if err != nil {
		return fmt.Errorf("shard: recover: read operator pause: %w", err)
	}
	if !found {
		return nil
	}
	p, derr := decodePause(v)
	if derr != nil {
		p = OperatorPause{Since: msTime(e.nowMs()), Reason: "(the stored pause record could not be read)"}
		e.log.Error("operator pause record unreadable: firing stays paused until POST /v1/firing/resume", zap.Error(derr))
	}
	e.pauseMu.Lock()
	defer e.pauseMu.Unlock()
	e.setOpPauseLocked(&p)
	e.log.Warn("firing paused by the operator (kept in the store): due tasks wait until POST /v1/firing/resume",
		zap.Time("since", p.Since.Time), zap.String("reason", p.Reason))
	return nil
}

// claimPausedLocked is claimLocked while firing is paused: of the entries
// due by now (at most a fire batch), the dead letters a source waits for
// are claimed and returned; the others are set aside in s.paused. more
// reports whether the wheel may hold more entries due by now.
func (s *shard) claimPausedLocked(now int64) (claimed []fireItem, more bool) {
	n := 0
	s.e.dl.mu.Lock()
	s.w.AdvanceN(now, s.e.opts.FireBatch, func(fire int64, seq uint64) {
		n++
		if _, ok := s.deleting[seq]; ok {
			return // a replace or cancel is deleting it
		}
		if s.e.deadLetterAwaitedLocked(seq) {
			claimed = append(claimed, fireItem{fire: fire, seq: seq})
			s.inflight[seq] = notSuperseded
			return
		}
		if len(s.paused) == 0 || fire < s.pausedMin {
			s.pausedMin = fire
		}
		// Not sorted any more: a pause again while the resume was taking
		// what the first set aside appends behind the rest, and a task
		// ingested overdue may be due before them.
		s.paused, s.pausedSorted = append(s.paused, wheelOp{fire: fire, seq: seq}), false
	})
	s.e.dl.mu.Unlock()
	s.inWheelG.Set(float64(s.w.Len()))
	return claimed, n >= s.e.opts.FireBatch
}

// parkPausedLocked parks a paused fire loop that has nothing to fire
// until the wheel's next due (a second at most), an ingest, or
// ResumeFiring; it unlocks s.mu.
func (s *shard) parkPausedLocked(ctx context.Context, timer clock.Timer, now int64) {
	wake := now + maxPark.Milliseconds()
	if next, ok := s.w.Next(); ok && next < wake {
		wake = next
	}
	s.pauseParked = true // park returns if firing resumed since
	s.mu.Unlock()
	if h := s.e.testHookPausedPark; h != nil {
		h()
	}
	s.park(ctx, timer, wake, true)
}

// takePausedLocked claims up to max of the tasks set aside while firing
// was paused, the earliest due first, those due by now (ms). The clock
// may have stepped back during the pause: the ones no longer due go back
// to the wheel, which fires them at their time (M227: they fired early).
func (s *shard) takePausedLocked(now int64, max int) []fireItem {
	if len(s.paused) == 0 {
		return nil
	}
	if !s.pausedSorted {
		slices.SortFunc(s.paused, func(a, b wheelOp) int {
			return cmp.Or(cmp.Compare(a.fire, b.fire), cmp.Compare(a.seq, b.seq))
		})
		s.pausedSorted = true
	}
	var out []fireItem
	k := 0
	for ; k < len(s.paused) && len(out) < max; k++ {
		p := s.paused[k]
		if p.fire > now {
			// Sorted: this one and the rest are not due.
			for _, q := range s.paused[k:] {
				s.addLocked(q.fire, q.seq)
			}
			k = len(s.paused)
			s.inWheelG.Set(float64(s.w.Len()))
			break
		}
		if _, ok := s.deleting[p.seq]; ok {
			continue
		}
		out = append(out, fireItem{fire: p.fire, seq: p.seq})
		s.inflight[p.seq] = notSuperseded
	}
	s.paused = s.paused[k:]
	if len(s.paused) == 0 {
		s.paused, s.pausedSorted = nil, false
	} else {
		s.pausedMin = s.paused[0].fire
	}
	return out
}

// unpauseLocked puts the tasks set aside back in the wheel (the fire loop
// is stopping; a next Run fires them).
func (s *shard) unpauseLocked() {
	for _, p := range s.paused {
		s.addLocked(p.fire, p.seq)
	}
	s.paused, s.pausedSorted = nil, false
	s.inWheelG.Set(float64(s.w.Len()))
}
