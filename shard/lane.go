package shard

import (
	"context"
	"strings"
	"sync"
	"time"
)

// Lanes. A fire batch goes to the sink one target transport at a time:
// each shard keeps one lane per transport (codec.Transport, as
// transportSlot indexes it), and each lane has at most one batch in the
// sink. While a lane publishes, the fire loop waits for it, as it always did (the loop
// neither claims nor reads ahead: on two cores that took CPU from the
// publishes, docs/benchmarks.md). But a lane whose batch has been in the
// sink for longer than Options.LaneGrace is stuck (a broker that holds a
// produce without answering: kafka-go waits WriteTimeout per attempt, a
// JetStream without PubAcks PublishTimeout), and the loop goes on without
// it: it claims the next due tasks, hands the other transport's to their
// lane, and sets the stuck lane's aside (parked: their fire time and seq
// only, the envelope is dropped; still claimed) until its batch returns.
// Then the loop takes them back first, a batch at a time, and reads them
// once more (takeParkedLocked), rather than putting them in the wheel,
// where every stuck period of a slow target would claim, read and set
// aside its whole backlog again. So a target that hangs, or is slow,
// delays its own transport's tasks, not the other's, and each task is
// read at most twice. A lane whose transport is in an outage is passed at
// once, not after the grace (laneWaitLocked): a down broker fails each
// batch within it.
//
// A parked task stays in flight for replace and cancel (it was claimed):
// one that a replace, cancel or drop meets is never handed to the sink;
// it goes back to the wheel, where the claim finds its key gone, and a
// cancel is counted then. The same holds for a claimed task superseded
// before its lane hands it to the sink (deliver checks under the lock,
// right before the publish), so a cancel that returned before the publish
// began always holds.

// lane is one target transport's fire batches in a shard (under shard.mu).
type lane struct {
	busy  bool      // a batch of this lane is in the sink
	since time.Time // when it was handed to the sink (real time)
	// publishingDue: the earliest due time of that batch, noDue when
	// none. Stats counts it as overdue: claimed, not delivered yet.
	publishingDue int64
	parked        []parkedTask
	outage        outageState // the transport's, until a delivery to it is acknowledged
	hold          holdState   // its tasks held on disk through an outage (hold.go)
}

// parkedTask is a due task claimed while its lane was stuck.
type parkedTask struct {
	fire   int64
	seq    uint64
	due    int64  // for Stats: a retry's fire time is after its due
	source string // for the cancelled metric
	// released: claimed by a release (fireItem.released). Kept aside too:
	// taken back past the round's byte budget, it must go back to the
	// release queue, not wait out its backoff (hunt H174).
	released bool
}

// parkedOf is the parked form of a claimed item. Its source is a copy:
// DecodeTask keeps all of a task's strings in one block, which a substring
// would keep alive (the id, target, origin...: kilobytes for a long id) for
// as long as the task waits aside, and a herd claimed while its lane waits
// may set aside every task due.
func parkedOf(it fireItem) parkedTask {
	return parkedTask{fire: it.fire, seq: it.seq, due: it.task.Due, source: strings.Clone(it.task.Source), released: it.released}
}

// laneWaitLocked reports whether a lane is publishing a batch for less
// than LaneGrace, and how long until it would count as stuck. A lane whose
// transport is in an outage (its last delivery failed with ErrUnavailable)
// is not waited for: its batch is expected to fail again, and a broker
// that refuses connections fails each batch well within the grace, so
// waiting for it would hold the other transport's due tasks behind one
// failing round per FireBatch of the down transport's backlog. Its tasks
// wait aside until the batch returns, as a stuck lane's do.
func (s *shard) laneWaitLocked(now time.Time) (wait time.Duration, busy bool) {
	for l := range s.lanes {
		ln := &s.lanes[l]
		if !ln.busy || ln.outage.err != nil {
			continue
		}
		if left := s.e.opts.LaneGrace - now.Sub(ln.since); left > 0 && (!busy || left < wait) {
			wait, busy = left, true
		}
	}
	return wait, busy
}

// awaitLane waits until a lane returns its batch (or anything else wakes
// the loop), d passes, or ctx is done.
func (s *shard) awaitLane(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	case <-s.notify:
	}
}

// dispatch hands each lane its part of items, in due order: to a goroutine
// that delivers it and sends its commit, or, while the lane still has a
// batch in the sink, to the lane's parked tasks.
func (s *shard) dispatch(ctx context.Context, sink Sink, items []fireItem, commits chan<- *fireCommit, wg *sync.WaitGroup) {
	var parts [transportSlots][]fireItem
	for _, it := range items {
		l := transportSlot(it.task.Transport)
		parts[l] = append(parts[l], it)
	}
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	for l, part := range parts {
		if len(part) == 0 {
			continue
		}
		ln := &s.lanes[l]
		// While the lane has a batch in the sink, all of its part waits;
		// else what exceeds a batch (parked tasks taken back plus new
		// ones) does.
		n := min(len(part), s.e.opts.FireBatch)
		switch {
		case ln.busy:
			n = 0
		case len(ln.parked) > 0:
			// Older tasks still wait aside: the lane returned after this
			// round took its parked ones (none, or a batch of them). Only
			// those taken go now; the new ones go behind the rest, or a
			// stuck lane's backlog went out after later claims.
			k := 0
			for k < n && part[k].parked {
				k++
			}
			n = k
		}
		for _, it := range part[n:] {
			ln.parked = append(ln.parked, parkedOf(it))
		}
		if part = part[:n]; len(part) == 0 {
			continue
		}
		ln.busy, ln.since = true, now
		if h := s.e.testHookDispatch; h != nil {
			h(part)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			fc, up, down, names, begin := s.deliver(ctx, sink, part)
			if fc != nil {
				commits <- fc
			}
			// A target back from an outage: what waits for it in every
			// shard goes now (recover.go). Before the lane is free, so
			// that a shard looks idle only once it was told.
			s.e.outcome(up, down, names, begin)
			// Its parked tasks stay claimed: the loop hands them to the
			// lane next (takeParkedLocked), read once more, rather than
			// putting them back in the wheel, where every stuck period
			// would claim, read and set aside the whole backlog again.
			s.mu.Lock()
			ln.busy = false
			// Not parked any more as far as anyone can see (as addLocked
			// does): the wake-up below makes the loop look again, and
			// until it does nothing may take the shard for idle.
			s.parked = false
			s.mu.Unlock()
			if h := s.e.testHookLaneDone; h != nil {
				h()
			}
			s.wake()
		}()
	}
}

