package shard

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"strings"
	"sync"

	"github.com/cockroachdb/pebble/v2"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
)

// DeadLetters are the dead letters of one ingested batch whose DLQ
// acknowledgement a source waits for before it commits its offset (CONTRACT
// §3). IngestAwait returns them; the fire loop marks each one as its DLQ
// broker acknowledges it.
type DeadLetters struct {
	e    *Engine
	seqs []uint64
	done chan struct{} // closed when left reaches 0
	left int           // under e.dl.mu
	// parked: dead letters released without an acknowledgement, because
	// their DLQ refused them Retry.MaxAttempts times (under e.dl.mu).
	parked int
	// dropped: dead letters an operator removed from the store
	// (Engine.DropStuck) before their DLQ took them (under e.dl.mu).
	dropped int
}

// dlWaits is the registry of awaited dead letters, by store sequence.
type dlWaits struct {
	mu sync.Mutex
	// m: the Handle waits (DeadLetters) of batches still watched.
	m map[uint64]*DeadLetters
	// held: the dead letters a source waits for, with their batch's
	// checkpoint keys, from their ingest (or the restart that read their
	// prefixDLWait record) until their DLQ acknowledged them or they were
	// parked. Unlike m, a Wait that gives up leaves them here: the source
	// that starts reading their checkpoint key again waits for them
	// (AwaitStored).
	held map[uint64][]string
	// byKey counts the held dead letters of each checkpoint key.
	byKey map[string]*keyHold
}

// keyHold is what a checkpoint key waits for: n held dead letters; done is
// closed when the last of them is released.
type keyHold struct {
	n    int
	done chan struct{}
}

// dlWaitKeys is the checkpoint keys an awaited dead letter's record names:
// those of its batch that the record can hold (see appendDLWait), not the
// records kept aside.
func dlWaitKeys(cps []Checkpoint) []string {
	var keys []string
	for _, cp := range cps {
		if cp.Key != "" && !cp.Aside && len(cp.Key) <= math.MaxUint16 && len(keys) < dlWaitMaxKeys && !slices.Contains(keys, cp.Key) {
			keys = append(keys, cp.Key)
		}
	}
	return keys
}

// awaitDeadLetters registers the batch's dead letters (acts hold their
// sequences) as awaited by its Handle and, with keys (the batch's
// checkpoint keys, whose prefixDLWait records the batch stored), as held
// for those keys. It runs after the batch is durable and before the wheels
// see it, so no delivery comes before its waiter. Nil without dead
// letters.
func (e *Engine) awaitDeadLetters(tasks []codec.Task, acts []ingestAction, keys []string) *DeadLetters {
	var d *DeadLetters
	for i := range tasks {
		if tasks[i].Kind != codec.KindDeadLetter || acts[i].seq == 0 {
			continue
		}
		if d == nil {
			d = &DeadLetters{e: e, done: make(chan struct{})}
		}
		d.seqs = append(d.seqs, acts[i].seq)
	}
	if d == nil {
		return nil
	}
	e.dl.mu.Lock()
	defer e.dl.mu.Unlock()
	if e.dl.m == nil {
		e.dl.m = make(map[uint64]*DeadLetters)
	}
	for _, seq := range d.seqs {
		e.dl.m[seq] = d
		if len(keys) > 0 {
			e.holdLocked(seq, keys)
		}
	}
	d.left = len(d.seqs)
	return d
}

// holdLocked registers the dead letter seq as held for keys.
func (e *Engine) holdLocked(seq uint64, keys []string) {
	if _, ok := e.dl.held[seq]; ok {
		return
	}
	if e.dl.held == nil {
		e.dl.held = make(map[uint64][]string)
		e.dl.byKey = make(map[string]*keyHold)
	}
	e.dl.held[seq] = keys
	for _, k := range keys {
		h := e.dl.byKey[k]
		if h == nil {
			h = &keyHold{done: make(chan struct{})}
			e.dl.byKey[k] = h
		}
		h.n++
	}
}

// deadLetterAcked marks the dead letter seq as acknowledged by its DLQ. It
// reports whether a source held for it (its prefixDLWait record is to be
// deleted with it).
func (e *Engine) deadLetterAcked(seq uint64) (held bool) {
	_, held = e.releaseDeadLetter(seq, releaseAcked)
	return held
}

