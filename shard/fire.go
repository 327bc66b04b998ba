package shard

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/cockroachdb/pebble/v2"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/clock"
	"github.com/delaybridge/delaybridge/internal/logthrottle"
)

// Run runs one fire loop per shard (each also moves its shard's horizon and
// sweeps expired cancel markers) until ctx is done. It returns after every
// in-flight batch finished: acknowledged deliveries are deleted, the rest
// stay in the store for redelivery.
func (e *Engine) Run(ctx context.Context, sink Sink) error {
	if sink == nil {
		return errors.New("shard: run: nil sink")
	}
	// Run and Close decide under closeMu: either Close sees this Run
	// (ErrRunning) or Run sees the engine closed (ErrClosed), never a Run
	// on a store being closed.
	e.closeMu.RLock()
	if e.closed {
		e.closeMu.RUnlock()
		return ErrClosed
	}
	if !e.running.CompareAndSwap(false, true) {
		e.closeMu.RUnlock()
		return fmt.Errorf("shard: run: %w", ErrRunning)
	}
	e.closeMu.RUnlock()
	defer e.running.Store(false)
	var wg sync.WaitGroup
	wg.Go(func() { e.quietFlushLoop(ctx) })
	for _, s := range e.shards {
		wg.Add(2)
		commits := make(chan *fireCommit, fireCommitDepth)
		go func() {
			defer wg.Done()
			s.commitLoop(commits)
		}()
		go func() {
			defer wg.Done()
			defer close(commits)
			s.loop(ctx, sink, commits)
		}()
	}
	wg.Wait()
	// A DLQ recovered and settling says so before the engine stops.
	e.dlqLines.settle(e.clk.Now(), true)
	return nil
}

// fireCommitDepth bounds the fire batches of a shard whose delete commit is
// applied but not yet fsynced.
const fireCommitDepth = 4

// fireCommit is an applied fire-batch commit waiting for its fsync.
type fireCommit struct {
	b     *pebble.Batch
	pb    *pendingBatch
	start time.Time
	obs   prometheus.Observer
	op    string
}

// commitLoop waits for the fsync of each applied fire batch in order and
// then lets its rescheduled tasks into the wheel.
func (s *shard) commitLoop(commits <-chan *fireCommit) {
	e := s.e
	for c := range commits {
		err := c.b.SyncWait()
		c.obs.Observe(time.Since(c.start).Seconds())
		if err != nil {
			err = e.fail(c.op, err)
			e.storeLines.failed(e.clk.Now(), zap.ErrorLevel, msgFireCommitFailed, s.id, err)
		} else {
			c.b.Close()
			e.storeLines.ok(e.clk.Now(), msgFireCommitFailed, s.id)
		}
		if err != nil {
			s.mu.Lock()
			s.abandonLocked(c.pb)
			s.mu.Unlock()
		} else {
			s.markDurable(c.pb)
		}
	}
}

// fireItem is one task taken from the wheel for delivery.
type fireItem struct {
	fire int64
	seq  uint64
	task *codec.Task
	// parked: taken back from its lane's tasks set aside (lane.go), so
	// older than any the round claimed from the wheel.
	parked bool
	// released: claimed by a release (recover.go) at its retry time, not
	// due: sent back unread, it stays released (settleClaimed).
	released bool
	// corrupt: dropped because its envelope cannot be decoded (it stays
	// in the store, see shard.undecodable); a dropped item without it is
	// gone from the store. decodeErr says why.
	corrupt   bool
	decodeErr error
}

func (s *shard) loop(ctx context.Context, sink Sink, commits chan<- *fireCommit) {
	timer := s.e.clk.NewTimer(time.Hour)
	defer timer.Stop()
	s.mu.Lock()
	s.parkTimer = timer
	s.mu.Unlock()
	// The lanes' batches finish (and send their commits) before the loop
	// returns; what they left parked goes back in the wheel for a next Run.
	var lanes sync.WaitGroup
	defer func() {
		lanes.Wait()
		s.mu.Lock()
		for l := range s.lanes {
			s.unparkLocked(&s.lanes[l])
		}
		s.unpauseLocked()
		s.mu.Unlock()
	}()
	for {
		if ctx.Err() != nil {
			return
		}
		if s.e.failed() != nil {
			// After a failed write nothing may be deleted; stop firing and
			// let the operator restart (Err reports why).
			<-ctx.Done()
			return
		}
		now := s.e.nowMs()
		moreToSweep, err := s.sweep(now)
		if err != nil {
			s.e.storeLines.failed(s.e.clk.Now(), zap.WarnLevel, msgSweepFailed, s.id, err)
		}
		// A release held back by its spacing whose wait has ended
		// (recover.go): it takes every shard's lock.
		s.e.outages.rebase(now)
		s.e.releaseOwed(now)
		// A down group untried for a while: one of its waiting tasks
		// goes now (recover.go).
		s.e.probeOutages(now)
		s.clearFired(now)
		if at := s.e.dlqLines.settleAt.Load(); at != 0 && at <= now {
			s.e.dlqLines.settle(s.e.clk.Now(), false)
		}
		s.mu.Lock()
		s.rebaseLocked(now)
		s.drainLocked()
		err = s.housekeepLocked(now)
		if wait, busy := s.laneWaitLocked(time.Now()); err == nil && busy {
			// A batch is being published: wait for it, unless it is stuck.
			s.mu.Unlock()
			s.awaitLane(ctx, wait)
			continue
		}
		var claimed []fireItem
		nHeld := 0
		if err == nil {
			fb := s.e.opts.FireBatch
			// First the tasks set aside while their lane was stuck (while
			// firing is paused, only dead letters a source waits for: its
			// progress, and so the end of the pause, waits for them).
			claimed = s.takeParkedLocked(fb)
			paused := s.e.paused.Load()
			switch {
			case paused:
				// Due tasks are set aside (pause.go); held ones stay held.
				awaited, more := s.claimPausedLocked(now)
				if claimed = append(claimed, awaited...); len(claimed) == 0 {
					if more || moreToSweep {
						s.mu.Unlock()
					} else {
						s.parkPausedLocked(ctx, timer, now)
					}
					continue
				}
			case len(s.paused) > 0:
				// What waited for the pause goes first, in due order.
				claimed = append(claimed, s.takePausedLocked(now, max(fb-len(claimed), 1))...)
			default:
				claimed = append(claimed, s.claimLocked(now)...)
			}
			if !paused {
				// Tasks waiting for a target that is back (recover.go),
				// then held ones (hold.go), get what is left of a batch,
				// and at least half of one, so neither they nor the due
				// ones starve.
				left := max(fb-len(claimed), (fb+1)/2)
				released := s.claimReleasedLocked(left)
				claimed = append(claimed, released...)
				if left -= len(released); left > 0 {
					held, herr := s.claimHeldLocked(now, left)
					if herr != nil {
						s.e.storeLines.failed(s.e.clk.Now(), zap.WarnLevel, msgHeldReadFailed, s.id, herr)
					} else if !s.heldReadFailingLocked() {
						// Not at a claim that released tasks only: its
						// end line waited for a group's backoff, or never
						// came once the held tasks were cancelled
						// (TestHeldReadFailureEnds); nor at one lane's
						// read while the other's still fails.
						s.e.storeLines.ok(s.e.clk.Now(), msgHeldReadFailed, s.id)
					}
					claimed = append(claimed, held...)
					nHeld = len(held)
				}
			}
		}
		if err == nil && len(claimed) == 0 {
			s.e.storeLines.ok(s.e.clk.Now(), msgFireReadFailed, s.id) // the load, if due, read
			if moreToSweep {
				// A full round of expired markers: the next one now, not
				// a park (up to maxPark) later, or an idle shard would
				// sweep sweepBatch a second, behind a burst of cancels.
				s.mu.Unlock()
				continue
			}
			wake := s.horizonEnd - s.e.horizonMs()/2 // or the wheel's next due: park looks
			if at, ok := s.nextReleaseLocked(); ok && at < wake {
				wake = at // a release of held tasks
			}
			if at := s.e.outages.owedAt.Load(); at != 0 && at < wake {
				wake = at // a release held back by its spacing
			}
			if at := s.e.outages.probeAt.Load(); at != 0 && at < wake {
				wake = at // a probe of a down group
			}
			if at := s.e.dlqLines.settleAt.Load(); at != 0 && at < wake {
				wake = at // the end of a recovered DLQ's settle time
			}
			s.mu.Unlock()
			s.park(ctx, timer, wake, false)
			continue
		}
		s.mu.Unlock()
		var items []fireItem
		if err == nil {
			var dropped, retry []fireItem
			items, dropped, retry, err = s.readClaimed(claimed, len(claimed)-nHeld)
			s.settleClaimed(dropped, retry)
			if h := s.e.testHookClaimRead; h != nil {
				h(len(claimed))
			}
		}
		if err == nil {
			s.e.storeLines.ok(s.e.clk.Now(), msgFireReadFailed, s.id)
		} else {
			s.e.storeLines.failed(s.e.clk.Now(), zap.ErrorLevel, msgFireReadFailed, s.id, err)
			if len(items) == 0 { // (the tasks it could not read are back in the wheel)
				s.park(ctx, timer, now+1000, true) // retry in a second
				continue
			}
		}
		if len(items) == 0 {
			continue // all claimed entries were gone: look again
		}
		s.dispatch(ctx, sink, items, commits, &lanes)
	}
}

