package shard

import (
	"github.com/cockroachdb/pebble/v2"

	"github.com/delaybridge/delaybridge/wheel"
)

// Tasks whose delivery failed wait in the wheel at their retry time, not
// their due time, so neither the wheel nor the store order tells how long
// they have been overdue. The shard keeps the due time of each (late) for
// Stats' oldest overdue, with the smallest cached: a task leaves when it is
// delivered, dead-lettered, replaced or cancelled, or found gone at claim.
// Only failing tasks are kept: during an outage, the due tasks in the wheel
// within the horizon, about 75 bytes each. With the due time the shard
// keeps each one's fire time, wheel entry and, when it waits for an
// outage, its target's group, so that a release (recover.go) can take it
// out of the wheel and deliver it at once. Such a task also has a waiting
// record in the store (appendWaiting) for as long as it has a group here,
// so that after a restart it is known to wait again.

// lateTask is a task waiting for a retry (in shard.late, by seq): 24
// bytes, about 75 with the map's own (80 measured at 512 k entries; 100
// with the group in a field of its own, 36 for the due time alone).
type lateTask struct {
	// dg holds its due time (ms) in the low heldDueBits and, above them,
	// its target group's index + 1 when its last failure was an outage
	// (ErrUnavailable), else 0: such a task goes at once when another of
	// its group is delivered after the outage (recover.go).
	dg   int64
	fire int64 // its retry's fire time, the one in its t key
	// h is its wheel entry at fire once its retry is durable and below
	// the horizon (zero until then): a release (recover.go) takes it out
	// of the wheel to deliver it at once.
	h wheel.Handle
}

// due is the task's due time (ms), for Stats.
func (lt lateTask) due() int64 { return lt.dg & heldDueMask }

// group is the task's target group (heldGroup) if it waits for an
// outage, else 0.
func (lt lateTask) group() int64 {
	if i := lt.dg >> heldDueBits; i != 0 {
		return heldBase + (i-1)<<heldDueBits
	}
	return 0
}

// packLate is the dg of a task due at due waiting for group (0: none).
func packLate(due, group int64) int64 {
	dg := min(max(due, 0), heldDueMask)
	if group != 0 {
		dg |= ((group-heldBase)>>heldDueBits + 1) << heldDueBits
	}
	return dg
}

// noteLateLocked records that the task seq, due at due (ms), failed a
// delivery and waits for a retry at fire; group is its target's group if
// the failure was an outage, else 0.
func (s *shard) noteLateLocked(seq uint64, due, fire, group int64) {
	if s.late == nil {
		s.late = make(map[uint64]lateTask)
	}
	if _, ok := s.late[seq]; !ok && (len(s.late) == 0 || due < s.lateMin) && !s.lateDirty {
		s.lateMin = due
	}
	s.late[seq] = lateTask{dg: packLate(due, group), fire: fire}
}

// clearLateLocked forgets seq and returns what was known of it (ok false
// unless it failed a delivery).
func (s *shard) clearLateLocked(seq uint64) (lt lateTask, ok bool) {
	lt, ok = s.late[seq]
	if !ok {
		return lt, false
	}
	delete(s.late, seq)
	if lt.due() <= s.lateMin {
		s.lateDirty = true
	}
	if len(s.late) == 0 {
		s.late, s.lateDirty = nil, false // give the map's memory back after an outage
	}
	return lt, true
}

// clearLateInLocked is clearLateLocked for a task b deletes or moves:
// the record of a task waiting for an outage (appendWaiting) is deleted
// in b too.
func (s *shard) clearLateInLocked(b *pebble.Batch, seq uint64) {
	if lt, ok := s.clearLateLocked(seq); ok && lt.group() != 0 {
		b.Delete(waitingKey(s.id, seq), nil)
	}
}

// wheeledLateLocked notes that seq entered the wheel at fire with handle
// h, if it is a task waiting for a retry at fire.
func (s *shard) wheeledLateLocked(fire int64, seq uint64, h wheel.Handle) {
	if lt, ok := s.late[seq]; ok && lt.fire == fire {
		lt.h = h
		s.late[seq] = lt
	}
}

// oldestLateLocked returns the earliest due time of the tasks waiting for
// a retry.
func (s *shard) oldestLateLocked() (int64, bool) {
	if len(s.late) == 0 {
		return 0, false
	}
	if s.lateDirty {
		first := true
		for _, lt := range s.late {
			if first || lt.due() < s.lateMin {
				s.lateMin, first = lt.due(), false
			}
		}
		s.lateDirty = false
	}
	return s.lateMin, true
}

// noDue is lane.publishingDue when no batch is in the sink's Deliver.
const noDue = int64(^uint64(0) >> 1)

// writeWaitDels adds to b the deletion of the waiting records of the
// tasks pb deletes (a replace, cancel or drop of a task waiting for an
// outage).
func writeWaitDels(b *pebble.Batch, shard int, pb *pendingBatch) {
	for _, seq := range pb.waitDels {
		b.Delete(waitingKey(shard, seq), nil)
	}
}