// deadLetterParked releases the wait for the dead letter seq, which its
// DLQ refused as this message (ErrRefused: larger than the DLQ allows, a
// record the broker rejects) with Retry.MaxAttempts attempts or more, so
// that one message the DLQ will never take does not stall its source
// partition for good (CONTRACT §3: one bad message never stalls its
// partition). Nothing is dropped: the dead letter stays in the store, is
// retried with backoff until the DLQ takes it, and is in its shard's
// parked set meanwhile (the engine is not ready, see Err). A DLQ that fails
// as a whole (unreachable, no permission, no stream, full) releases
// nothing. It reports whether a Handle waited for it and whether a source
// held for it (its prefixDLWait record is to be deleted in the commit
// that parks it).
func (e *Engine) deadLetterParked(seq uint64) (waited, held bool) {
	return e.releaseDeadLetter(seq, releaseParked)
}

// release is why an awaited dead letter stops being awaited.
type release uint8

const (
	releaseAcked   release = iota // its DLQ acknowledged it
	releaseParked                 // parked (deadLetterParked)
	releaseDropped                // an operator dropped it (Engine.DropStuck)
)

// releaseDeadLetter ends every wait for the dead letter seq: its Handle's
// (DeadLetters) and the hold of its checkpoint keys (AwaitStored). A dead
// letter released already is not released again.
func (e *Engine) releaseDeadLetter(seq uint64, why release) (waited, held bool) {
	e.dl.mu.Lock()
	defer e.dl.mu.Unlock()
	if keys, ok := e.dl.held[seq]; ok {
		held = true
		delete(e.dl.held, seq)
		for _, k := range keys {
			if h := e.dl.byKey[k]; h != nil {
				if h.n--; h.n == 0 {
					close(h.done)
					delete(e.dl.byKey, k)
				}
			}
		}
	}
	d, ok := e.dl.m[seq]
	if !ok {
		return false, held
	}
	delete(e.dl.m, seq)
	switch why {
	case releaseParked:
		d.parked++
	case releaseDropped:
		d.dropped++
	}
	if d.left--; d.left == 0 {
		close(d.done)
	}
	return true, held
}

// deadLetterAwaited reports whether a source waits for the dead letter
// seq: a Handle's wait or a hold of its checkpoint keys.
func (e *Engine) deadLetterAwaited(seq uint64) bool {
	e.dl.mu.Lock()
	defer e.dl.mu.Unlock()
	return e.deadLetterAwaitedLocked(seq)
}

// deadLetterAwaitedLocked is deadLetterAwaited under e.dl.mu.
func (e *Engine) deadLetterAwaitedLocked(seq uint64) bool {
	_, held := e.dl.held[seq]
	_, watched := e.dl.m[seq]
	return held || watched
}

// AwaitedDeadLetters is how many dead letters the source of checkpoint key
// waits for (see AwaitStored).
func (e *Engine) AwaitedDeadLetters(key string) int {
	e.dl.mu.Lock()
	defer e.dl.mu.Unlock()
	if h := e.dl.byKey[key]; h != nil {
		return h.n
	}
	return 0
}

// AwaitStored returns nil once no dead letter of a batch with checkpoint
// key is awaited any more: each was acknowledged by its DLQ or parked (see
// deadLetterParked), or ctx's error. A source calls it when it starts
// reading the partition (stream) of key, before it commits or acks
// anything of it: the wait of a batch's Handle ends when its source stops
// (a restart, a rebalance), but the batch's checkpoint is stored with its
// dead letters, so the source resumes past them and would otherwise commit
// past messages whose dead letters the DLQ never took (CONTRACT §3). The
// held dead letters survive a restart (prefixDLWait records). A dead
// letter whose DLQ cannot be written is retried by the fire loop until it
// can (the engine is not ready meanwhile, see Err): AwaitStored waits as
// long.
func (e *Engine) AwaitStored(ctx context.Context, key string) error {
	for {
		e.dl.mu.Lock()
		h := e.dl.byKey[key]
		e.dl.mu.Unlock()
		if h == nil {
			return nil
		}
		select {
		case <-h.done:
		case <-ctx.Done():
			return fmt.Errorf("shard: %d dead letters of %q not yet acknowledged by their DLQ: %w", e.AwaitedDeadLetters(key), key, ctx.Err())
		}
	}
}