// maxPark bounds one wait of a parked fire loop (see park): about one
// wake-up a second per shard when nothing is due.
const maxPark = time.Second

// park waits until the clock reaches wake (ms) or the wheel's next due if
// that is earlier, an ingest adds an earlier task, or ctx is done. It
// returns at once when that time has come already: the clock moved on
// since the loop looked, or the batches it drains hold due tasks. With
// hold it waits for wake itself, whatever the wheel holds (the pause after
// a failed store read, which put its tasks back in the wheel).
func (s *shard) park(ctx context.Context, timer clock.Timer, wake int64, hold bool) {
	s.mu.Lock()
	// Consume a stale wake-up first, then take durable batches: a batch
	// marked durable after this drain sends a fresh wake-up.
	select {
	case <-s.notify:
	default:
	}
	s.drainLocked()
	if s.pauseParked {
		// Parked by a paused loop: ResumeFiring's wake-up, or that of a
		// lane returning with dead letters set aside, may be the one
		// drained above, so look at the pause and the lanes themselves.
		s.pauseParked = false
		if !s.e.paused.Load() || s.lanesReadyLocked() {
			s.mu.Unlock()
			return
		}
		// The drain may have put a due entry in the wheel: a batch that
		// became durable after the loop looked, whose wake-up was taken
		// as stale above. An awaited dead letter among it must go now,
		// not when this park ends (a second later; never on a clock that
		// does not move: TestPauseFiringStuckDLQLane hung).
		if next, ok := s.w.Next(); ok {
			if nowMs := s.e.nowMs(); next <= nowMs && nowMs >= s.w.Now() {
				s.mu.Unlock()
				return
			}
		}
	}
	if !hold && s.lanesReadyLocked() {
		s.mu.Unlock() // a lane returned: its parked tasks are due
		return
	}
	if !hold && s.releasedReadyLocked() {
		s.mu.Unlock() // a released task's retry became durable: it goes now
		return
	}
	now := s.e.clk.Now()
	if !hold {
		if next, ok := s.w.Next(); ok && next < wake {
			wake = next
		}
		// A lane that returned since the loop looked (its wake-up was
		// drained above as stale) may release held tasks now: the loop's
		// wake time left them out while the lane was busy.
		if at, ok := s.nextReleaseLocked(); ok && at < wake {
			wake = at
		}
	}
	if nowMs := now.UnixMilli(); wake <= nowMs && nowMs >= s.w.Now() {
		s.mu.Unlock()
		return
	}
	at := time.UnixMilli(wake)
	if !at.After(now) {
		// The wheel says something is due but yielded nothing (its time is
		// ahead of a wall clock that stepped back): wait, never fire early.
		at = now.Add(time.Millisecond)
	}
	// Timers run on the monotonic clock, due times on the wall clock: a
	// wall clock stepped forward (NTP, a VM resumed from suspend) is seen
	// within maxPark, not when a long timer ends (up to horizon/2).
	if at.Sub(now) > maxPark {
		at = now.Add(maxPark)
	}
	if h := s.e.testHookPark; h != nil {
		h()
	}
	// Armed for a time, not a duration from now: a clock that moved since
	// now was read must not push the wake-up out (a fake clock advanced
	// meanwhile fires it at once).
	timer.ResetAt(at)
	s.parked = true
	s.wakeAt = wake
	s.mu.Unlock()
	select {
	case <-ctx.Done():
	case <-timer.C():
	case <-s.notify:
	}
	s.mu.Lock()
	s.parked = false
	s.wakeAt = math.MinInt64
	s.mu.Unlock()
	if !timer.Stop() {
		select {
		case <-timer.C():
		default:
		}
	}
}

// stepBackMin is the smallest step back of the engine clock that
// rebaseLocked treats as one: less is the loop's own jitter.
const stepBackMin = time.Second

// rebaseLocked moves the shard's in-memory waits back with the clock when
// it stepped back (NTP correcting a clock that ran ahead): a lane's next
// look for held tasks, each down group's backoff end, the time of the
// lane's outage record and the next sweep of cancel markers keep what was
// left of them. So held tasks are released within Retry.Max of their
// target's return, not the step later, and an outage record still goes
// stale (the engine's record of each group's last release moves too:
// groupOutages.rebase). Due times do not move (a task is never fired early), and neither
// do the stored fire times of failed publishes waiting for their backoff:
// those wait the step out.
func (s *shard) rebaseLocked(now int64) {
	back := s.lastNow - now
	s.lastNow = now
	if back < stepBackMin.Milliseconds() {
		return
	}
	for l := range s.lanes {
		ln := &s.lanes[l]
		if ln.hold.next > now {
			ln.hold.next = max(now, ln.hold.next-back)
		}
		for g, d := range ln.hold.down {
			if d.until > now {
				d.until = max(now, d.until-back)
				ln.hold.down[g] = d
			}
		}
		for g, at := range ln.outage.groups {
			if at > now {
				ln.outage.groups[g] = max(math.MinInt64+back, at) - back
			}
		}
	}
	if s.nextSweep > now {
		s.nextSweep = max(now, s.nextSweep-back)
	}
	if s.id != 0 {
		return // one line for the engine
	}
	s.e.log.Warn("the clock stepped back: held tasks' waits moved back with it; retries of failed publishes wait their backoff plus the step",
		zap.Int("shard", s.id), zap.Duration("step", time.Duration(back)*time.Millisecond))
}

// housekeepLocked moves the horizon (clearFired, before it in the round,
// clears the tombstones of fired tasks when it is due to move).
func (s *shard) housekeepLocked(now int64) error {
	if s.horizonDueLocked(now) {
		return s.loadLocked(now)
	}
	return nil
}

// horizonDueLocked reports whether the loader is due to move the horizon.
func (s *shard) horizonDueLocked(now int64) bool { return now+s.e.horizonMs()/2 >= s.horizonEnd }

