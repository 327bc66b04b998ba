package shard

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/cockroachdb/pebble/v2"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
)

// Holding tasks on disk through a long outage. A task whose delivery
// failed only because its target broker was unreachable (ErrUnavailable)
// waits for a retry in the wheel, with its due time in the shard's late
// map: 110 bytes of memory each or more (BenchmarkOutageMemory). A target down for a day while 1000
// tasks a second come due would take gigabytes, and after a restart the
// recovery would put them all back in the wheel. So each shard keeps at
// most Options.OutageMemory such tasks in memory; the next ones are held:
// their t key moves to a fire time no clock reaches, which the loader
// never loads. A held task costs disk only; it keeps its index entry
// (pointing at the held key), so a replace or cancel meets it as any
// stored task does.
//
// The held fire time names the task's target and its due time: heldBase +
// transport slot << 60 + a 12-bit hash of the target (its group) << 48 +
// the due time (48 bits of ms reach past codec.MaxDue). So a shard's held
// tasks lie together per target group in due order (equal dues in
// store-sequence order), a group that is still down can be stepped over
// with one seek, and the first key of each group is its oldest task. Two
// targets that share a group are released together: while one is down,
// the other's tasks are tried with its probes, which go round the group
// (each from where the last stopped). Each shard
// releases them per transport, when that lane has no batch in the sink,
// up to a batch at a time, claimed like due tasks and read once, from a
// cursor that walks the held range and wraps around. A released task that
// fails as unavailable again stays where it is (no write: an outage
// charges no attempt) and its group is down: the release steps over it
// until its backoff (Retry.Initial doubling to Retry.Max, at most
// heldProbeMax) has passed, so
// each down target is probed with one batch per backoff. Any other
// outcome is the usual one (delivered and deleted, retried at its backoff
// in the wheel, dead-lettered). A batch that delivers released tasks of a
// group and fails none ends its backoff; one that does both leaves it
// partly down, tried once per backoff (heldOutcomeLocked).
//
// The held counts are stored per shard and transport (h keys, merge
// operands like the pending counts), so Stats and the metrics are exact
// after a restart too. The groups' backoffs and probe positions are not:
// after a restart each group is probed from its start, the backoff
// starting again at Retry.Initial.

// heldBase is the lowest held fire time: far above any due time
// (codec.MaxDue, under 2^48) or retry time; heldBase + transportSlots<<60
// stays below math.MaxInt64, so a key range up to "fire+1" keeps its order.
const heldBase = 1 << 62

const (
	heldDueBits   = 48
	heldGroupBits = 12
	heldDueMask   = 1<<heldDueBits - 1
)

// heldGroup is the held fire time of transport slot l and target with
// due 0: the start of the target's group.
func heldGroup(l int, target string) int64 {
	g := xxhash.Sum64String(target) >> (64 - heldGroupBits)
	return heldBase + int64(l)<<(heldDueBits+heldGroupBits) + int64(g)<<heldDueBits
}

// heldFire is the held fire time of a task of transport slot l, target
// and due time.
func heldFire(l int, target string, due int64) int64 {
	return heldGroup(l, target) + min(max(due, 0), heldDueMask)
}

// groupOf is the group (start) of a held fire time, and heldDue its due.
func groupOf(fire int64) int64 { return fire &^ heldDueMask }
func heldDue(fire int64) int64 { return fire & heldDueMask }

// isHeld reports whether fire is a held task's.
func isHeld(fire int64) bool { return fire >= heldBase }

// heldSlot is the transport slot of a held fire time.
func heldSlot(fire int64) int { return int((fire - heldBase) >> (heldDueBits + heldGroupBits)) }

// heldSlotBounds are the fire times of slot l's held range: [lo, hi).
func heldSlotBounds(l int) (lo, hi int64) {
	lo = heldBase + int64(l)<<(heldDueBits+heldGroupBits)
	return lo, lo + 1<<(heldDueBits+heldGroupBits)
}