// Len is how many dead letters the batch holds.
func (d *DeadLetters) Len() int {
	if d == nil {
		return 0
	}
	return len(d.seqs)
}

// Parked is how many of the batch's dead letters were released unacknowledged
// (see Engine.deadLetterParked): they are in the store, not yet in the DLQ.
func (d *DeadLetters) Parked() int {
	if d == nil {
		return 0
	}
	d.e.dl.mu.Lock()
	defer d.e.dl.mu.Unlock()
	return d.parked
}

// Dropped is how many of the batch's dead letters an operator removed from
// the store (Engine.DropStuck) before their DLQ acknowledged them: they
// are in neither, except one whose publish was under way at the drop and
// that its DLQ took after all (it counts as dead-lettered in the metrics,
// and here as dropped: the drop decides before that publish ends).
func (d *DeadLetters) Dropped() int {
	if d == nil {
		return 0
	}
	d.e.dl.mu.Lock()
	defer d.e.dl.mu.Unlock()
	return d.dropped
}

// Wait returns nil once the DLQ broker acknowledged every dead letter of
// the batch, or ctx's error. A dead letter whose DLQ cannot be written is
// retried by the fire loop until it can: Wait waits as long, unless the
// DLQ refused it as this message (ErrRefused, not: was unreachable or
// failed as a whole) at its Retry.MaxAttempts-th attempt or later, which
// parks it in the store and ends its wait (see Parked), or an operator
// dropped it (Engine.DropStuck, see Dropped). After Wait
// returned an error, this Wait no longer watches the batch's dead letters:
// they are still delivered from the store, and still held for the batch's
// checkpoint keys. The source did not commit, and the batch's checkpoint
// is stored with its dead letters, so when it reads the partition again
// (after a restart or a rebalance back to this bridge) it resumes past
// them, but first waits for them with AwaitStored, which holds the
// partition as this Wait did. A source with another store (a rebalance to
// another bridge) reads their messages again. A nil DeadLetters is done.
func (d *DeadLetters) Wait(ctx context.Context) error {
	if d == nil {
		return nil
	}
	select {
	case <-d.done:
		return nil
	case <-ctx.Done():
	}
	d.e.dl.mu.Lock()
	defer d.e.dl.mu.Unlock()
	if d.left == 0 {
		return nil // acknowledged meanwhile
	}
	for _, seq := range d.seqs {
		if d.e.dl.m[seq] == d {
			delete(d.e.dl.m, seq)
		}
	}
	return fmt.Errorf("shard: %d of %d dead letters not yet acknowledged by their DLQ: %w", d.left, len(d.seqs), ctx.Err())
}

// dlFailure is a dead letter of a shard whose last delivery failed and
// that its DLQ has not acknowledged since (shard.dlFailing).
type dlFailure struct {
	// err is the last failure; for a parked one, the last refusal.
	err error
	// at orders failures engine-wide (Engine.dlTick): the highest is the
	// last one.
	at     uint64
	parked bool
	// fire is where its t key is: the next try (as of the last failure,
	// or the prefixDLFailure record read at open).
	fire int64
	// dest is its DLQ ("kafka:NAME", "nats:SUBJECT"); "" for one read at
	// open whose stored task does not decode.
	dest string
}

// dlFailedLocked records a failed delivery of the dead letter seq. refused
// says the DLQ refused it as this message (ErrRefused) with
// Retry.MaxAttempts attempts or more: it enters the parked set, where it
// stays until its DLQ acknowledges it or it leaves the store. It reports
// whether it entered the parked set now.
func (s *shard) dlFailedLocked(seq uint64, fire int64, dest string, err error, refused bool) (parkedNow bool) {
	e := s.e
	f, ok := s.dlFailing[seq]
	prev := f // as the shard counted it
	if ok {
		s.dlUncountLocked(f)
	}
	switch {
	case refused:
		f.err, f.at = err, e.dlTick.Add(1)
		if !f.parked {
			f.parked, parkedNow = true, true
			e.m.DeadLettersParked.Inc()
			e.m.DeadLettersParkedNow.Inc()
		}
	case f.parked:
		// Parked already: it stays parked, with its last refusal.
	default:
		f.err, f.at = err, e.dlTick.Add(1)
	}
	f.fire, f.dest = fire, dest
	s.dlSetLocked(seq, f)
	if ok {
		s.dlLeftLocked(prev, false)
	}
	return parkedNow
}