// clearFired covers the point tombstones that fired tasks left before
// the shard's first stored task with one range deletion, so recovery and
// the loader do not step over them one by one and compactions can drop
// them; the fire loop calls it on each round, without the shard lock, and
// it clears when the loader is due to move the horizon. The range holds
// nothing but tombstones: it ends at the first stored task (a batch a
// lane is publishing is still stored, so that is at or before it) and
// before the first task key of any batch decided but not applied yet
// (s.queue), which could otherwise be applied between the look and the
// deletion and be deleted with it. The store is looked at through an
// iterator made under the lock, with the decision, and every batch that
// stores a task key of the shard below the end decided there, and is
// decided after it, applies after the deletion (s.clearing, addOpLocked),
// so it has a higher sequence number; the range ends at or before that
// end, so the others (tasks due later: nearly all) need not wait. Only the
// decision is made under the lock: the look may step over many
// tombstones, and the deletion waits, as every write does, through a
// write stall of the store (a full disk), which used to hold the lock,
// and with it readiness (Err), lookups and ingest, until the stall ended
// (TestErrAnswersWhileClearWaitsForStall). A lost (unsynced) range
// deletion is harmless. The range ends at now at the latest (fired tasks
// were due by then): ended at the shard's first stored task, it did not
// move while that task stayed first (a long delay, a held task of
// hold.go, none: the shard's end), and the tombstones of every task fired
// below it later stayed. One is made only when tasks fired since the
// last: every range deletion in a memtable costs each new iterator some
// work. (It used to wait for an empty queue instead, which a source that
// never pauses never has: under steady load it never ran.)
func (s *shard) clearFired(now int64) {
	s.mu.Lock()
	if s.e.failed() != nil || s.firedSinceClear == 0 || !s.horizonDueLocked(now) {
		s.mu.Unlock()
		return
	}
	end := taskBound(s.id, now)
	first := wheelOp{fire: now} // (fire, seq) of end
	for _, pb := range s.queue {
		for _, op := range pb.ops {
			if op.fire < first.fire || op.fire == first.fire && op.seq < first.seq {
				first = op
			}
		}
	}
	if first.fire < now {
		end = appendTaskKey(nil, s.id, first.fire, first.seq)
	}
	it, err := s.e.db.NewIter(&pebble.IterOptions{LowerBound: taskBound(s.id, 0), UpperBound: end})
	if err != nil {
		s.mu.Unlock()
		return
	}
	tk := newTicket()
	s.clearing, s.clearEnd = tk, first
	fired := s.firedSinceClear
	s.mu.Unlock()
	defer func() {
		tk.release()
		s.mu.Lock()
		if s.clearing == tk {
			s.clearing = nil
		}
		s.mu.Unlock()
	}()
	if it.First() {
		end = append([]byte(nil), it.Key()...)
	}
	// No key because the read failed (an I/O error, a corrupt block) is
	// not "nothing stored": the range would take every stored task due
	// by now. No deletion then; the next round tries again.
	if err := errors.Join(it.Error(), it.Close()); err != nil {
		s.e.storeLines.failed(s.e.clk.Now(), zap.WarnLevel, msgClearReadFailed, s.id, err)
		return
	}
	s.e.storeLines.ok(s.e.clk.Now(), msgClearReadFailed, s.id)
	if h := s.e.testHookClear; h != nil {
		h(end)
	}
	err = safeCall(func() error { return s.e.db.DeleteRange(taskBound(s.id, 0), end, pebble.NoSync) })
	if err != nil {
		s.e.storeLines.failed(s.e.clk.Now(), zap.WarnLevel, msgClearFailed, s.id, err)
		return
	}
	s.e.storeLines.ok(s.e.clk.Now(), msgClearFailed, s.id)
	s.mu.Lock()
	s.clears++
	s.firedSinceClear -= fired // those fired meanwhile are cleared next time
	s.mu.Unlock()
}

// defaultLoadPage bounds the stored tasks one loadLocked reads into the
// wheel under the shard lock: at most about 1.3 ms here (BenchmarkLoadHerd).
// A herd of equal dues (every reminder for 09:00 Friday) is loaded over
// several rounds of the fire loop instead of holding the lock, and with
// it ingest and firing on the shard, for as long as the whole herd takes
// (21 ms for 400 k tasks, 60-90 ms while the wheel grows to hold them).
const defaultLoadPage = 16384

// loadLocked moves the horizon towards now+Horizon, putting the stored
// tasks from the old horizon to the new one in the wheel, at most
// e.loadPage of them a call. A page that stops short leaves the horizon
// at the next task's key, (fire, seq) (see horizonSeq), so the horizon
// may end inside a herd of equal dues; the fire loop calls again before
// it parks (housekeepLocked's condition holds while the horizon is less
// than half of Horizon ahead). A durable batch puts its tasks in the
// wheel only when their key is before the horizon, under the same lock,
// and the loader skips tasks of batches not yet drained (unwheeled), so
// each stored task enters the wheel exactly once, and equal dues in key
// (ingest) order.
func (s *shard) loadLocked(now int64) error {
	end := now + s.e.horizonMs()
	if end <= s.horizonEnd {
		return nil
	}
	it, err := s.e.db.NewIter(&pebble.IterOptions{
		LowerBound: appendTaskKey(nil, s.id, s.horizonEnd, s.horizonSeq),
		UpperBound: taskBound(s.id, end),
	})
	if err != nil {
		return fmt.Errorf("load shard %d: %w", s.id, err)
	}
	n, stopFire, stopSeq, stopped := 0, int64(0), uint64(0), false
	lastFire, lastSeq, passed := int64(0), uint64(0), false // the last key the scan passed
	for ok := it.First(); ok; ok = it.Next() {
		_, fire, seq, ok := parseTaskKey(it.Key())
		if !ok {
			continue
		}
		if n == s.e.loadPage {
			stopFire, stopSeq, stopped = fire, seq, true
			break
		}
		n++
		lastFire, lastSeq, passed = fire, seq, true
		if _, queued := s.unwheeled[seq]; queued && len(s.unwheeled) > 0 {
			continue // its ingest adds it once durable
		}
		if len(s.late) > 0 {
			if _, claimed := s.inflight[seq]; claimed {
				continue // a retry past the horizon released early (recover.go)
			}
		}
		h := s.w.Add(fire, seq)
		if len(s.late) > 0 {
			s.wheeledLateLocked(fire, seq, h) // a retry past the horizon when it failed
		}
	}
	err = it.Close()
	if err != nil {
		if passed {
			// A read failed mid-scan: the horizon ends just after the
			// last task passed, as a page that stops short, so the next
			// round goes on from there. Left where it was, the next
			// round added the tasks read before the failure a second
			// time, each claimed and published twice
			// (TestLoadReadErrorAtHorizon).
			s.horizonEnd, s.horizonSeq = lastFire, lastSeq+1
			s.inWheelG.Set(float64(s.w.Len()))
		}
		return fmt.Errorf("load shard %d: %w", s.id, err)
	}
	if stopped {
		s.horizonEnd, s.horizonSeq = stopFire, stopSeq
	} else {
		s.horizonEnd, s.horizonSeq = end, 0
	}
	s.inWheelG.Set(float64(s.w.Len()))
	return nil
}

// belowHorizonLocked reports whether a stored task at (fire, seq) is
// before the horizon: the loader has passed it, so the wheel must hold it.
func (s *shard) belowHorizonLocked(fire int64, seq uint64) bool {
	return fire < s.horizonEnd || fire == s.horizonEnd && seq < s.horizonSeq
}

const sweepBatch = 1024

// sweep deletes cancel markers whose retention has passed, up to
// sweepBatch a round. more reports a full round committed: there may be
// more to sweep now.
func (s *shard) sweep(now int64) (more bool, err error) {
	e := s.e
	s.mu.Lock()
	due := now >= s.nextSweep
	s.mu.Unlock()
	if !due {
		return false, nil
	}
	s.warmSweep(now)
	// (Only this loop moves nextSweep: the round is still due.)
	s.mu.Lock()
	it, err := e.db.NewIter(&pebble.IterOptions{
		LowerBound: expiryBound(s.id, 0),
		UpperBound: expiryBound(s.id, now+1),
	})
	if err != nil {
		s.mu.Unlock()
		return false, fmt.Errorf("sweep shard %d: %w", s.id, err)
	}
	b := e.db.NewBatch()
	idx := indexReader{db: e.db}
	tk := newTicket()
	pb := &pendingBatch{tk: tk}
	n := 0
	// A marker whose index entry cannot be read keeps its expiry key, so
	// a later round sweeps it once the read succeeds; the others go ahead.
	var lookErr error
	for ok := it.First(); ok && n < sweepBatch; ok = it.Next() {
		n++
		expiry, ik, ok := parseExpiryKey(it.Key())
		if !ok {
			b.Delete(it.Key(), nil)
			continue
		}
		var ex indexEntry
		found, err := s.lookupLocked(&idx, ik, &ex, tk)
		if err != nil {
			if lookErr == nil {
				lookErr = fmt.Errorf("sweep shard %d: cancel marker %q: %w", s.id, ik[1:], err)
			}
			continue
		}
		b.Delete(it.Key(), nil)
		if found && ex.Cancel && ex.Expiry == expiry {
			b.Delete(ik, nil)
			s.setOverlayLocked(string(ik), indexEntry{}, true, pb)
		}
	}
	idx.close()
	err = it.Close()
	if n == sweepBatch {
		s.nextSweep = now // more to do on the next round
	} else {
		s.nextSweep = now + min(max(e.opts.CancelRetention, time.Second), time.Minute).Milliseconds()
	}
	if err != nil || b.Empty() {
		s.abandonLocked(pb)
		s.mu.Unlock()
		tk.release()
		b.Close()
		if err != nil {
			return false, fmt.Errorf("sweep shard %d: %w", s.id, err)
		}
		if lookErr == nil {
			e.storeLines.ok(e.clk.Now(), msgSweepFailed, s.id)
		}
		return false, lookErr
	}
	s.enqueueLocked(pb)
	s.mu.Unlock()
	if err := s.commitDecided(tk, pb, b, "sweep", nil); err != nil {
		return false, err
	}
	if lookErr == nil {
		e.storeLines.ok(e.clk.Now(), msgSweepFailed, s.id)
	}
	return n == sweepBatch && lookErr == nil, lookErr
}