// defaultOutageMemory is Options.OutageMemory's default: tasks per shard
// waiting in memory for an unreachable target (110-290 bytes each, see
// BenchmarkOutageMemory).
const defaultOutageMemory = 65536

// heldKey is the key of shard's held count of a transport slot.
func heldKey(shard, slot int) []byte {
	return append(binary.BigEndian.AppendUint16([]byte{prefixHeld}, uint16(shard)), byte(slot))
}

// holdState is a lane's held tasks (under shard.mu).
type holdState struct {
	n int64 // held tasks in the store, durable batches counted
	// cursor: the next release reads from this held fire time and seq.
	cursorFire int64
	cursorSeq  uint64
	// down: the groups (groupOf) whose last released task failed
	// as unavailable, with their backoff.
	down map[int64]heldBackoff
	// next: the engine time (ms) before which the lane does not look for
	// held tasks to release again (all were down or busy at its last look).
	next int64
	// readFailed: the lane's last read of its held tasks failed
	// (claimHeldLocked), for the end of the failure's line (storeLines).
	readFailed bool
}

// heldBackoff is a down group's: no release before until (ms), the
// wait that set it, whether its last batch was partly delivered
// (heldOutcomeLocked), and the key its next probe starts from (0: the
// group's start).
type heldBackoff struct {
	until      int64
	wait       time.Duration
	partial    bool
	resumeFire int64
	resumeSeq  uint64
}

// keyFire is the fire time of a t key (0 if it is not one).
func keyFire(k []byte) int64 {
	_, fire, _, _ := parseTaskKey(k)
	return fire
}

// heldRetry is how long a lane whose held tasks could not be claimed
// (each in flight, being replaced, not durable yet or undecodable) waits
// before it looks again, so the loop does not spin on them.
const heldRetry = time.Second

// releasableLocked reports whether lane l may release held tasks now.
func (s *shard) releasableLocked(l int, now int64) bool {
	ln := &s.lanes[l]
	return !ln.busy && ln.hold.n > 0 && len(ln.parked) == 0 && now >= ln.hold.next
}

// nextReleaseLocked returns the earliest engine time (ms) a free lane
// with held tasks may release some, ok false if none.
func (s *shard) nextReleaseLocked() (int64, bool) {
	next, ok := int64(math.MaxInt64), false
	for l := range s.lanes {
		if ln := &s.lanes[l]; !ln.busy && ln.hold.n > 0 {
			next, ok = min(next, ln.hold.next), true
		}
	}
	return next, ok
}

