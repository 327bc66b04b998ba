package shard

import (
	"context"
	"fmt"
	"sync"

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
}

// dlWaits is the registry of awaited dead letters, by store sequence.
type dlWaits struct {
	mu sync.Mutex
	m  map[uint64]*DeadLetters
}

// awaitDeadLetters registers the batch's dead letters (acts hold their
// sequences). It runs after the batch is durable and before the wheels see
// it, so no delivery comes before its waiter. Nil without dead letters.
func (e *Engine) awaitDeadLetters(tasks []codec.Task, acts []ingestAction) *DeadLetters {
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
	}
	d.left = len(d.seqs)
	return d
}

// deadLetterAcked marks the dead letter seq as acknowledged by its DLQ.
func (e *Engine) deadLetterAcked(seq uint64) { e.releaseDeadLetter(seq, false) }

// deadLetterParked releases the wait for the dead letter seq, which its
// DLQ refused (not: was unreachable for) Retry.MaxAttempts times, so that
// one message the DLQ will not take (larger than the DLQ topic allows, a
// subject the bridge may not publish to) does not stall its source
// partition for good (CONTRACT §3: one bad message never stalls its
// partition). Nothing is dropped: the dead letter stays in the store and
// is retried at the longest backoff until the DLQ takes it, and the engine
// reports the failing DLQ (Err) meanwhile. It reports whether a source was
// waiting for it.
func (e *Engine) deadLetterParked(seq uint64) bool { return e.releaseDeadLetter(seq, true) }

func (e *Engine) releaseDeadLetter(seq uint64, parked bool) bool {
	e.dl.mu.Lock()
	defer e.dl.mu.Unlock()
	d, ok := e.dl.m[seq]
	if !ok {
		return false
	}
	delete(e.dl.m, seq)
	if parked {
		d.parked++
	}
	if d.left--; d.left == 0 {
		close(d.done)
	}
	return true
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

// Wait returns nil once the DLQ broker acknowledged every dead letter of
// the batch, or ctx's error. A dead letter whose DLQ cannot be written is
// retried by the fire loop until it can: Wait waits as long, unless the
// DLQ refused it Retry.MaxAttempts times (not: was unreachable), which
// parks it in the store and ends its wait (see Parked). After Wait
// returned an error, the batch's dead letters are no longer watched (they
// are still delivered, and the source, which did not commit, reads their
// messages again after a restart or rebalance). A nil DeadLetters is done.
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
