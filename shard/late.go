package shard

// Tasks whose delivery failed wait in the wheel at their retry time, not
// their due time, so neither the wheel nor the store order tells how long
// they have been overdue. The shard keeps the due time of each (late) for
// Stats' oldest overdue, with the smallest cached: a task leaves when it is
// delivered, dead-lettered, replaced or cancelled, or found gone at claim.
// Only failing tasks are kept: during an outage, the due tasks in the wheel
// within the horizon, about 40 bytes each.

// noteLateLocked records that the task seq, due at due (ms), failed a
// delivery and waits for a retry.
func (s *shard) noteLateLocked(seq uint64, due int64) {
	if s.late == nil {
		s.late = make(map[uint64]int64)
	}
	if _, ok := s.late[seq]; !ok && (len(s.late) == 0 || due < s.lateMin) && !s.lateDirty {
		s.lateMin = due
	}
	s.late[seq] = due
}

// clearLateLocked forgets seq (no-op unless it failed a delivery).
func (s *shard) clearLateLocked(seq uint64) {
	due, ok := s.late[seq]
	if !ok {
		return
	}
	delete(s.late, seq)
	if due <= s.lateMin {
		s.lateDirty = true
	}
	if len(s.late) == 0 {
		s.late, s.lateDirty = nil, false // give the map's memory back after an outage
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
		for _, due := range s.late {
			if first || due < s.lateMin {
				s.lateMin, first = due, false
			}
		}
		s.lateDirty = false
	}
	return s.lateMin, true
}

// noDue is lane.publishingDue when no batch is in the sink's Deliver.
const noDue = int64(^uint64(0) >> 1)