// takeParkedLocked takes up to max parked tasks of the lanes that have no
// batch in the sink, oldest first, as claimed items (still in flight) for
// the loop to read and dispatch. One a replace, cancel or drop met
// meanwhile goes back to the wheel as unparkLocked does.
func (s *shard) takeParkedLocked(max int) []fireItem {
	var out []fireItem
	// While firing is paused only the dead letters a source waits for
	// go; the rest is sent back where it was claimed from (the wheel,
	// where claimPausedLocked sets the due ones aside, and the release
	// queue), out of flight, as if never claimed (R224: a stuck lane's
	// parked tasks reached their target during a pause).
	paused := s.e.paused.Load()
	if paused {
		s.e.dl.mu.Lock()
		defer s.e.dl.mu.Unlock()
	}
	var again []releasedTask
	for l := range s.lanes {
		ln := &s.lanes[l]
		if ln.busy || len(ln.parked) == 0 {
			continue
		}
		k := 0
		for ; k < len(ln.parked) && len(out) < max; k++ {
			p := ln.parked[k]
			if s.inflight[p.seq] != notSuperseded {
				s.unparkOneLocked(p)
				continue
			}
			if paused && !s.e.deadLetterAwaitedLocked(p.seq) {
				again = s.sendBackLocked(p.fire, p.seq, p.released, again)
				continue
			}
			out = append(out, fireItem{fire: p.fire, seq: p.seq, parked: true, released: p.released})
		}
		ln.parked = ln.parked[k:]
		if len(ln.parked) == 0 {
			ln.parked = nil
		}
	}
	if len(again) > 0 {
		s.released = append(again, s.released...) // still first, in due order
	}
	s.inWheelG.Set(float64(s.w.Len()))
	return out
}

// lanesReadyLocked reports whether a lane with no batch in the sink has
// parked tasks to take.
func (s *shard) lanesReadyLocked() bool {
	for l := range s.lanes {
		if ln := &s.lanes[l]; !ln.busy && len(ln.parked) > 0 {
			return true
		}
	}
	return false
}

// unparkLocked puts a lane's parked tasks back in the wheel. One that a
// cancel met meanwhile is counted cancelled now (the broker did not take
// it), one an operator dropped as dropped; they go back in the wheel all
// the same, where the claim finds their key gone (or skips it while the
// deleting batch is not durable; abandoned, the task is simply due).
func (s *shard) unparkLocked(ln *lane) {
	for _, p := range ln.parked {
		s.unparkOneLocked(p)
	}
	ln.parked = nil
	s.inWheelG.Set(float64(s.w.Len()))
}

func (s *shard) unparkOneLocked(p parkedTask) {
	sup, _ := s.endInflightLocked(p.seq)
	s.countUndeliveredLocked(sup, p.source) // a replace's or cancel's source: the task's
	s.addLocked(p.fire, p.seq)
}

// countUndeliveredLocked counts a claimed task that leaves the in-flight
// set without a delivery to count it: replaced or cancelled (by a
// message of source src, or an admin cancel) or dropped by an operator
// while claimed.
func (s *shard) countUndeliveredLocked(sup supersession, src string) {
	switch {
	case sup == replacedInFlight:
		s.e.m.Replaced.WithLabelValues(src).Inc()
	case sup == cancelledInFlight:
		s.e.m.Cancelled.WithLabelValues(src).Inc()
	case sup.dropped():
		s.e.m.StuckDropped.WithLabelValues(string(sup.state())).Inc()
	}
}

// lanesDueLocked reports, for Stats, the tasks claimed but not delivered:
// due is the earliest due time of the batches in the sink and the parked
// tasks (noDue if none), fire the earliest fire time of the parked ones
// (ok false if none). A parked task a replace or cancel met is gone from
// the store and not counted.
func (s *shard) lanesDueLocked() (due, fire int64, ok bool) {
	due, fire = noDue, noDue
	for l := range s.lanes {
		ln := &s.lanes[l]
		due = min(due, ln.publishingDue)
		for _, p := range ln.parked {
			if s.inflight[p.seq] != notSuperseded {
				continue
			}
			due = min(due, p.due)
			if !isHeld(p.fire) { // a released held task: no fire time
				fire, ok = min(fire, p.fire), true
			}
		}
	}
	return due, fire, ok
}
