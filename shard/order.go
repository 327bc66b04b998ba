package shard

import (
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/prometheus/client_golang/prometheus"
)

// Writers (ingest, fire commits, admin cancel, marker sweep) decide under
// the shard locks, using the index as Pebble has it plus the overlay of
// decisions not yet applied. They build their batch and apply it
// (ApplyNoSyncWait) without holding any shard lock, after the batches
// they depend on, then wait for the fsync. So the shard locks cover only
// lookups and decisions, Pebble still receives the writes of one key in
// the order they were decided, and concurrent batches share fsyncs.

// commitTicket is one writer's batch on its way into Pebble. A batch
// depends on the unapplied batches whose index decisions it read (the
// overlay owners) and on the last unapplied writer of each checkpoint key
// it sets; it applies after them and independent batches apply
// concurrently, so Pebble sees the writes of any one key in decision order.
type commitTicket struct {
	applied chan struct{} // closed once applied (or abandoned)
	deps    []*commitTicket
	once    sync.Once
	// readUndurable: a decision read the overlay, i.e. a batch not yet
	// known to be durable (dependOn drops it from deps once applied, not
	// once synced).
	readUndurable bool
}

func newTicket() *commitTicket { return &commitTicket{applied: make(chan struct{})} }

func (t *commitTicket) isApplied() bool {
	select {
	case <-t.applied:
		return true
	default:
		return false
	}
}

// dependOn makes t apply after o. Deps always point to earlier decisions,
// so waiting on them cannot deadlock.
func (t *commitTicket) dependOn(o *commitTicket) {
	if o == nil || o == t {
		return
	}
	t.readUndurable = true
	t.after(o)
}

// after makes t apply after o, which it did not read a decision of (a
// range deletion of fired tombstones, clearFired): an empty t is not
// applied for it.
func (t *commitTicket) after(o *commitTicket) {
	if o == nil || o == t || o.isApplied() {
		return
	}
	if !slices.Contains(t.deps, o) {
		t.deps = append(t.deps, o)
	}
}

func (t *commitTicket) release() { t.once.Do(func() { close(t.applied) }) }

// awaitDeps waits up to d for the decisions t depends on to be applied
// (applyInOrder waits without a bound).
func (t *commitTicket) awaitDeps(d time.Duration) bool {
	timer := time.NewTimer(d)
	defer timer.Stop()
	for _, dep := range t.deps {
		select {
		case <-dep.applied:
		case <-timer.C:
			return false
		}
	}
	return true
}

// applyInOrder applies b (ApplyNoSyncWait) once the batches it depends on
// are applied. An empty batch is not applied unless its decisions read
// undurable ones: it then carries an empty WAL record, whose sync makes
// them durable before the caller reports its outcome (a message dropped
// because an undurable cancel said so must not outlive that cancel in a
// crash). The ticket is released in every case. applied reports whether
// the caller must SyncWait b.
func (e *Engine) applyInOrder(tk *commitTicket, b *pebble.Batch, op string) (applied bool, err error) {
	defer tk.release()
	for _, d := range tk.deps {
		<-d.applied
	}
	tk.deps = nil // do not keep a chain of applied batches alive
	if b.Empty() {
		if !tk.readUndurable {
			return false, nil
		}
		if err := b.LogData(nil, nil); err != nil {
			return false, fmt.Errorf("shard: %s: %w", op, err)
		}
	}
	if err := e.applyNoSyncWait(b, op); err != nil {
		return false, err
	}
	return true, nil
}

// commitDecided applies b, whose decisions pb holds, in ticket order, waits
// for its fsync (timed by obs when not nil) and then marks pb durable. On
// failure the decisions are taken back (abandonLocked) and the error,
// sticky once the store failed, is returned. It is the tail of every
// single-shard write decided under the shard lock (cancel, drop, the
// cancel-marker sweep).
func (s *shard) commitDecided(tk *commitTicket, pb *pendingBatch, b *pebble.Batch, op string, obs prometheus.Observer) error {
	e := s.e
	start := time.Now()
	applied, err := e.applyInOrder(tk, b, op)
	if applied {
		if err = b.SyncWait(); err != nil {
			err = e.fail(op, err)
		}
		if obs != nil {
			obs.Observe(time.Since(start).Seconds())
		}
	}
	if err != nil {
		// Not closed: after a failed commit the pipeline may still hold b.
		s.mu.Lock()
		s.abandonLocked(pb)
		s.mu.Unlock()
		return err
	}
	b.Close()
	s.markDurable(pb)
	return nil
}

