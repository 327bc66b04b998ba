package shard

import (
	"cmp"
	"container/heap"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
)

// Stuck entries are what an operator may have to look at and, as a last
// resort, remove by hand: stored entries that will not leave the store by
// themselves soon.
//
//   - held: a dead letter whose last delivery failed and that is not
//     parked (its DLQ fails as a whole: unreachable, not authorized, no
//     stream, full). Its source waits for it (CONTRACT §3) when it was
//     ingested with checkpoints; HeldKeys names them.
//   - parked: a dead letter its DLQ refused as this message at the last
//     attempt of the retry policy (see deadLetterParked): its source
//     moved on, it is retried forever at backoff.
//   - undecodable: a task or dead letter whose envelope the fire loop could
//     not decode. It cannot be delivered or dead-lettered, so it stays in
//     the store, out of the wheel; if it is an awaited dead letter its
//     source waits for it for good. The set lives in memory: after a
//     restart the loader puts the entry back in the wheel and the fire
//     loop finds it again when it is due (logging it once more), so it is
//     listed again from then on.
//
// DropStuck removes one such entry for good, with everything stored about
// it, and releases whatever waited for it. It is the operator's decision
// to lose that message: a held dead letter's source then commits past a
// message whose dead letter never reached the DLQ.

// StuckState is why an entry is stuck.
type StuckState string

const (
	StuckHeld        StuckState = "held"
	StuckParked      StuckState = "parked"
	StuckUndecodable StuckState = "undecodable"
)

// Limits of StuckEntries.
const (
	DefaultStuckLimit = 100
	MaxStuckLimit     = 1000
)

// StuckEntry is one stuck entry. Shard and Seq name it for DropStuck. The
// fields from Attempts on come from its envelope and are empty for an
// undecodable one (or when the envelope moved while it was read).
type StuckEntry struct {
	Shard int        `json:"shard"`
	Seq   uint64     `json:"seq"`
	State StuckState `json:"state"`
	// NextFire is where the entry is in the store: the next try of a
	// failing dead letter; for an undecodable one, the time it was due
	// (none for one held on disk for an unreachable target, hold.go).
	NextFire Time `json:"next_fire,omitzero"`
	// Error is the last delivery failure (held, parked) or the decode
	// error (undecodable).
	Error string `json:"error"`
	// HeldKeys are the checkpoint keys (source partitions) that wait for
	// this dead letter before they commit or ack past it.
	HeldKeys []string `json:"held_keys,omitempty"`
	Kind     string   `json:"kind,omitempty"` // "dead-letter", "task"
	Attempts uint32   `json:"attempts,omitempty"`
	// Code and Detail are the dead letter's delay-error and
	// delay-error-detail.
	Code   string `json:"code,omitempty"`
	Detail string `json:"detail,omitempty"`
	Source string `json:"source,omitempty"`
	ID     string `json:"id,omitempty"`
	Origin string `json:"origin,omitempty"`
	// Destination is the DLQ of a dead letter, the target of a task:
	// "kafka:NAME" or "nats:SUBJECT".
	Destination string `json:"destination,omitempty"`
	Due         Time   `json:"due,omitzero"`
}

// StuckList is what StuckEntries returns: the first entries by (shard,
// fire, seq) and how many there are in all.
type StuckList struct {
	Entries []StuckEntry `json:"entries"`
	Total   int          `json:"total"`
}

// undecodable is a stored task whose envelope does not decode.
type undecodable struct {
	fire int64
	err  error
	// deadLetter: a dead letter whose delivery had failed (it has no
	// index entry for DropStuck to look for).
	deadLetter bool
}

// noteUndecodableLocked records that the task (fire, seq) is stored with an
// envelope that does not decode; deadLetter, that it is a dead letter
// whose delivery had failed.
func (s *shard) noteUndecodableLocked(fire int64, seq uint64, err error, deadLetter bool) {
	if s.undecodable == nil {
		s.undecodable = make(map[uint64]undecodable)
	}
	if err == nil {
		err = errUndecodable
	}
	if _, ok := s.undecodable[seq]; !ok {
		s.e.m.Undecodable.Inc()
	}
	s.undecodable[seq] = undecodable{fire: fire, err: err, deadLetter: deadLetter || s.undecodable[seq].deadLetter}
}

// forgetUndecodableLocked takes seq out of the undecodable set: it left the
// store (replaced, cancelled or dropped).
func (s *shard) forgetUndecodableLocked(seq uint64) {
	if _, ok := s.undecodable[seq]; ok {
		delete(s.undecodable, seq)
		s.e.m.Undecodable.Dec()
	}
}

