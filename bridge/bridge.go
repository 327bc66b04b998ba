// Package bridge joins delay sources (Kafka topics, JetStream streams) and
// target publishers to the durable engine of package shard.
//
// A Source hands batches of raw messages to a Handler; the Pipeline handler
// parses each message with package codec and ingests the whole batch (tasks,
// cancels, dead letters and the partition high-water offsets) into the engine
// in one synced commit. The Source commits or acks the batch only after
// Handle returned nil. Due tasks leave the engine through a shard.Sink; the
// Sinks router splits a fire batch by transport.
package bridge

import (
	"context"
	"sync"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/shard"
)

// Source reads one transport's delay sources and hands batches to a Handler.
//
// Ack contract: a message is committed (Kafka) or acked (JetStream) only
// after Handle returned nil for the batch that holds it. When Handle returns
// an error the source neither commits nor skips: it retries the same batch
// with backoff until Handle succeeds or ctx ends. Run returns nil when ctx is
// cancelled, after the batch in flight was handled or abandoned unacked.
type Source interface {
	Run(ctx context.Context, h Handler) error
	Close() error
}

// Handler takes batches from sources.
type Handler interface {
	// Handle makes the batch durable; it returns only when it is.
	Handle(ctx context.Context, b *Batch) error
	// Checkpoint returns the highest offset stored for a checkpoint key, so
	// a source can seek past messages already held after a crash.
	Checkpoint(key string) (offset int64, ok bool, err error)
}

// CheckpointLoader is implemented by Handlers that return the whole stored
// checkpoint, its Fingerprint included (the Pipeline does). A source that
// stores fingerprints checks with it, when it starts reading a partition,
// that the log is the one the checkpoint was taken from; with a Handler
// that does not implement it, it has no fingerprint to check.
type CheckpointLoader interface {
	LoadCheckpoint(key string) (cp shard.Checkpoint, ok bool, err error)
}

// DeadLetterAwaiter is implemented by Handlers that keep, across restarts
// and partition hand-overs, the dead letters whose DLQ acknowledgement a
// source waits for (the Pipeline does). Handle's wait for a batch's dead
// letters ends when its source stops, but the batch's checkpoint is stored
// with them, so a source that reads the partition (stream) again resumes
// past their messages. Before it commits or acks anything of a checkpoint
// key, it calls AwaitDeadLetters, which returns once every dead letter of
// that key's batches was acknowledged by its DLQ or parked, or with ctx's
// error (CONTRACT §3).
type DeadLetterAwaiter interface {
	// AwaitedDeadLetters is how many dead letters key waits for now.
	AwaitedDeadLetters(key string) int
	AwaitDeadLetters(ctx context.Context, key string) error
}

// Item is a source message and the rules of the configured source it came from.
type Item struct {
	Msg   codec.Message
	Rules *codec.Rules
}

// Batch is what a source hands over at once: messages in source order and
// the high-water offsets to store with them. Checkpoints[0] is the source
// position; an adapter may store more facts with it (the NATS source adds
// the identity of the stream the position belongs to).
type Batch struct {
	Items       []Item
	Checkpoints []shard.Checkpoint
	// DeadLetterWait, when set, is called by Pipeline.Handle before it
	// waits for the batch's dead letters to be acknowledged by their DLQ:
	// a wait as long as the DLQ cannot be written (CONTRACT §3). The Kafka
	// source moves the partition's fetched records out of its fetch
	// memory budget once such a wait has lasted a second, so that it does
	// not stop its other partitions, or other sources'.
	DeadLetterWait func()
}

// Healther is implemented by sources and sinks that can report their own
// health for /readyz; nil means healthy.
type Healther interface {
	Health() error
}

// CatchingUp is a Source that tells when it has read what it held when
// it started: every partition (the stream) up to its end as it stood then,
// or further. The service pauses firing until its sources have (at most
// catch_up_wait), so a cancel or replace in a backlog is read before the
// overdue task it names fires.
type CatchingUp interface {
	// CaughtUp is closed once the source has caught up (for the first
	// time since it was built).
	CaughtUp() <-chan struct{}
}

// Signal is a channel closed at most once (a CaughtUp); the zero value
// is ready to use.
type Signal struct {
	mu sync.Mutex
	ch chan struct{}
}

// C returns the channel.
func (o *Signal) C() <-chan struct{} {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.chLocked()
}

func (o *Signal) chLocked() chan struct{} {
	if o.ch == nil {
		o.ch = make(chan struct{})
	}
	return o.ch
}

// Close closes the channel; it does nothing the second time.
func (o *Signal) Close() {
	o.mu.Lock()
	defer o.mu.Unlock()
	if ch := o.chLocked(); !isClosed(ch) {
		close(ch)
	}
}

// Closed reports whether Close was called.
func (o *Signal) Closed() bool { return isClosed(o.C()) }

func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}