// warmSweep reads, without the shard lock, what the sweep round at now
// is about to read under it: the expired markers' expiry keys and their
// index entries. Their blocks are then in the block cache, and the round
// holds the lock for its lookups rather than for the disk: on a disk
// answering reads in 10 ms, a round of 1024 markers held it for about
// 4 s, and the shard's fire loop, Err (readiness), Lookup and every
// Ingest waited as long (TestSweepStalledReadHoldsNoShard). What it reads
// is only a hint: the round reads everything again under the lock, and
// it reports the errors.
func (s *shard) warmSweep(now int64) {
	it, err := s.e.db.NewIter(&pebble.IterOptions{
		LowerBound: expiryBound(s.id, 0),
		UpperBound: expiryBound(s.id, now+1),
	})
	if err != nil {
		return
	}
	idx := indexReader{db: s.e.db}
	var ex indexEntry
	n := 0
	for ok := it.First(); ok && n < sweepBatch; ok = it.Next() {
		n++
		if _, ik, ok := parseExpiryKey(it.Key()); ok {
			_, _ = idx.get(ik, &ex)
		}
	}
	idx.close()
	_ = it.Close()
}

// claimLocked takes up to FireBatch due entries from the wheel and marks
// them in flight, so a replace or cancel decided from now on leaves their
// outcome to the newer message. Entries an undurable replace or cancel is
// deleting are dropped here. The envelopes are read by readClaimed,
// outside the shard lock, so an Ingest waiting for this shard is not held
// up by store reads.
func (s *shard) claimLocked(now int64) []fireItem {
	// After a wall-clock step back the wheel's own time stays ahead of now;
	// AdvanceN then yields only entries added since with a due <= now, so
	// nothing fires early and tasks due in the gap are not held until the
	// clock regains its old time.
	var due []fireItem
	s.w.AdvanceN(now, s.e.opts.FireBatch, func(fire int64, seq uint64) {
		if _, ok := s.deleting[seq]; ok {
			return // a replace or cancel is deleting it
		}
		due = append(due, fireItem{fire: fire, seq: seq})
		s.inflight[seq] = notSuperseded
	})
	s.inWheelG.Set(float64(s.w.Len()))
	return due
}

// readClaimed reads and decodes the envelopes of claimed entries, without
// the shard lock. It returns the items to deliver and, in dropped, those
// not to deliver: a key that is gone was replaced or cancelled after it
// entered the wheel (lazy deletion); a corrupt envelope is left in the
// store and logged. Entries in retry could not be read and go back to the
// wheel, and so do those past the round's byte budget (FireBatchBytes;
// at least one task is read). The caller settles dropped and retry with
// settleClaimed. The entries from split on are released held tasks: when
// there are some, the due ones before them read at most half the budget
// and the held ones the rest (at least one task each), as the count rule
// gives held tasks at least half a batch, so neither starves the other.
func (s *shard) readClaimed(claimed []fireItem, split int) (items, dropped, retry []fireItem, err error) {
	if len(claimed) == 0 {
		return nil, nil, nil, nil
	}
	// One iterator over the batch's key range: the wheel yields in due
	// order, so each seek lands just after the previous one and Pebble
	// continues from there instead of searching every level again as a
	// point Get per task would.
	lo, hi := claimed[0].fire, claimed[0].fire
	for _, it := range claimed[1:] {
		lo, hi = min(lo, it.fire), max(hi, it.fire)
	}
	opts := &pebble.IterOptions{LowerBound: taskBound(s.id, lo), UpperBound: taskBound(s.id, hi+1)}
	iter, err := s.e.db.NewIter(opts)
	if err != nil {
		return nil, nil, claimed, fmt.Errorf("read tasks: %w", err)
	}
	defer func() {
		if iter != nil {
			iter.Close()
		}
	}()
	items = claimed[:0:len(claimed)]
	var key []byte
	var firstErr error
	stale := false // the iterator failed: its next seeks cannot be trusted
	read := 0      // bytes of the tasks decoded, see taskCost
	budget, dueItems := s.e.opts.FireBatchBytes, 0
	if split < len(claimed) {
		budget = max(budget/2, 1)
	}
	for i, it := range claimed {
		if i == split {
			budget, dueItems = s.e.opts.FireBatchBytes, len(items)
		}
		if i < split && read >= budget && len(items) > 0 {
			retry = append(retry, it)
			continue
		}
		if read >= budget && len(items) > dueItems {
			// The round's byte budget is spent: the rest goes back to
			// the wheel, due, and is claimed again next round. Without
			// it a batch was bounded by count only: 512 tasks of up to
			// max_message_bytes each, per shard and lane.
			retry = append(retry, claimed[i:]...)
			break
		}
		if stale {
			// After a failed read (a value failing its checksum, an I/O
			// error) Pebble's iterator answered the next seek with no key
			// and no error, and the tasks after it were taken as deleted:
			// gone from the wheel, still in the store. A new iterator for
			// the rest.
			iter.Close()
			if iter, err = s.e.db.NewIter(opts); err != nil {
				iter = nil
				retry = append(retry, claimed[i:]...)
				return items, dropped, retry, cmp.Or(firstErr, fmt.Errorf("read tasks: %w", err))
			}
			stale = false
		}
		key = appendTaskKey(key[:0], s.id, it.fire, it.seq)
		var v []byte
		ok := iter.SeekGE(key) && bytes.Equal(iter.Key(), key)
		err := iter.Error()
		var bad error // why the envelope cannot be decoded
		if ok && err == nil {
			if v, err = iter.ValueAndErr(); err != nil && pebble.IsCorruptionError(err) {
				// The stored value fails its checksum: no retry reads
				// it, so it is left in the store as an undecodable
				// envelope is, not retried in silence every round.
				bad, err, stale = fmt.Errorf("read task: %w", err), nil, true
			}
		}
		if err != nil {
			stale = true
			// Back to the wheel so it is not lost from memory; retried
			// next round.
			retry = append(retry, it)
			if firstErr == nil {
				firstErr = fmt.Errorf("read task: %w", err)
			}
			continue
		}
		if !ok {
			dropped = append(dropped, it)
			continue
		}
		t := new(codec.Task)
		if bad == nil {
			bad = codec.DecodeTask(v, t)
		}
		if bad != nil {
			// A corrupt envelope cannot be delivered or dead-lettered as
			// is; leave it in the store and say so.
			s.e.log.Error("fire: undecodable task left in store", zap.Int("shard", s.id),
				zap.Int64("fire_ms", it.fire), zap.Uint64("seq", it.seq), zap.Error(bad))
			it.corrupt, it.decodeErr = true, bad
			dropped = append(dropped, it)
			continue
		}
		it.task = t
		items = append(items, it)
		read += taskCost(len(v), t)
	}
	return items, dropped, retry, firstErr
}

// maxLogID bounds a task id in a log line: ids may be as long as a
// message allows, and a target that refuses every task logs a line each.
const maxLogID = 128

// LogID is id for a log line, cut to 128 bytes (at a UTF-8 boundary)
// with "..." when longer: ids may be as long as a message allows.
func LogID(id string) string { return LogCut(id, maxLogID) }

// LogCut is s for a log line, cut to n bytes (at a UTF-8 boundary) with
// "..." when longer: text a client sent (an id, a path, a method) may be
// as long as its request allows.
func LogCut(s string, n int) string {
	if len(s) <= n {
		return s
	}
	cut := n
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "..."
}

// DefaultFireBatchBytes is Options.FireBatchBytes's default: 4 MiB a
// round, so the tasks the fire loops hold decoded stay within about
// shards x 2 lanes x 4 MiB (64 MiB with 8 shards), whatever their size.
const DefaultFireBatchBytes = 4 << 20