// claimHeldLocked claims up to limit held tasks of each lane that may
// release now, from each lane's cursor, wrapping around once, stepping
// over the groups that are down. A task that is in flight, being deleted
// by an undurable replace or cancel, in a batch not yet durable, or
// undecodable is skipped.
func (s *shard) claimHeldLocked(now int64, limit int) ([]fireItem, error) {
	var out []fireItem
	for l := range s.lanes {
		if !s.releasableLocked(l, now) {
			continue
		}
		ln := &s.lanes[l]
		h := &ln.hold
		lo, hi := heldSlotBounds(l)
		it, err := s.e.db.NewIter(&pebble.IterOptions{LowerBound: taskBound(s.id, lo), UpperBound: taskBound(s.id, hi)})
		if err != nil {
			h.next = now + heldRetry.Milliseconds() // not again at once
			h.readFailed = true
			return out, fmt.Errorf("release held tasks of shard %d: %w", s.id, err)
		}
		// Each lane its own limit: one transport's held backlog must not
		// hold back the other's (dispatch splits the claim by lane).
		n0 := len(out)
		limit := n0 + limit
		wake := int64(math.MaxInt64) // the earliest end of a backoff stepped over
		from := appendTaskKey(nil, s.id, max(h.cursorFire, lo), h.cursorSeq)
		// cur: the group the cursor is in. A down group is stepped over
		// until its backoff ends, but a pass goes on through a partly
		// down one it entered (heldOutcomeLocked).
		cur := int64(-1)
		if h.cursorFire >= lo && h.cursorSeq > 0 {
			cur = groupOf(h.cursorFire)
		}
		for pass := 0; pass < 2 && len(out) < limit; pass++ {
			ok := it.SeekGE(from)
			for ok && len(out) < limit {
				_, fire, seq, valid := parseTaskKey(it.Key())
				if !valid {
					ok = it.Next()
					continue
				}
				g := groupOf(fire)
				if g != cur || !h.down[g].partial {
					d, down := h.down[g]
					if down && now < d.until {
						wake = min(wake, d.until)
						ok = it.SeekGE(taskBound(s.id, g+1<<heldDueBits)) // the rest of the group
						continue
					}
					if down && g != cur && d.resumeFire != 0 && (fire < d.resumeFire || fire == d.resumeFire && seq < d.resumeSeq) {
						// A down group's probes go round it, each from
						// where the last stopped: tasks that keep failing
						// at its head (a partition down, a colliding
						// target down) do not strand those behind them.
						cur = g
						if ok = it.SeekGE(appendTaskKey(nil, s.id, d.resumeFire, d.resumeSeq)); ok && groupOf(keyFire(it.Key())) != g || !ok && it.Error() == nil {
							d.resumeFire, d.resumeSeq = 0, 0 // past its end: from its start next time
							h.down[g] = d
						}
						continue
					}
					cur = g
				}
				h.cursorFire, h.cursorSeq = fire, seq+1
				ok = it.Next()
				if d, down := h.down[g]; down {
					d.resumeFire, d.resumeSeq = fire, seq+1
					if ok && groupOf(keyFire(it.Key())) != g || !ok && it.Error() == nil {
						d.resumeFire, d.resumeSeq = 0, 0 // its end: from its start next time
					}
					h.down[g] = d
				}
				if s.heldBusyLocked(seq) {
					continue
				}
				out = append(out, fireItem{fire: fire, seq: seq})
				s.inflight[seq] = notSuperseded
			}
			if err := it.Error(); err != nil {
				// A read failed: not the range's end. Checked here, as
				// the next pass's seek clears it (the failure went
				// unseen and the cursor back to the start:
				// TestHeldClaimSeekErrorReported). The tasks claimed
				// so far go.
				it.Close()
				h.next = now + heldRetry.Milliseconds()
				h.readFailed = true
				return out, fmt.Errorf("release held tasks of shard %d: %w", s.id, err)
			}
			if len(out) < limit {
				// The end of the range: once more from its start.
				h.cursorFire, h.cursorSeq, cur = lo, 0, -1
				from = taskBound(s.id, lo)
			}
		}
		if err := it.Close(); err != nil {
			h.next = now + heldRetry.Milliseconds()
			h.readFailed = true
			return out, fmt.Errorf("release held tasks of shard %d: %w", s.id, err)
		}
		h.readFailed = false // read, whatever it released
		if len(out) == n0 {
			// Nothing to release: every group down (until the first
			// backoff ends) or every task busy.
			h.next = min(wake, now+heldRetry.Milliseconds())
		}
	}
	return out, nil
}

// heldReadFailingLocked reports whether a lane that holds tasks failed
// its last read of them (claimHeldLocked): a lane that read them since
// without error, whatever it released (every group may be in its
// backoff), or that holds none any more (cancelled, replaced, dropped),
// does not.
func (s *shard) heldReadFailingLocked() bool {
	for l := range s.lanes {
		if h := &s.lanes[l].hold; h.readFailed && h.n > 0 {
			return true
		}
	}
	return false
}

// heldBusyLocked reports whether the held task seq may not be claimed:
// in flight, being deleted by an undurable replace or cancel, in a batch
// not durable yet, or undecodable.
func (s *shard) heldBusyLocked(seq uint64) bool {
	if _, ok := s.inflight[seq]; ok {
		return true
	}
	if _, ok := s.deleting[seq]; ok {
		return true
	}
	if _, ok := s.unwheeled[seq]; ok {
		return true
	}
	_, ok := s.undecodable[seq]
	return ok
}