// overlayEntry is an index change decided but possibly not yet visible in
// Pebble; owner is the batch that wrote it.
type overlayEntry struct {
	entry   indexEntry
	deleted bool
	owner   *pendingBatch
}

// lookupLocked reads the index entry of key as the shard's decisions see
// it: the newest undurable decision, else Pebble. A writer passes its
// ticket (nil for reads) so it applies after the decision it read.
func (s *shard) lookupLocked(idx *indexReader, key []byte, e *indexEntry, tk *commitTicket) (bool, error) {
	if found, known := s.decidedLocked(key, e, tk); known {
		return found, nil
	}
	return idx.get(key, e)
}

// decidedLocked is lookupLocked without the store read: known false
// means the entry is what Pebble holds (counted as an index read).
func (s *shard) decidedLocked(key []byte, e *indexEntry, tk *commitTicket) (found, known bool) {
	if len(s.overlay) > 0 {
		if o, ok := s.overlay[string(key)]; ok {
			if tk != nil {
				tk.dependOn(o.owner.tk)
			}
			if o.deleted {
				return false, true
			}
			*e = o.entry
			return true, true
		}
	}
	if s.filterSaysAbsentLocked(key) {
		return false, true
	}
	s.indexReads++
	return false, false
}

// setOverlayLocked records pb's decision for the index key k (a string the
// overlay may keep until pb is durable).
func (s *shard) setOverlayLocked(k string, e indexEntry, deleted bool, pb *pendingBatch) {
	if !deleted {
		s.filterAddLocked(filterHashString(k))
	}
	if o, ok := s.overlay[k]; ok && o.owner != pb {
		pb.undo = append(pb.undo, overlayUndo{key: k, prev: o})
	}
	s.overlay[k] = overlayEntry{entry: e, deleted: deleted, owner: pb}
	pb.keys = append(pb.keys, k)
}

// dropOverlayLocked forgets pb's overlay entries that no later decision
// replaced, and its task deletions: pb is durable (drained) or abandoned.
func (s *shard) dropOverlayLocked(pb *pendingBatch) {
	for _, k := range pb.keys {
		if o, ok := s.overlay[k]; ok && o.owner == pb {
			delete(s.overlay, k)
		}
	}
	pb.keys = nil
	pb.undo = nil
	for _, seq := range pb.dels {
		delete(s.deleting, seq)
	}
	pb.dels = nil
}

// overlayUndo is an overlay entry of an earlier undurable batch that a
// later batch replaced; abandonLocked puts it back if the later batch is
// dropped while the earlier one is still on its way.
type overlayUndo struct {
	key  string
	prev overlayEntry
}

// addOpLocked records that pb stores task (fire, seq): the loader must skip
// it until pb is durable, then it enters the wheel. Every batch that
// stores a task key records it here (clearFired relies on it), and one
// whose key a range deletion of fired tombstones decided and not yet
// applied may cover (below the end it was decided with) applies after
// that deletion. Tasks due later do not wait for it, which on a slow disk
// may step over many tombstones (TestClearHoldsNoIngestDueLater).
func (s *shard) addOpLocked(pb *pendingBatch, fire int64, seq uint64) {
	pb.ops = append(pb.ops, wheelOp{fire, seq})
	s.unwheeled[seq] = struct{}{}
	if s.clearing != nil && taskKeyBefore(fire, seq, s.clearEnd) {
		pb.tk.after(s.clearing)
	}
}

// taskKeyBefore reports whether the task key (fire, seq) sorts before
// that of end, or, when end.seq is 0, before taskBound at end.fire.
func taskKeyBefore(fire int64, seq uint64, end wheelOp) bool {
	f, ef := fireU64(fire), fireU64(end.fire)
	return f < ef || f == ef && seq < end.seq
}