// dlLeftLocked notes prev's DLQ in dlqLeft if prev, a failure the shard
// no longer counts as such, was its last failing dead letter of that DLQ
// that is not parked (see dlqClearedLocked); gone: it left the store
// (dropped), noted in dlqGone, or in dlqParkGone for a parked one.
func (s *shard) dlLeftLocked(prev dlFailure, gone bool) {
	if prev.dest == "" {
		return
	}
	if prev.parked {
		if gone && !slices.Contains(s.dlqParkGone, prev.dest) {
			s.dlqParkGone = append(s.dlqParkGone, prev.dest)
		}
		return
	}
	if gone && !slices.Contains(s.dlqGone, prev.dest) {
		s.dlqGone = append(s.dlqGone, prev.dest)
	}
	if _, failing := s.dlByDest[prev.dest]; !failing && !slices.Contains(s.dlqLeft, prev.dest) {
		s.dlqLeft = append(s.dlqLeft, prev.dest)
	}
}

// dlDoneLocked forgets the dead letter seq: its DLQ acknowledged it. It
// reports whether it was parked.
func (s *shard) dlDoneLocked(seq uint64) (wasParked bool) {
	return s.dlForgetLocked(seq, false)
}

// dlGoneLocked forgets the dead letter seq: it left the store (dropped by
// an operator, gone before it was read) or no longer decodes.
func (s *shard) dlGoneLocked(seq uint64) {
	s.dlForgetLocked(seq, true)
}

func (s *shard) dlForgetLocked(seq uint64, gone bool) (wasParked bool) {
	f, ok := s.dlFailing[seq]
	if !ok {
		return false
	}
	delete(s.dlFailing, seq)
	s.dlUncountLocked(f)
	s.dlLeftLocked(f, gone)
	if f.parked {
		s.e.m.DeadLettersParkedNow.Dec()
	}
	return f.parked
}

// dlLast is the last failure of a set of dead letters, by dlFailure.at.
type dlLast struct {
	err error
	at  uint64
}

// note makes f's failure the last one if it came later.
func (l *dlLast) note(f dlFailure) {
	if l.err == nil || f.at > l.at {
		*l = dlLast{f.err, f.at}
	}
}

// dlDest is what a shard's failing dead letters that are not parked owe one
// DLQ: how many there are, and the last failure recorded for any of them
// since the count was last 0. That failure stays after its own dead letter
// was acknowledged or parked, until another of them fails again (within
// Retry.Max): Err names it as the DLQ's last failure, which the counts do
// not depend on. Failures read at open whose dead letter does not decode,
// so that their DLQ is unknown until they fail again, share the DLQ "".
type dlDest struct {
	n    int
	last dlLast
}

// dlSetLocked stores f as the failure of the dead letter seq, which
// dlFailing does not hold, and counts it in the shard's sums (dlHeld and
// dlByDest, or dlParked and dlParkedLast), which Err reads instead of
// every failing dead letter. The failing gauge follows dlHeld here and in
// dlUncountLocked (the parked one is moved by the callers, which know when
// a dead letter enters or leaves the parked set rather than is counted
// again).
func (s *shard) dlSetLocked(seq uint64, f dlFailure) {
	if s.dlFailing == nil {
		s.dlFailing = make(map[uint64]dlFailure)
	}
	s.dlFailing[seq] = f
	if f.parked {
		s.dlParked++
		s.dlParkedLast.note(f)
		return
	}
	s.dlHeld++
	s.e.m.DeadLettersFailing.Inc()
	if s.dlByDest == nil {
		s.dlByDest = make(map[string]*dlDest)
	}
	d := s.dlByDest[f.dest]
	if d == nil {
		d = &dlDest{}
		s.dlByDest[f.dest] = d
	}
	d.n++
	d.last.note(f)
}

// dlUncountLocked takes f, a failure dlFailing held, out of the shard's
// sums (see dlSetLocked).
func (s *shard) dlUncountLocked(f dlFailure) {
	if f.parked {
		if s.dlParked--; s.dlParked == 0 {
			s.dlParkedLast = dlLast{}
		}
		return
	}
	s.dlHeld--
	s.e.m.DeadLettersFailing.Dec()
	if d := s.dlByDest[f.dest]; d != nil {
		if d.n--; d.n == 0 {
			delete(s.dlByDest, f.dest)
		}
	}
}