// taskCost is the memory a decoded task holds: its envelope's bytes and
// the headers' own cost (an envelope of many empty headers decodes to
// many times its size).
func taskCost(envelope int, t *codec.Task) int {
	return envelope + codec.HeaderMemory*len(t.Headers)
}

// settleClaimed releases claimed entries that will not be delivered:
// dropped ones leave the in-flight set (and, when gone from the store, the
// failing dead letters; when undecodable, they join the shard's
// undecodable set unless a replace, cancel or drop is deleting them),
// retry ones also go back to the wheel.
func (s *shard) settleClaimed(dropped, retry []fireItem) {
	if len(dropped) == 0 && len(retry) == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, it := range dropped {
		sup, cancelSrc := s.endInflightLocked(it.seq)
		s.clearLateLocked(it.seq)
		switch {
		case !it.corrupt:
			s.dlGoneLocked(it.seq)
			// Gone from the store before it was read: a replace, a
			// cancel or an operator's drop claimed after the entry was
			// (counted here, as no delivery is left to count it), or an
			// older deletion.
			s.countUndeliveredLocked(sup, cancelSrc)
		case sup == notSuperseded:
			// A failing dead letter that no longer decodes is reported
			// as undecodable only, not as failing too (Err counted it in
			// both).
			_, failing := s.dlFailing[it.seq]
			s.dlGoneLocked(it.seq)
			s.noteUndecodableLocked(it.fire, it.seq, it.decodeErr, failing)
		default:
			// Undecodable, and a replace, cancel or drop deleting it:
			// no delivery is left to count that either (uncounted
			// before, and a replace since its ingest no longer counts
			// one in flight: TestSupersedeOfUndecodableInFlightCounted).
			s.countUndeliveredLocked(sup, cancelSrc)
		}
	}
	s.dlqClearedLocked()
	var again []releasedTask
	for _, it := range retry {
		again = s.sendBackLocked(it.fire, it.seq, it.released, again)
	}
	if len(again) > 0 {
		s.released = append(again, s.released...) // still first, in due order
	}
	s.inWheelG.Set(float64(s.w.Len()))
}

// sendBackLocked returns a claimed task, unread, to where it was claimed
// from: the wheel (a held one stays out: it is released again from the
// store, its lane's release cursor moved back to it), and a released one
// also to the release queue, through again, which the caller puts at the
// queue's front.
func (s *shard) sendBackLocked(fire int64, seq uint64, released bool, again []releasedTask) []releasedTask {
	// A replace, cancel or drop that met it is counted here, as for a
	// dropped entry: its next claim finds it gone, not superseded. (With
	// the byte budget, every round of large tasks sends some back.)
	s.countUndeliveredLocked(s.endInflightLocked(seq))
	s.addLocked(fire, seq)
	if isHeld(fire) {
		// A held one is released again from the store: from its place,
		// not after the lane's whole held range (R226). The cursor went
		// past it when it was claimed.
		if l := heldSlot(fire); l >= 0 && l < len(s.lanes) {
			if h := &s.lanes[l].hold; fire < h.cursorFire || fire == h.cursorFire && seq < h.cursorSeq {
				h.cursorFire, h.cursorSeq = fire, seq
			}
		}
	}
	if lt, ok := s.late[seq]; ok && released {
		// Back in the wheel at its retry time, not due: without going
		// back to the release queue too, a release of more than a
		// round's bytes left the rest to wait out their backoff (up to
		// Retry.Max).
		again = append(again, releasedTask{due: lt.due(), seq: seq})
	}
	return again
}

// shutdownDrain is how long a batch already handed to the sink may go on
// publishing after Run's context is cancelled.
const shutdownDrain = 5 * time.Second

// drainContext returns the context of one Deliver call: it outlives ctx by
// shutdownDrain. Cancelling a publish in flight does not unsend it (the
// broker may already hold the records), so a cancelled batch would be kept
// as undelivered and sent again after the restart; letting it finish makes
// a graceful stop free of duplicates. Call release when Deliver returned.
func drainContext(ctx context.Context) (dctx context.Context, release func()) {
	dctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(ctx, func() {
		t := time.NewTimer(shutdownDrain)
		defer t.Stop()
		select {
		case <-t.C:
			cancel()
		case <-dctx.Done():
		}
	})
	return dctx, func() { stop(); cancel() }
}

