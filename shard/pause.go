package shard

import (
	"cmp"
	"context"
	"slices"

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
// have read their backlog.
func (e *Engine) PauseFiring() {
	if !e.paused.Swap(true) {
		e.m.FiringPaused.Set(1)
	}
}

// ResumeFiring ends a pause of PauseFiring; without one it does nothing.
func (e *Engine) ResumeFiring() {
	if !e.paused.Swap(false) {
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

// FiringPaused reports whether firing is paused (PauseFiring).
func (e *Engine) FiringPaused() bool { return e.paused.Load() }

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
		s.paused = append(s.paused, wheelOp{fire: fire, seq: seq})
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
	s.park(ctx, timer, wake, true)
}

// takePausedLocked claims up to max of the tasks set aside while firing
// was paused, the earliest due first.
func (s *shard) takePausedLocked(max int) []fireItem {
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