// deadLetterErr reports the dead letters whose delivery fails, over all
// shards: those held (their DLQ failing as a whole, or not yet refused
// Retry.MaxAttempts times), with the last failure of each DLQ (two broken
// DLQs are both named, so fixing one does not leave the other unsaid), and
// those parked. Nil when there are none. It reads each shard's sums, not
// its failing dead letters (readiness is polled while they pile up by the
// hundred thousand: 35 ms a call with 200 000, hunt H195), and which of
// the dead letters sources wait for fail (awaitedFailingLocked), in the
// same hold of each shard, so that the held-by-source count is never more
// than the failing one.
func (e *Engine) deadLetterErr() error {
	var (
		nHeld, nParked int
		nAwaited       int                   // of nHeld, read in the same hold of each shard
		held           = map[string]dlLast{} // by DLQ
		parked         dlLast
	)
	for _, s := range e.shards {
		s.mu.Lock()
		nHeld += s.dlHeld
		nAwaited += s.awaitedFailingLocked()
		if s.dlParked > 0 {
			nParked += s.dlParked
			if parked.err == nil || s.dlParkedLast.at > parked.at {
				parked = s.dlParkedLast
			}
		}
		for dest, d := range s.dlByDest {
			if l, ok := held[dest]; !ok || d.last.at > l.at {
				held[dest] = d.last
			}
		}
		s.mu.Unlock()
	}
	var errs []error
	if nHeld > 0 {
		var heldErrs []error
		for _, dest := range slices.Sorted(maps.Keys(held)) {
			heldErrs = append(heldErrs, held[dest].err)
		}
		errs = append(errs, fmt.Errorf("shard: dead-letter delivery failing (%d dead letters, %d of them held by their source partition, which does not commit past them; retrying with backoff): %w", nHeld, nAwaited, errors.Join(heldErrs...)))
	}
	if nParked > 0 {
		errs = append(errs, fmt.Errorf("shard: %d dead letters parked: refused by their DLQ, kept in the store and retried with backoff; last refusal: %w", nParked, parked.err))
	}
	return errors.Join(errs...)
}

// awaitedFailingLocked is how many of the shard's dead letters a source
// waits for (e.dl.held, e.dl.m) fail and are not parked. Only the dead
// letters of bad input hold their source partition; a publish-failed one
// (a task that failed at its due time) holds nothing. It takes e.dl.mu
// under s.mu, as the fire loop does, and walks the smaller side: the
// shard's failing dead letters, or those sources wait for (each shard
// looking up every awaited one took 2.6 ms a call with 20 000 of them
// over 8 shards, twice the walk it replaced).
func (s *shard) awaitedFailingLocked() int {
	if s.dlHeld == 0 {
		return 0
	}
	e := s.e
	e.dl.mu.Lock()
	defer e.dl.mu.Unlock()
	n := 0
	if len(s.dlFailing) <= len(e.dl.held)+len(e.dl.m) {
		for seq, f := range s.dlFailing {
			if !f.parked && e.deadLetterAwaitedLocked(seq) {
				n++
			}
		}
		return n
	}
	for seq := range e.dl.held {
		if f, ok := s.dlFailing[seq]; ok && !f.parked {
			n++
		}
	}
	for seq := range e.dl.m {
		if _, held := e.dl.held[seq]; held {
			continue
		}
		if f, ok := s.dlFailing[seq]; ok && !f.parked {
			n++
		}
	}
	return n
}

// loadDLFailuresLocked restores at open the shard's dead letters whose
// last delivery failed before the restart (prefixDLFailure records), so
// that Err and the failing and parked gauges report them at once rather than after
// their next failed try. A record whose dead letter is not stored where it
// says (a version without these records retried or delivered it) is
// dropped.
func (s *shard) loadDLFailuresLocked() error {
	e := s.e
	return s.loadRecords(dlFailureKey(s.id, 0), dlFailureKey(s.id+1, 0), "dead-letter failure", func(k, v []byte) (bool, error) {
		_, seq, fire, parked, text, ok := parseDLFailure(k, v)
		if !ok {
			return false, nil
		}
		val, closer, err := e.db.Get(appendTaskKey(nil, s.id, fire, seq))
		if errors.Is(err, pebble.ErrNotFound) {
			return false, nil
		}
		if err != nil {
			return false, err
		}
		// Its DLQ, so that the failure is logged and ends as any
		// (logRestoredDLQs); one that does not decode is found so by the
		// fire loop. Decoded from Pebble's own bytes, which DecodeTask
		// copies what it keeps from: a copy first (getCopy) made open
		// copy each failing dead letter twice.
		var t codec.Task
		dest := ""
		if codec.DecodeTask(val, &t) == nil {
			dest = t.Destination()
		}
		closer.Close()
		s.dlSetLocked(seq, dlFailure{err: fmt.Errorf("%w"+dlBeforeRestart+"%s", errDLFailedBefore, text), at: e.dlTick.Add(1), parked: parked, fire: fire, dest: dest})
		if parked {
			e.m.DeadLettersParkedNow.Inc()
		}
		return true, nil
	})
}