// heldDownLocked records that a released held task (at fire) failed as
// unavailable: its group is stepped over for its next backoff.
func (s *shard) heldDownLocked(fire, now int64) {
	h := &s.lanes[heldSlot(fire)].hold
	if h.down == nil {
		h.down = make(map[int64]heldBackoff)
	}
	g := groupOf(fire)
	d := h.down[g]
	if now < d.until {
		return // a task of the same probe
	}
	r := s.e.opts.Retry
	d.wait = min(max(2*d.wait, r.Initial), r.Max, heldProbeMax)
	d.until = now + d.wait.Milliseconds()
	h.down[g] = d
}

// heldProbeMax bounds the backoff of a down group's probes. A target's
// held tasks are tried only by them, so after an outage long enough to
// hold tasks, the first probe of the target back came up to Retry.Max (5
// min by default) after its return, and only then were its held tasks
// released, in every shard (recover.go): 28 s to 3m16s measured with
// every task held, after 10 min and 1 h outages (hunt H173's harness). A
// probe is one batch per shard and down group: one every 30 s costs the
// broker nothing.
const heldProbeMax = 30 * time.Second

// appendGroup adds g to gs unless it is gs's last: a release claims a
// group's tasks together, in key order, so a batch of hundreds has about
// one entry per group for heldOutcomeLocked to search, not one per task
// (a repeated entry, from tasks set aside and taken back, is harmless).
func appendGroup(gs []int64, g int64) []int64 {
	if len(gs) > 0 && gs[len(gs)-1] == g {
		return gs
	}
	return append(gs, g)
}

// heldOutcomeLocked records what a batch did to its released held
// tasks' groups: up, the groups of those acknowledged; down, of those
// that failed as unavailable again (heldDownLocked set their backoff). A
// group only up is not down any more, and the lane may release at once.
// A group both up and down is a target partly down (a Kafka topic with
// one partition without a leader): it keeps its backoff, and the pass
// that entered it goes on through it (partial), so each of its tasks is
// tried once per backoff, the down part included. A group only down
// stops there until its backoff ends: one batch probes a target down as
// a whole. Deliveries of tasks that were not held say nothing about the
// held ones (a topic's healthy partitions would end the backoff of its
// down one at every delivery).
func (s *shard) heldOutcomeLocked(ln *lane, up, down []int64) {
	h := &ln.hold
	for _, g := range down {
		if d, ok := h.down[g]; ok {
			d.partial = slices.Contains(up, g)
			h.down[g] = d
		}
	}
	for _, g := range up {
		if _, ok := h.down[g]; !ok || slices.Contains(down, g) {
			continue
		}
		h.endBackoff(g)
	}
}

// endBackoff ends group g's backoff (it is up): the lane may release its
// held tasks at once.
func (h *holdState) endBackoff(g int64) {
	delete(h.down, g)
	if len(h.down) == 0 {
		h.down = nil
	}
	h.next = 0
}

// heldIterLocked returns an iterator over the shard's held tasks, which
// reads the store as it was when made (under the shard lock, Stats).
func (s *shard) heldIterLocked() (*pebble.Iterator, error) {
	it, err := s.e.db.NewIter(&pebble.IterOptions{LowerBound: taskBound(s.id, heldBase), UpperBound: taskBound(s.id+1, 0)})
	if err != nil {
		return nil, fmt.Errorf("shard %d: read held tasks: %w", s.id, err)
	}
	return it, nil
}