// undecodableErr reports the undecodable entries of all shards, and how
// many of them are dead letters a source waits for. Nil when there are
// none.
func (e *Engine) undecodableErr() error {
	var n, held int
	var first error
	var firstSeq uint64
	for _, s := range e.shards {
		s.mu.Lock()
		if len(s.undecodable) > 0 {
			e.dl.mu.Lock()
			for seq, u := range s.undecodable {
				n++
				if _, ok := e.dl.held[seq]; ok {
					held++
				}
				if first == nil || seq < firstSeq {
					first, firstSeq = u.err, seq
				}
			}
			e.dl.mu.Unlock()
		}
		s.mu.Unlock()
	}
	if n == 0 {
		return nil
	}
	return fmt.Errorf("shard: %d stored entries cannot be decoded and stay in the store, %d of them dead letters their sources wait for (GET /v1/stuck lists them, DELETE /v1/stuck/{shard}/{seq} drops one): %w", n, held, first)
}

var errUndecodable = errors.New("envelope does not decode")

// stuck is a stuck entry as its shard tracks it.
type stuck struct {
	seq   uint64
	fire  int64
	state StuckState
	err   error
}

// stuckLocked returns the stuck entry seq of the shard. An entry that a
// replace, cancel or drop is deleting is not stuck any more. An undecodable
// failing dead letter is undecodable: it will not be delivered.
func (s *shard) stuckLocked(seq uint64) (stuck, bool) {
	if _, ok := s.deleting[seq]; ok {
		return stuck{}, false
	}
	if u, ok := s.undecodable[seq]; ok {
		return stuck{seq: seq, fire: u.fire, state: StuckUndecodable, err: u.err}, true
	}
	if f, ok := s.dlFailing[seq]; ok {
		st := StuckHeld
		if f.parked {
			st = StuckParked
		}
		return stuck{seq: seq, fire: f.fire, state: st, err: f.err}, true
	}
	return stuck{}, false
}

// stuckFirstLocked returns the shard's first limit stuck entries by
// (fire, seq), and how many it has in all. It keeps only those limit, in a
// max-heap, rather than collect and sort them all: publish-failed dead
// letters pile up by the million while a target and its DLQ both refuse
// the bridge, and /v1/stuck asks for at most MaxStuckLimit (with 200 000
// stuck, collecting them all took 53 MB and 13 ms of each shard's lock a
// call; hunt H195).
func (s *shard) stuckFirstLocked(limit int) (first []stuck, total int) {
	h := make(stuckHeap, 0, min(limit, len(s.undecodable)+len(s.dlFailing)))
	add := func(seq uint64) {
		st, ok := s.stuckLocked(seq)
		if !ok {
			return
		}
		total++
		switch {
		case len(h) < limit:
			heap.Push(&h, st)
		case limit > 0 && stuckCmp(st, h[0]) < 0:
			h[0] = st // in place of the last one kept
			heap.Fix(&h, 0)
		}
	}
	for seq := range s.undecodable {
		add(seq)
	}
	for seq := range s.dlFailing {
		if _, ok := s.undecodable[seq]; !ok {
			add(seq)
		}
	}
	slices.SortFunc(h, stuckCmp)
	return h, total
}

// stuckCmp orders stuck entries by (fire, seq).
func stuckCmp(a, b stuck) int { return cmp.Or(cmp.Compare(a.fire, b.fire), cmp.Compare(a.seq, b.seq)) }

// stuckHeap is a max-heap of stuck entries by (fire, seq): its root is the
// last of those kept (container/heap).
type stuckHeap []stuck