// loadRecords reads the shard's records in [lo, hi) at open: visit says
// whether to keep each one; those it does not keep are deleted in one
// unsynced commit (losing that delete in a crash only means dropping them
// again at the next open). A read error of visit stops the scan.
func (s *shard) loadRecords(lo, hi []byte, what string, visit func(k, v []byte) (keep bool, err error)) error {
	e := s.e
	var stale [][]byte
	err := safeCall(func() error {
		it, err := e.db.NewIter(&pebble.IterOptions{LowerBound: lo, UpperBound: hi})
		if err != nil {
			return err
		}
		for it.First(); it.Valid(); it.Next() {
			keep, err := visit(it.Key(), it.Value())
			if err != nil {
				it.Close()
				return err
			}
			if !keep {
				stale = append(stale, slices.Clone(it.Key()))
			}
		}
		return it.Close()
	})
	if err != nil {
		return fmt.Errorf("shard %d: read %s records: %w", s.id, what, err)
	}
	if len(stale) == 0 {
		return nil
	}
	b := e.db.NewBatch()
	defer b.Close()
	for _, k := range stale {
		b.Delete(k, nil)
	}
	if err := safeCall(func() error { return b.Commit(pebble.NoSync) }); err != nil {
		return fmt.Errorf("shard %d: drop stale %s records: %w", s.id, what, err)
	}
	return nil
}

// errDLFailedBefore wraps the failure of a dead letter recorded before a
// restart: its text is all that is kept.
var errDLFailedBefore = errors.New("dead-letter delivery failed")

// dlBeforeRestart joins errDLFailedBefore to the text of the failure
// recorded (loadDLFailuresLocked).
const dlBeforeRestart = " (before the last restart): "

// dlFailedText is the failure text s, that of a failure read at open
// with what loadDLFailuresLocked added taken off: the text it was
// recorded with, the same as the next failure's if the cause is the same.
func dlFailedText(s string) string {
	return strings.TrimPrefix(s, errDLFailedBefore.Error()+dlBeforeRestart)
}

// loadDLWaitsLocked restores at open the shard's dead letters a source
// waits for (prefixDLWait records), so that a source that starts reading
// their checkpoint key waits for them (AwaitStored) as the Handle of their
// batch did before the restart. It runs after loadDLFailuresLocked. A
// record is dropped when it does not decode, when its dead letter is
// parked (the commit that parks one deletes its record), or when its dead
// letter is not stored where it says (a version without these records
// delivered it).
func (s *shard) loadDLWaitsLocked() error {
	e := s.e
	type held struct {
		seq  uint64
		keys []string
	}
	var found []held
	err := s.loadRecords(dlWaitKey(s.id, 0), dlWaitKey(s.id+1, 0), "awaited dead-letter", func(k, v []byte) (bool, error) {
		_, seq, fire, keys, err := parseDLWait(k, v)
		if err != nil {
			e.log.Error("dropping an awaited dead-letter record that does not decode", zap.Int("shard", s.id), zap.Error(err))
			return false, nil
		}
		if f, failing := s.dlFailing[seq]; failing {
			// loadDLFailuresLocked checked it is stored.
			if f.parked {
				return false, nil
			}
		} else if _, stored, err := getCopy(e.db, appendTaskKey(nil, s.id, fire, seq)); err != nil || !stored {
			return false, err
		}
		found = append(found, held{seq, keys})
		return true, nil
	})
	if err != nil {
		return err
	}
	e.dl.mu.Lock()
	for _, h := range found {
		e.holdLocked(h.seq, h.keys)
	}
	e.dl.mu.Unlock()
	return nil
}