// heldOldestDue is the earliest due time of the shard's held tasks (for
// Stats) read with it (heldIterLocked), which it closes: the first key
// of each target group holds the group's oldest, so one seek per group,
// keys only, without the shard lock. ok is false for none. A read that
// fails (a step or a seek ending in an I/O error, which Pebble clears at
// the next seek) returns its error: what was read before it is not the
// oldest, only that of the groups it reached.
func (s *shard) heldOldestDue(it *pebble.Iterator) (due int64, ok bool, err error) {
	for valid := it.First(); valid; {
		_, fire, _, kok := parseTaskKey(it.Key())
		if !kok || !isHeld(fire) {
			valid = it.Next()
			continue
		}
		if d := heldDue(fire); !ok || d < due {
			due, ok = d, true
		}
		valid = it.SeekGE(taskBound(s.id, groupOf(fire)+1<<heldDueBits)) // the next group's
	}
	if err := errors.Join(it.Error(), it.Close()); err != nil {
		return 0, false, fmt.Errorf("shard %d: read held tasks: %w", s.id, err)
	}
	return due, ok, nil
}

// markHeldGroups sets seen[i] for each group gs[i] (groupOf) not seen
// yet of which the shard's store holds a held task: one iterator, a seek
// a group, keys only, without the shard lock. An error reading counts as
// holding one.
func (s *shard) markHeldGroups(gs []int64, seen []bool) {
	it, err := s.e.db.NewIter(&pebble.IterOptions{LowerBound: taskBound(s.id, heldBase), UpperBound: taskBound(s.id+1, 0)})
	if err != nil {
		for i := range seen {
			seen[i] = true
		}
		return
	}
	for i, g := range gs {
		if seen[i] || !isHeld(g) {
			continue
		}
		if it.SeekGE(taskBound(s.id, g)) {
			seen[i] = bytes.Compare(it.Key(), taskBound(s.id, g+1<<heldDueBits)) < 0
		} else if it.Error() != nil {
			// Checked here: Pebble clears it at the next seek, and the
			// group was taken for one with nothing held (forgotten after
			// unseenToForget rounds: TestProbeHeldSeekErrorKeepsOutage).
			break
		}
	}
	if err := errors.Join(it.Error(), it.Close()); err != nil {
		for i := range seen {
			seen[i] = true
		}
	}
}

// heldDoneLocked applies a durable batch's held counts.
func (s *shard) heldDoneLocked(pb *pendingBatch) {
	for l := range s.lanes {
		h := &s.lanes[l].hold
		if pb.held[l] == 0 {
			continue
		}
		h.n += pb.held[l]
		if h.n <= 0 {
			h.n, h.down = 0, nil
		}
		s.heldGauge(l).Set(float64(h.n))
	}
}

// heldGauge is the delaybridge_held_tasks series of transport slot l.
func (s *shard) heldGauge(l int) prometheus.Gauge {
	return s.e.m.Held.WithLabelValues(s.label, codec.Transport(l).String())
}

// writeHeldCounts adds pb's held counts to the batch b.
func writeHeldCounts(b *pebble.Batch, shard int, pb *pendingBatch) {
	for l, d := range pb.held {
		if d != 0 {
			b.Merge(heldKey(shard, l), u64(uint64(d)), nil)
		}
	}
}

// loadHeldLocked reads the shard's held counts at open.
func (s *shard) loadHeldLocked() error {
	for l := range s.lanes {
		h := &s.lanes[l].hold
		v, found, err := getU64(s.e.db, heldKey(s.id, l))
		if err != nil {
			return fmt.Errorf("read held count of shard %d: %w", s.id, err)
		}
		if l > 0 {
			// Every transport's series exists from the start (0 when
			// nothing is held), so a dashboard shows 0 rather than no
			// data; slot 0 is no transport.
			s.heldGauge(l).Set(0)
		}
		if !found {
			continue
		}
		h.n = max(int64(v), 0)
		s.heldGauge(l).Set(float64(h.n))
		if h.n == 0 {
			continue
		}
		s.e.log.Info("tasks held on disk for an unreachable target; released once it answers",
			zap.Int("shard", s.id), zap.Stringer("transport", codec.Transport(l)), zap.Int64("held", h.n))
	}
	return nil
}