func (h stuckHeap) Len() int           { return len(h) }
func (h stuckHeap) Less(i, j int) bool { return stuckCmp(h[i], h[j]) > 0 }
func (h stuckHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *stuckHeap) Push(x any)        { *h = append(*h, x.(stuck)) }
func (h *stuckHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// StuckEntries lists the stuck entries of every shard (see StuckState) in
// (shard, fire, seq) order, at most limit of them (DefaultStuckLimit when
// limit <= 0, at most MaxStuckLimit), and how many there are in all. The
// envelopes are read without the shard locks: a dead letter retried
// meanwhile is looked for again at its new place, once.
func (e *Engine) StuckEntries(limit int) (StuckList, error) {
	if limit <= 0 {
		limit = DefaultStuckLimit
	}
	limit = min(limit, MaxStuckLimit)
	e.closeMu.RLock()
	defer e.closeMu.RUnlock()
	if e.closed {
		return StuckList{}, ErrClosed
	}
	list := StuckList{Entries: []StuckEntry{}}
	for _, s := range e.shards {
		s.mu.Lock()
		s.drainLocked()
		all, total := s.stuckFirstLocked(limit - len(list.Entries))
		s.mu.Unlock()
		list.Total += total
		first := len(list.Entries)
		for _, st := range all {
			ent, err := s.describe(st)
			if err != nil {
				return StuckList{}, fmt.Errorf("shard: stuck entries: %w", err)
			}
			list.Entries = append(list.Entries, ent)
		}
		// A dead letter retried meanwhile is described at its new place.
		slices.SortStableFunc(list.Entries[first:], func(a, b StuckEntry) int {
			return cmp.Or(a.NextFire.Compare(b.NextFire.Time), cmp.Compare(a.Seq, b.Seq))
		})
	}
	return list, nil
}

// describe turns a stuck entry into its report, with what its envelope and
// the awaited-dead-letter registry say.
func (s *shard) describe(st stuck) (StuckEntry, error) {
	e := s.e
	ent := StuckEntry{Shard: s.id, Seq: st.seq, State: st.state}
	if !isHeld(st.fire) {
		ent.NextFire = msTime(st.fire)
	}
	if st.err != nil {
		ent.Error = st.err.Error()
	}
	e.dl.mu.Lock()
	ent.HeldKeys = slices.Clone(e.dl.held[st.seq])
	e.dl.mu.Unlock()
	if st.state == StuckUndecodable {
		return ent, nil
	}
	v, ok, err := getCopy(e.db, appendTaskKey(nil, s.id, st.fire, st.seq))
	if err != nil {
		return StuckEntry{}, fmt.Errorf("shard %d: read seq %d: %w", s.id, st.seq, err)
	}
	if !ok {
		// Retried meanwhile: look where it is now.
		s.mu.Lock()
		s.drainLocked()
		now, still := s.stuckLocked(st.seq)
		s.mu.Unlock()
		if !still || now.fire == st.fire {
			return ent, nil
		}
		ent.NextFire = msTime(now.fire)
		if v, ok, err = getCopy(e.db, appendTaskKey(nil, s.id, now.fire, st.seq)); err != nil {
			return StuckEntry{}, fmt.Errorf("shard %d: read seq %d: %w", s.id, st.seq, err)
		} else if !ok {
			return ent, nil
		}
	}
	var t codec.Task
	if err := codec.DecodeTask(v, &t); err != nil {
		// Not yet found by the fire loop: described as far as known.
		ent.Error = fmt.Sprintf("%s; envelope: %v", ent.Error, err)
		return ent, nil
	}
	ent.Kind = "task"
	if t.Kind == codec.KindDeadLetter {
		ent.Kind = "dead-letter"
	}
	ent.Attempts, ent.Code, ent.Detail = t.Attempts, string(t.Code), t.Detail
	ent.Source, ent.ID, ent.Origin = t.Source, t.ID, t.Origin
	ent.Destination = t.Destination()
	if t.Due != 0 {
		ent.Due = msTime(t.Due)
	}
	return ent, nil
}

// DropStuck removes the stuck entry (shard, seq) that StuckEntries lists
// from the store for good, in one synced commit: its task key, its failure
// and awaited-dead-letter records and, for an undecodable task, the index
// entry that points to it. Once that commit is durable, every wait for it
// ends (its batch's Handle, see DeadLetters.Dropped, and AwaitStored of its
// checkpoint keys), and it leaves the failing, parked and undecodable sets
// (Err, the parked gauge). ErrNotFound for an entry that is not listed:
// an ordinary pending task, an unknown seq, a dead letter that has not
// failed, or one that its DLQ took or a replace, cancel or another drop is
// deleting.
//
// A dead letter being published when it is dropped may still reach its
// DLQ; the drop stands (the fire loop records nothing for it), and it
// counts as dead-lettered rather than dropped, as a cancelled task that
// fires anyway counts as fired.
func (e *Engine) DropStuck(shardID int, seq uint64) error {
	e.closeMu.RLock()
	defer e.closeMu.RUnlock()
	if e.closed {
		return ErrClosed
	}
	if err := e.failed(); err != nil {
		return err
	}
	if shardID < 0 || shardID >= len(e.shards) {
		return ErrNotFound
	}
	s := e.shards[shardID]
	s.mu.Lock()
	s.drainLocked()
	st, ok := s.stuckLocked(seq)
	// A dead letter (failing, or awaited by a source) has no index entry:
	// no need to search the index for one.
	_, deadLetter := s.dlFailing[seq]
	deadLetter = deadLetter || s.undecodable[seq].deadLetter
	if !deadLetter {
		e.dl.mu.Lock()
		_, held := e.dl.held[seq]
		_, waited := e.dl.m[seq]
		deadLetter = held || waited
		e.dl.mu.Unlock()
	}
	s.mu.Unlock()
	if !ok {
		return ErrNotFound
	}
	// For the log line; best effort.
	ent, _ := s.describe(st)
	// An undecodable task may have an index entry (a dead letter has
	// none); it cannot say its id, so the index is searched for the entry
	// that points to it, without the lock (a long scan), and the find is
	// checked again under it.
	var ik []byte
	if st.state == StuckUndecodable && !deadLetter {
		var err error
		if ik, err = s.indexKeyOf(seq); err != nil {
			return fmt.Errorf("shard: drop %d/%d: %w", shardID, seq, err)
		}
	}

	s.mu.Lock()
	s.drainLocked()
	st, ok = s.stuckLocked(seq)
	if !ok {
		s.mu.Unlock()
		return ErrNotFound
	}
	tk := newTicket()
	// The fire commit that moved it there may not be applied yet: apply
	// after it, or it would store the dead letter again.
	for _, pb := range s.queue {
		if slices.ContainsFunc(pb.ops, func(op wheelOp) bool { return op.seq == seq }) {
			tk.dependOn(pb.tk)
		}
	}
	dropIndex := false
	if ik != nil {
		idx := indexReader{db: e.db}
		var ex indexEntry
		found, err := s.lookupLocked(&idx, ik, &ex, tk)
		idx.close()
		if err != nil {
			s.mu.Unlock()
			tk.release()
			return fmt.Errorf("shard: drop %d/%d: %w", shardID, seq, err)
		}
		dropIndex = found && !ex.Cancel && ex.Shard == s.id && ex.Seq == seq
	}
	pb := &pendingBatch{delta: -1, tk: tk}
	if isHeld(st.fire) {
		pb.held[heldSlot(st.fire)]--
	}
	s.enqueueLocked(pb)
	if dropIndex {
		s.setOverlayLocked(string(ik), indexEntry{}, true, pb)
	}
	by := droppedHeldInFlight
	if st.state == StuckParked {
		by = droppedParkedInFlight
	}
	inFlight := s.supersedeLocked(seq, pb, by, "")
	s.mu.Unlock()

	b := e.db.NewBatch()
	b.Delete(appendTaskKey(nil, s.id, st.fire, seq), nil)
	if dropIndex {
		b.Delete(ik, nil)
	}
	b.Delete(dlFailureKey(s.id, seq), nil)
	b.Delete(dlWaitKey(s.id, seq), nil)
	b.Merge(countKey(s.id), u64(math.MaxUint64), nil) // -1
	writeHeldCounts(b, s.id, pb)
	// Its waiting record (recover.go), if any: one known to wait is in
	// pb's, and an undecodable task left shard.late at its claim, with no
	// commit to delete its record in.
	b.Delete(waitingKey(s.id, seq), nil)
	if err := s.commitDecided(tk, pb, b, "drop", e.commitDrop); err != nil {
		return fmt.Errorf("shard: drop %d/%d: %w", shardID, seq, err)
	}
	s.mu.Lock()
	// The fire loop may have done it already, having found the key gone.
	s.dlGoneLocked(seq)
	s.dlqClearedLocked()
	s.forgetUndecodableLocked(seq)
	s.mu.Unlock()
	e.releaseDeadLetter(seq, releaseDropped)

	if !inFlight {
		e.m.StuckDropped.WithLabelValues(string(st.state)).Inc()
	}
	e.log.Warn("admin: stuck entry dropped from the store for good", zap.Int("shard", s.id), zap.Uint64("seq", seq),
		zap.String("state", string(st.state)), zap.Bool("in_flight", inFlight),
		zap.String("fire", msTime(st.fire).Format(time.RFC3339Nano)),
		zap.String("origin", ent.Origin), zap.String("code", ent.Code), zap.String("error", ent.Error))
	return nil
}

// indexKeyOf finds the index key whose entry points to the shard's task
// seq, nil if none: a scan of the whole index (only DropStuck of an
// undecodable task needs it).
func (s *shard) indexKeyOf(seq uint64) ([]byte, error) {
	e := s.e
	var found []byte
	err := safeCall(func() error {
		it, err := e.db.NewIter(&pebble.IterOptions{LowerBound: []byte{prefixIndex}, UpperBound: []byte{prefixIndex + 1}})
		if err != nil {
			return err
		}
		var ex indexEntry
		for it.First(); it.Valid(); it.Next() {
			k := it.Key()
			if len(k) < 2 || shardOfIndexKey(k, len(e.shards)) != s.id {
				continue
			}
			v, err := it.ValueAndErr()
			if err != nil {
				it.Close()
				return err
			}
			if decodeIndexEntry(v, &ex) == nil && !ex.Cancel && ex.Seq == seq {
				found = slices.Clone(k)
				break
			}
		}
		return it.Close()
	})
	if err != nil {
		return nil, fmt.Errorf("search the index: %w", err)
	}
	return found, nil
}