// deliver hands a batch to the sink and records the outcome in one synced
// commit: acknowledged tasks are deleted, failed ones rescheduled with
// backoff or dead-lettered. up and down are the target groups of the
// delivered tasks that waited for an outage and of the tasks that failed
// as unavailable, with names the targets that failed by group (for the
// outage lines), and begin when the publish began, for Engine.outcome
// (recover.go).
func (s *shard) deliver(ctx context.Context, sink Sink, items []fireItem) (fc *fireCommit, up, down []int64, names downTargets, begin int64) {
	e := s.e
	// Every task of a batch is of one lane, its target transport's (see
	// dispatch).
	tr := items[0].task.Transport
	ln := &s.lanes[transportSlot(tr)]
	s.mu.Lock()
	// Replaced, cancelled or dropped since the claim (while the envelopes
	// were read, while it waited aside, or since dispatch): not handed to
	// the sink, so a cancel that returned before the publish began holds.
	items = slices.DeleteFunc(items, func(it fireItem) bool {
		if s.inflight[it.seq] == notSuperseded {
			return false
		}
		s.unparkOneLocked(parkedOf(it))
		return true
	})
	if len(items) == 0 {
		s.mu.Unlock()
		return nil, nil, nil, nil, 0
	}
	// Until Deliver returns the batch is not delivered: Stats reports its
	// earliest due time as overdue meanwhile.
	batch := make([]*codec.Task, len(items))
	minDue := int64(noDue)
	for i := range items {
		batch[i] = items[i].task
		minDue = min(minDue, batch[i].Due)
	}
	ln.publishingDue = minDue
	if e.testHookBeginPublish != nil {
		e.testHookBeginPublish(batch)
	}
	s.mu.Unlock()
	// The sinks time their publishes (delaybridge_publish_seconds, by
	// transport).
	dctx, release := drainContext(ctx)
	begin = e.nowMs()
	errs := sink.Deliver(dctx, batch)
	release()
	ackAt := e.clk.Now()
	// The index keys of the batch (none for dead letters), built before
	// taking the lock.
	var ikBuf []byte
	ikEnd := make([]int, len(items))
	for i := range items {
		if t := items[i].task; t.Kind != codec.KindDeadLetter {
			ikBuf = appendIndexKey(ikBuf, t.Source, t.ID)
		}
		ikEnd[i] = len(ikBuf)
	}
	iks := newKeySpans(ikBuf, ikEnd)
	var lenErr error
	if errs != nil && len(errs) != len(items) {
		lenErr = fmt.Errorf("sink returned %d results for %d tasks", len(errs), len(items))
	}
	stopping := ctx.Err() != nil
	now := ackAt.UnixMilli()

	s.mu.Lock()
	ln.publishingDue = noDue
	b := e.db.NewBatch()
	tk := newTicket()
	pb := &pendingBatch{tk: tk}
	var (
		key, val []byte
		readds   []wheelOp
		// acked: acknowledged by the broker, superseded ones included
		// (counted as fired); replaced, cancelled: replaced or cancelled
		// in flight and not delivered.
		acked, replaced, cancelled []int
		retried                    []int
		// parkedNow: dead letters that entered the parked set, with
		// their refusal; unparked: parked ones their DLQ took at last
		parkedNow []dlRefusal
		unparked  []int
		// droppedNow: dead letters an operator dropped while in flight,
		// which their DLQ did not take (counted as dropped);
		// droppedAcked: such ones it took anyway (counted as fired).
		droppedNow   []dlDrop
		droppedAcked []int
		// outageErr: a failure that charged no attempt (ErrUnavailable),
		// and waiting how many tasks of the batch it held back.
		outageErr error
		waiting   int
		anyRetry  bool
		// heldUp, heldDown: the groups of released held tasks that were
		// acknowledged, that failed as unavailable again (hold.go).
		heldUp, heldDown []int64
		// stale: whether staleGroup was released after the publish
		// began (one lookup per group a batch fails for, not per task).
		staleGroup int64
		stale      bool
		// dlqFails: the DLQs that dead letters failed for and still fail
		// (not parked), with the last failure (dlqlog.go).
		dlqFails []dlqFailure
	)
	for i := range items {
		it := &items[i]
		t := it.task
		var derr error
		switch {
		case lenErr != nil:
			derr = lenErr
		case errs != nil:
			derr = errs[i]
		}
		sup, _ := s.endInflightLocked(it.seq) // a replace's or cancel's source: the task's
		if sup != notSuperseded {
			// Replaced or cancelled while in flight: the newer message
			// deleted this task and owns its index entry. Counted only:
			// delivered anyway, it was fired; not, the replace replaced
			// it or the cancel cancelled it.
			switch {
			case derr == nil:
				acked = append(acked, i)
				if sup.dropped() {
					droppedAcked = append(droppedAcked, i)
				}
			case sup == replacedInFlight:
				replaced = append(replaced, i)
			case sup == cancelledInFlight:
				cancelled = append(cancelled, i)
			case sup.dropped():
				droppedNow = append(droppedNow, dlDrop{i, sup.state()})
			}
			continue
		}
		indexed := t.Kind != codec.KindDeadLetter
		ik := iks.at(i)
		key = appendTaskKey(key[:0], s.id, it.fire, it.seq)
		oldKey := key
		if derr == nil {
			if lt, ok := s.clearLateLocked(it.seq); ok && lt.group() != 0 {
				up = appendGroup(up, lt.group())
				b.Delete(waitingKey(s.id, it.seq), nil)
			}
			b.Delete(oldKey, nil)
			if isHeld(it.fire) {
				pb.held[heldSlot(it.fire)]--
				heldUp = appendGroup(heldUp, groupOf(it.fire))
				up = appendGroup(up, groupOf(it.fire))
			}
			if indexed {
				b.Delete(ik, nil)
				s.setOverlayLocked(iks.str(i), indexEntry{}, true, pb)
			}
			pb.delta--
			acked = append(acked, i)
			if t.Kind == codec.KindDeadLetter {
				if e.deadLetterAcked(it.seq) {
					b.Delete(dlWaitKey(s.id, it.seq), nil)
				}
				if _, failing := s.dlFailing[it.seq]; failing {
					b.Delete(dlFailureKey(s.id, it.seq), nil)
				}
				if s.dlDoneLocked(it.seq) {
					unparked = append(unparked, i)
				}
			}
			continue
		}
		if stopping {
			// Shutting down: not an attempt; leave it for redelivery.
			readds = append(readds, wheelOp{it.fire, it.seq})
			continue
		}
		anyRetry = true
		// A task the sink rejected was not published: no attempt, and it
		// is dead-lettered below at once.
		var rejected *RejectedError
		isRejected := indexed && errors.As(derr, &rejected)
		unavailable := !isRejected && errors.Is(derr, ErrUnavailable)
		prev, waitsInMemory := s.late[it.seq]
		if unavailable && indexed && (isHeld(it.fire) || !waitsInMemory && len(s.late) >= e.opts.OutageMemory) {
			// Its target is unreachable and the shard holds as many
			// waiting tasks in memory as it may (one of them keeps its
			// place): held on disk until a release finds the target back
			// (hold.go). One held already stays as it is: an outage
			// charges no attempt.
			outageErr = derr
			waiting++
			retried = append(retried, i)
			if isHeld(it.fire) {
				s.heldDownLocked(it.fire, now)
				heldDown = appendGroup(heldDown, groupOf(it.fire))
				down = appendGroup(down, groupOf(it.fire))
				names = names.add(groupOf(it.fire), t.Target)
			} else {
				b.Delete(oldKey, nil)
				l := transportSlot(t.Transport)
				hf := heldFire(l, t.Target, t.Due)
				down = appendGroup(down, groupOf(hf))
				names = names.add(groupOf(hf), t.Target)
				val = codec.AppendTask(val[:0], t)
				b.Set(appendTaskKey(key[:0], s.id, hf, it.seq), val, nil)
				ne := indexEntry{Shard: s.id, Fire: hf, Seq: it.seq, Order: order{Stamp: t.Stamp, Partition: t.Partition, Incarnation: t.Incarnation, Offset: t.Offset}}
				b.Set(ik, appendIndexEntry(nil, &ne), nil)
				s.setOverlayLocked(iks.str(i), ne, false, pb)
				s.addOpLocked(pb, hf, it.seq) // not wheeled: past any horizon
				s.clearLateInLocked(b, it.seq)
				pb.held[l]++
			}
			continue
		}
		b.Delete(oldKey, nil)
		if isHeld(it.fire) {
			pb.held[heldSlot(it.fire)]--
		}
		var wait time.Duration
		group := int64(0) // its target's group if it waits for an outage
		switch {
		case isRejected:
		case unavailable:
			// The target broker is unreachable: not the task's fault, so
			// no attempt is charged and an outage of any length never
			// dead-letters it. It waits as long again as it is overdue
			// (doubling, within Initial..Max), or until another task of
			// its target is delivered (recover.go).
			wait = s.outageBackoff(now - t.Due)
			outageErr = derr
			waiting++
			group = heldGroup(transportSlot(t.Transport), t.Target)
			down = appendGroup(down, group)
			names = names.add(group, t.Target)
			if group != staleGroup {
				staleGroup, stale = group, e.releasedSince(group, begin)
			}
			if stale {
				// The publish began before the target was found back
				// and failed with what it said then: soon again, as
				// the released tasks went.
				wait = min(wait, e.opts.Retry.Initial)
			}
		default:
			t.Attempts++
			wait = s.backoff(t.Attempts)
			if indexed && int(t.Attempts) < e.opts.Retry.MaxAttempts {
				// Per target and reason: a second reason at one target
				// is not hidden behind the first (review R141).
				dest := t.Destination()
				if held, forgotten, ok := e.refusedLog.AllowEachForgotten(time.UnixMilli(now), dest+"\x00"+derr.Error()); ok {
					e.log.Warn("target refused a publish; retrying with backoff, then dead-lettered publish-failed",
						zap.String("target", dest), zap.String("source", t.Source), zap.String("id", LogID(t.ID)),
						zap.Uint32("attempt", t.Attempts), zap.Int("max_attempts", e.opts.Retry.MaxAttempts),
						zap.Duration("next_in", wait), zap.Int("held_back", held), logthrottle.Forgotten(forgotten), zap.Error(derr))
				}
			}
		}
		if t.Kind == codec.KindDeadLetter && !errors.Is(derr, ErrRefused) && e.deadLetterAwaited(it.seq) {
			// A source holds its input until this dead letter is taken,
			// and its DLQ fails as a whole (unreachable, not authorized,
			// no stream, full): tried again soon, so the source goes on
			// once the DLQ is back or fixed. One the DLQ refuses as this
			// message keeps its backoff, towards parking.
			wait = min(wait, awaitedDeadLetterWait)
		}
		if isRejected || (!errors.Is(derr, ErrUnavailable) && indexed && int(t.Attempts) >= e.opts.Retry.MaxAttempts) {
			code, detail := codec.CodePublishFailed, ""
			if isRejected {
				code, detail = rejected.Code, rejected.Error()
			} else {
				detail = fmt.Sprintf("publish to %s failed after %d attempts: %v", t.Destination(), t.Attempts, derr)
			}
			dl := codec.DeadLetter(t, code, detail)
			b.Delete(ik, nil)
			s.setOverlayLocked(iks.str(i), indexEntry{}, true, pb)
			val = codec.AppendTask(val[:0], &dl)
			b.Set(appendTaskKey(key[:0], s.id, now, it.seq), val, nil)
			s.addOpLocked(pb, now, it.seq)
			s.clearLateInLocked(b, it.seq)
			e.log.Warn("task dead-lettered at fire time", zap.String("code", string(code)),
				zap.String("origin", t.Origin), zap.String("dlq", dl.Destination()),
				zap.String("source", t.Source), zap.String("id", LogID(t.ID)), zap.Uint32("attempts", t.Attempts), zap.Error(derr))
			continue
		}
		fire := now + wait.Milliseconds()
		val = codec.AppendTask(val[:0], t)
		b.Set(appendTaskKey(key[:0], s.id, fire, it.seq), val, nil)
		if indexed {
			ne := indexEntry{Shard: s.id, Fire: fire, Seq: it.seq, Order: order{Stamp: t.Stamp, Partition: t.Partition, Incarnation: t.Incarnation, Offset: t.Offset}}
			b.Set(ik, appendIndexEntry(nil, &ne), nil)
			s.setOverlayLocked(iks.str(i), ne, false, pb)
		} else {
			// A dead letter. Only a refusal of this message (ErrRefused)
			// parks it, and only once the retry policy is used up: a DLQ
			// failing as a whole (unreachable, no permission, no stream,
			// full) holds its source until it is fixed (CONTRACT §3).
			refused := errors.Is(derr, ErrRefused) && int(t.Attempts) >= e.opts.Retry.MaxAttempts
			if refused {
				if _, held := e.deadLetterParked(it.seq); held {
					// Its source no longer waits for it, after a
					// restart neither.
					b.Delete(dlWaitKey(s.id, it.seq), nil)
				}
			}
			if s.dlFailedLocked(it.seq, fire, t.Destination(), derr, refused) {
				parkedNow = append(parkedNow, dlRefusal{i, derr})
			}
			// Kept with the retry, so that after a restart the engine
			// still reports it failing (or parked) before its next try.
			f := s.dlFailing[it.seq]
			b.Set(dlFailureKey(s.id, it.seq), appendDLFailure(nil, fire, f.parked, f.err), nil)
			if !f.parked {
				dlqFails = noteDLQ(dlqFails, f.dest, derr)
			}
		}
		s.addOpLocked(pb, fire, it.seq)
		// Dead letters too: one whose DLQ keeps failing is work overdue.
		s.noteLateLocked(it.seq, t.Due, fire, group)
		switch {
		case group != 0:
			// Kept with the retry, so that after a restart it is known
			// to wait for the outage, and a release takes it (recover.go).
			b.Set(waitingKey(s.id, it.seq), appendWaiting(nil, fire, packLate(t.Due, group)), nil)
		case waitsInMemory && prev.group() != 0:
			b.Delete(waitingKey(s.id, it.seq), nil) // it waits for a retry now, not an outage
		}
		retried = append(retried, i)
	}
	if pb.delta != 0 {
		b.Merge(countKey(s.id), u64(uint64(pb.delta)), nil)
	}
	writeHeldCounts(b, s.id, pb)
	op, obs := "fire", e.commitFire
	if anyRetry {
		op, obs = "retry", e.commitRetry
	}
	// Tasks left where they were (shutdown) go back in the wheel at once.
	for _, op := range readds {
		s.addLocked(op.fire, op.seq)
	}
	s.inWheelG.Set(float64(s.w.Len()))
	if b.Empty() {
		s.mu.Unlock()
		tk.release()
		b.Close()
	} else {
		// Apply in turn and let the shard's committer wait for the fsync,
		// so the next due batch is delivered meanwhile. Rescheduled tasks
		// enter the wheel once durable.
		s.enqueueLocked(pb)
		s.mu.Unlock()
		start := time.Now()
		applied, err := e.applyInOrder(tk, b, op)
		if err != nil || !applied {
			s.mu.Lock()
			s.abandonLocked(pb)
			s.mu.Unlock()
			// Nothing of this round is recorded; the tasks stay stored and
			// are delivered again after a restart.
			if err == nil {
				err = errors.New("not applied")
			}
			e.storeLines.failed(e.clk.Now(), zap.ErrorLevel, msgFireCommitFailed, s.id, err)
			return nil, nil, nil, nil, 0
		}
		fc = &fireCommit{b: b, pb: pb, start: start, obs: obs, op: op}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.firedSinceClear += len(acked)
	for _, i := range replaced {
		e.m.Replaced.WithLabelValues(items[i].task.Source).Inc()
	}
	for _, i := range cancelled {
		e.m.Cancelled.WithLabelValues(items[i].task.Source).Inc()
	}
	for _, d := range droppedNow {
		e.m.StuckDropped.WithLabelValues(string(d.state)).Inc()
	}
	for _, i := range droppedAcked {
		t := items[i].task
		e.log.Info("a dead letter dropped by an operator while it was being published reached its DLQ anyway",
			zap.Int("shard", s.id), zap.Uint64("seq", items[i].seq), zap.String("source", t.Source),
			zap.String("origin", t.Origin), zap.String("dlq", t.Destination()))
	}
	for _, i := range acked {
		t := items[i].task
		kind := "task"
		if t.Kind == codec.KindDeadLetter {
			kind = "dlq"
			e.m.DeadLettered.WithLabelValues(string(t.Code)).Inc()
		}
		tr := t.Transport.String()
		e.m.Fired.WithLabelValues(tr, kind).Inc()
		if kind == "task" {
			// From the task's due time, not its place in the store: a
			// task delivered after retries or an outage was that late.
			// A task published already overdue (delay-at in the past)
			// counts from its broker time: the bridge could not fire it
			// before it existed (delaybridge_overdue_total counts it).
			from := max(t.Due, t.Stamp)
			e.m.FireLateness.WithLabelValues(tr).Observe(float64(max(now-from, 0)) / 1000)
		}
	}
	for _, i := range retried {
		e.m.PublishRetries.WithLabelValues(items[i].task.Transport.String()).Inc()
	}
	for _, p := range parkedNow {
		e.dlqLines.parked(ackAt, s.id, items[p.i].task, p.err)
	}
	for _, i := range unparked {
		t := items[i].task
		dest := t.Destination()
		if held, forgotten, ok := e.unparkedLog.AllowEachForgotten(ackAt, dest); ok {
			e.log.Info("parked dead letter taken by its DLQ at last", zap.Int("shard", s.id),
				zap.String("source", t.Source), zap.String("origin", t.Origin),
				zap.String("dlq", dest), zap.Uint32("attempts", t.Attempts),
				zap.Int("held_back", held), logthrottle.Forgotten(forgotten))
		}
	}
	s.heldOutcomeLocked(ln, heldUp, heldDown)
	if o := &ln.outage; outageErr != nil || o.err != nil {
		s.outageOutcomeLocked(o, tr, items, acked, up, down, outageErr, waiting, begin, now)
	}
	s.logDLQsLocked(ackAt, dlqFails, items, acked)
	return fc, up, down, names, begin
}

// logDLQsLocked tells the engine's dlqLines, at now, about the DLQs the
// round's dead letters failed for (fails), each DLQ the round delivered
// dead letters to (those of items at acked), and those of which the
// shard has no dead letter failing any more (dlqClearedLocked), in that
// order: a DLQ that took one dead letter of the shard and failed for
// another in the round still fails, and one whose last failing dead
// letter of the shard it took is not taken for one whose failing dead
// letters were all dropped (TestDLQRecoveredAcrossShards). Per DLQ: a second DLQ that began to
// fail while another failed in every shard was never logged (hunt H204);
// once per engine, not per shard (review R200). Failures read at open
// were logged then (logRestoredDLQs).
func (s *shard) logDLQsLocked(now time.Time, fails []dlqFailure, items []fireItem, acked []int) {
	e := s.e
	for _, f := range fails {
		n := 0
		if d := s.dlByDest[f.dest]; d != nil {
			n = d.n
		}
		e.dlqLines.failed(now, s.id, f, n)
	}
	defer s.dlqClearedLocked()
	if e.dlqLines.active.Load() == 0 {
		return
	}
	var done []string
	for _, i := range acked {
		t := items[i].task
		if t.Kind != codec.KindDeadLetter {
			continue
		}
		dest := t.Destination()
		if slices.Contains(done, dest) {
			continue
		}
		done = append(done, dest)
		left := 0
		if d := s.dlByDest[dest]; d != nil {
			left = d.n
		}
		e.dlqLines.delivered(now, s.id, dest, left)
	}
}

// dlqClearedLocked tells the engine's dlqLines of each DLQ in dlqLeft
// that the shard still has no dead letter of failing (parked ones
// aside).
func (s *shard) dlqClearedLocked() {
	if len(s.dlqLeft) == 0 && len(s.dlqParkGone) == 0 {
		return
	}
	for _, dest := range s.dlqLeft {
		if _, failing := s.dlByDest[dest]; !failing {
			s.e.dlqLines.cleared(s.e.clk.Now(), s.id, dest, slices.Contains(s.dlqGone, dest))
		}
	}
	for _, dest := range s.dlqParkGone {
		s.e.dlqLines.parkGone(s.e.clk.Now(), dest)
	}
	s.dlqLeft, s.dlqGone, s.dlqParkGone = s.dlqLeft[:0], s.dlqGone[:0], s.dlqParkGone[:0]
}

// dlDrop is a dead letter of a fire batch (its index) that an operator
// dropped while it was in flight, with its state at the drop.
type dlDrop struct {
	i     int
	state StuckState
}

// dlRefusal is a dead letter of a fire batch (its index) that entered the
// parked set, with the refusal that parked it.
type dlRefusal struct {
	i   int
	err error
}

// outageBackoff is the wait before the next try of a task that failed
// only because its target broker was unreachable, overdueMs after its due
// time: as long again (so the waits double), within Retry.Initial and
// Retry.Max, with +-Jitter.
func (s *shard) outageBackoff(overdueMs int64) time.Duration {
	r := s.e.opts.Retry
	d := min(max(time.Duration(min(max(overdueMs, 0), math.MaxInt64/int64(time.Millisecond)))*time.Millisecond, r.Initial), r.Max)
	// Capped after the jitter: a wait is never longer than Max (README:
	// delivered after the outage at most retry.max late). At the cap the
	// jitter still spreads the waits, over Max*(1-Jitter)..Max.
	return min(jitterDuration(float64(d), r.Jitter, s.rng.Float64()), r.Max)
}

// awaitedDeadLetterWait bounds the wait before the next try of a dead
// letter a source waits for (its offsets, or on NATS its whole consumer,
// hold until the DLQ takes it) while its DLQ fails as a whole. The
// outage backoff alone grows to Retry.Max (5 min by default): after an
// outage that long the source went on reading only up to 5 min after its
// broker was back (hunt H172). So did the attempts' backoff of a DLQ
// that fails otherwise (not authorized, no stream, full: 3m57s and 2m35s
// after the fix of a 10 min failure, hunt H173). There are few such dead
// letters at a time (a source holds at the first batch with one), so
// trying each every few seconds costs little.
const awaitedDeadLetterWait = 2 * time.Second

// backoff is the delay before attempt n+1 after n failed publishes:
// Initial*Multiplier^(n-1), capped at Max, with +-Jitter.
func (s *shard) backoff(attempts uint32) time.Duration {
	r := s.e.opts.Retry
	d := float64(r.Initial) * math.Pow(r.Multiplier, float64(min(attempts, 64))-1)
	if d > float64(r.Max) || math.IsInf(d, 0) || math.IsNaN(d) {
		d = float64(r.Max)
	}
	return min(jitterDuration(d, r.Jitter, s.rng.Float64()), r.Max)
}

// jitterDuration is d nanoseconds moved by up to +-jitter (u: a uniform
// draw in [0, 1)), at least 1 ms. A wait past the Duration range (a
// Retry.Max of centuries, raised by the jitter) is clamped to it: converted
// as it is, it wrapped to a negative Duration, and so to 1 ms.
func jitterDuration(d, jitter, u float64) time.Duration {
	if jitter > 0 {
		d *= 1 + jitter*(2*u-1)
	}
	if !(d < float64(math.MaxInt64)) { // also NaN
		return math.MaxInt64
	}
	return max(time.Duration(d), time.Millisecond)
}

// transportSlots indexes per-transport state (shard.lanes) by
// codec.Transport (its values are small: 1 Kafka, 2 NATS; 0 and others
// share slot 0).
const transportSlots = 3

func transportSlot(t codec.Transport) int {
	if int(t) < transportSlots {
		return int(t)
	}
	return 0
}

// outageState is a shard's view of one target transport's outage.
type outageState struct {
	err error // the last ErrUnavailable; nil when no group is down
	// groups are the target groups (heldGroup) whose last delivery
	// failed as unavailable, each with when (ms). Only a delivery to a
	// target of the group ends its outage: one Kafka topic without
	// enough in-sync replicas among healthy ones is an outage until it
	// takes writes, not until the next healthy delivery (hunt H177: one
	// Warn and one Info line per healthy delivery, and readiness
	// flapping with which topic the last batch held).
	groups map[int64]int64
}

// latest is when a group of o last failed (ms, engine clock), 0 if none.
func (o outageState) latest() int64 {
	var at int64
	for _, t := range o.groups {
		at = max(at, t)
	}
	return at
}

// outageOutcomeLocked records in o (the lane of transport tr) what a
// delivered batch says of its target groups: down, those of its tasks
// that failed as unavailable (the last such failure outageErr, waiting
// tasks held back by it); acked, the indexes of its tasks delivered; up,
// the groups of those of them that waited for an outage (in memory or
// held). A group is down from a failure until a task that waited for it
// is delivered in a batch that fails none of it (a target partly down
// stays down), or until a task of it that did not wait is delivered by a
// publish that began (begin) after the group had not failed for Retry.Max
// (every waiting task is retried within Retry.Max, so none of this
// shard's waits for it any more; a publish that began before may have
// held the lane while a waiting task's retry came due, and ended after:
// its acknowledgement says nothing of that retry), or
// until it has not failed for twice Retry.Max (its tasks left the store
// some other way). A task that did not wait ending the outage at once
// made a Kafka topic with one partition without a leader flap: every
// delivery to its other partitions logged "reachable again" and the next
// retry of a waiting task "unreachable" (hunt H180: some 430 lines of
// each a minute with 8 shards at 20 tasks/s), and readiness flipped with
// them. The transport's outage, logged and reported by readiness, lasts
// while any group of it is down. Called only while the lane is in an
// outage or the batch put it in one, so a delivery outside an outage
// hashes no target.
func (s *shard) outageOutcomeLocked(o *outageState, tr codec.Transport, items []fireItem, acked []int, up, down []int64, outageErr error, waiting int, begin, now int64) {
	wasDown := o.err != nil
	if outageErr != nil {
		if o.groups == nil {
			o.groups = make(map[int64]int64)
		}
		for _, g := range down {
			o.groups[g] = now
		}
		o.err = outageErr
	}
	for _, i := range acked {
		t := items[i].task
		g := heldGroup(transportSlot(t.Transport), t.Target)
		at, ok := o.groups[g]
		if !ok || slices.Contains(down, g) {
			continue
		}
		if slices.Contains(up, g) || begin-at > max(s.e.opts.Retry.Max, time.Second).Milliseconds() {
			delete(o.groups, g)
		}
	}
	stale := 2 * max(s.e.opts.Retry.Max, time.Second).Milliseconds()
	for g, at := range o.groups {
		if now-at > stale {
			delete(o.groups, g)
		}
	}
	if len(o.groups) == 0 {
		o.err, o.groups = nil, nil
	}
	switch {
	case !wasDown && o.err != nil:
		s.e.log.Warn("target broker unreachable; due tasks wait for it without using their retry budget",
			zap.Int("shard", s.id), zap.Stringer("transport", tr), zap.Int("tasks", waiting), zap.Error(outageErr))
	case wasDown && o.err == nil:
		s.e.log.Info("target broker reachable again", zap.Int("shard", s.id), zap.Stringer("transport", tr))
	}
}

// outageErr reports the target transports whose last delivery failed as
// unavailable (the tasks wait without using their retry budget), so that
// readiness says why due tasks are not delivered. A sink's own Health
// only sees connection-level failures; a broker that answers "cannot take
// writes now" (no leader, too few in-sync replicas, JetStream 503) is an
// outage too. An outage not confirmed for twice Retry.Max (every waiting
// task is retried within Retry.Max) is stale: its tasks left the store
// some other way (cancelled, replaced, dropped).
func (e *Engine) outageErr() error {
	now := e.nowMs()
	stale := 2 * max(e.opts.Retry.Max, time.Second).Milliseconds()
	var per [transportSlots]struct {
		err    error // the latest over the shards
		at     int64 // when
		shards int
	}
	for _, s := range e.shards {
		s.mu.Lock()
		for tr := range s.lanes {
			ln, p := &s.lanes[tr], &per[tr]
			// Not stale while a batch of that transport is in the sink:
			// its retry has not answered yet (a held produce).
			if o := ln.outage; o.err != nil {
				if at := o.latest(); now-at <= stale || ln.busy {
					p.shards++
					if p.err == nil || at > p.at {
						p.err, p.at = o.err, at
					}
				}
			}
		}
		s.mu.Unlock()
	}
	var errs []error
	for tr, p := range per {
		if p.err != nil {
			errs = append(errs, fmt.Errorf("shard: %s target unavailable (%d shards with due tasks waiting for it, no retry budget used): %w",
				codec.Transport(tr), p.shards, p.err))
		}
	}
	return errors.Join(errs...)
}
