package bridge

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/logthrottle"
	"github.com/delaybridge/delaybridge/shard"
)

// Engine is what the pipeline needs of the durable engine (*shard.Engine).
type Engine interface {
	IngestAwait(ctx context.Context, tasks []codec.Task, cps []shard.Checkpoint) (*shard.DeadLetters, error)
	Checkpoint(key string) (offset int64, ok bool, err error)
	LoadCheckpoint(key string) (cp shard.Checkpoint, ok bool, err error)
}

// Pipeline is the Handler every source feeds: it parses a batch and makes it
// durable in one engine commit. It is safe for concurrent use by several
// sources (the engine serialises what must be serialised).
type Pipeline struct {
	eng Engine
	log *zap.Logger
	// tasks recycles the per-batch task slices: Ingest does not keep them.
	tasks sync.Pool
	// stopGrace: see the constant; tests shorten it.
	stopGrace time.Duration
	// misspelled throttles the line about a header that looks like a
	// control header but is not one, per source and header name; the
	// lines held back for names it forgot before their next line are
	// counted in the next line's held_back_forgotten (review R210). now:
	// nil is time.Now (tests set it).
	misspelled logthrottle.Throttle
	now        func() time.Time
}

// warnMisspelled says, once per 30 s per source and header name, that
// task t was taken in without its header key, which looks like the
// control header name but is not read: a delay_id ignored gives the task
// another id, a delay_target its source's default target.
func (p *Pipeline) warnMisspelled(t *codec.Task, key, name string) {
	now := time.Now
	if p.now != nil {
		now = p.now
	}
	held, forgotten, ok := p.misspelled.AllowEachForgotten(now(), t.Source+"\x00"+key)
	if !ok {
		return
	}
	f := []zap.Field{zap.String("source", t.Source), zap.String("header", key), zap.String("control_header", name),
		zap.String("origin", t.Origin), zap.String("task_id", t.ID), zap.Int("held_back", held), logthrottle.Forgotten(forgotten)}
	p.log.Warn("a header looks like a control header but is not one, so it is not read: the message is taken in without it (a delivered message carries it as an ordinary header)", f...)
}

// NewPipeline returns a Pipeline ingesting into eng.
func NewPipeline(eng Engine, log *zap.Logger) *Pipeline {
	if log == nil {
		log = zap.NewNop()
	}
	return &Pipeline{eng: eng, log: log, stopGrace: stopGrace}
}

// Handle parses every message of b and ingests the result durably. Messages
// that cannot be scheduled become dead letters in the same commit, so one bad
// message never stalls its partition. When the batch has dead letters,
// Handle returns only once their DLQ acknowledged them (CONTRACT §3), or
// with ctx's error: the source then does not commit, and a DLQ that cannot
// be written (unreachable, not authorized, no stream, full) holds its
// partition, the bridge not ready meanwhile. The exception is a dead letter
// its DLQ refuses as this message (shard.ErrRefused: over its size limit, a
// record the broker rejects) at the last attempt of the retry policy: it is
// parked (kept in the store, retried, the bridge not ready) and Handle
// returns, so the source commits past it. A Handle that returns ctx's error
// leaves the batch's dead letters held for its checkpoint keys, in the
// store too: the source that reads that partition again, after a restart
// or a rebalance back to this bridge, waits for them (AwaitDeadLetters)
// before it commits anything of it.
func (p *Pipeline) Handle(ctx context.Context, b *Batch) error {
	if len(b.Items) == 0 && len(b.Checkpoints) == 0 {
		return nil
	}
	var tasks []codec.Task
	if v, ok := p.tasks.Get().(*[]codec.Task); ok {
		tasks = (*v)[:0]
	}
	for i := range b.Items {
		it := &b.Items[i]
		if it.Rules == nil {
			return fmt.Errorf("bridge: message %s has no source rules", it.Msg.Origin())
		}
		tasks = append(tasks, codec.Parse(&it.Msg, it.Rules))
	}
	dls, err := p.eng.IngestAwait(ctx, tasks, b.Checkpoints)
	if err != nil {
		return fmt.Errorf("bridge: ingest batch of %d: %w", len(tasks), err)
	}
	// The engine counts what it took in (delaybridge_ingested_total); the
	// pipeline only says why a message was dead-lettered, and warns of a
	// control header misspelled on a message taken in without it (the
	// dead letters' details name it already).
	for i := range tasks {
		if t := &tasks[i]; t.Kind == codec.KindDeadLetter {
			p.log.Warn("dead-lettered message",
				zap.String("code", string(t.Code)),
				zap.String("detail", t.Detail),
				zap.String("origin", t.Origin),
				zap.String("dlq", t.Destination()))
		} else if key, name, ok := codec.Misspelled(&b.Items[i].Msg); ok {
			p.warnMisspelled(t, key, name)
		}
	}
	n := len(tasks)
	clear(tasks) // drop payload references before pooling
	tasks = tasks[:0]
	p.tasks.Put(&tasks)
	// CONTRACT §3: the source commits only after the DLQ write is
	// acknowledged. The dead letters are durable already; the fire loop
	// publishes them at once and retries a failing DLQ (not ready, logged)
	// until it takes them, so this waits as long; except for a dead letter
	// the DLQ refused as this message (shard.ErrRefused) at the last
	// attempt of the retry policy, parked in the store so that it does not
	// stall its partition for good.
	if dls == nil {
		return nil
	}
	// A source that stops cancels ctx; the engine runs until the sources
	// have stopped, so a working DLQ still acknowledges within moments, and
	// waiting that long keeps the in-flight batch's commit (and its dead
	// letters out of the DLQ a second time after the restart).
	if b.DeadLetterWait != nil {
		b.DeadLetterWait()
	}
	wctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	stop := context.AfterFunc(ctx, func() {
		t := time.AfterFunc(p.stopGrace, cancel)
		context.AfterFunc(wctx, func() { t.Stop() })
	})
	defer stop()
	if err := dls.Wait(wctx); err != nil {
		return fmt.Errorf("bridge: batch of %d: %w", n, err)
	}
	if k := dls.Parked(); k > 0 {
		p.log.Warn("committing past dead letters their DLQ refused as these messages at the last attempt of the retry policy; they stay in the store and are retried",
			zap.Int("parked", k), zap.Int("dead_letters", dls.Len()))
	}
	if k := dls.Dropped(); k > 0 {
		p.log.Warn("committing past dead letters an operator dropped from the store (admin API); unless one was being published at the drop and its DLQ took it, they are in neither the store nor the DLQ",
			zap.Int("dropped", k), zap.Int("dead_letters", dls.Len()))
	}
	return nil
}

// stopGrace is how long Handle still waits for a batch's dead letters to be
// acknowledged by their DLQ after its context ended.
const stopGrace = 2 * time.Second

// Checkpoint returns the stored high-water offset for a source partition.
func (p *Pipeline) Checkpoint(key string) (int64, bool, error) {
	return p.eng.Checkpoint(key)
}

// LoadCheckpoint returns the stored checkpoint for a source partition with
// its fingerprint; it implements CheckpointLoader.
func (p *Pipeline) LoadCheckpoint(key string) (shard.Checkpoint, bool, error) {
	return p.eng.LoadCheckpoint(key)
}

var _ CheckpointLoader = (*Pipeline)(nil)

// storedAwaiter is what an Engine offers to hold a source for dead letters
// stored before it started (*shard.Engine does).
type storedAwaiter interface {
	AwaitedDeadLetters(key string) int
	AwaitStored(ctx context.Context, key string) error
}

// AwaitedDeadLetters implements DeadLetterAwaiter: 0 with an engine that
// keeps no awaited dead letters.
func (p *Pipeline) AwaitedDeadLetters(key string) int {
	if a, ok := p.eng.(storedAwaiter); ok {
		return a.AwaitedDeadLetters(key)
	}
	return 0
}

// AwaitDeadLetters implements DeadLetterAwaiter; with an engine that keeps
// no awaited dead letters it returns nil at once.
func (p *Pipeline) AwaitDeadLetters(ctx context.Context, key string) error {
	if a, ok := p.eng.(storedAwaiter); ok {
		if err := a.AwaitStored(ctx, key); err != nil {
			return fmt.Errorf("bridge: %w", err)
		}
	}
	return nil
}

var _ DeadLetterAwaiter = (*Pipeline)(nil)

// ErrNoTransport is returned for a task aimed at a transport the bridge has
// no publisher for (e.g. "nats:x" on a Kafka-only bridge whose config changed
// after the task was stored) that Check let through: the service's Check
// rejects such a task (bad-target) when its DLQ's transport is configured,
// so this is the task with nowhere to go, and dead letters whose DLQ's
// transport left. It wraps shard.ErrUnavailable: the task waits in the
// store without using its retry budget (readiness names the transport)
// until the bridge runs with that transport again, or an operator cancels
// it.
var ErrNoTransport = errors.New("bridge: no publisher for transport")

// Sinks routes a fire batch to the publisher of each task's transport. It
// keeps the batch order within a transport and publishes to both transports
// concurrently.
type Sinks struct {
	Kafka shard.Sink
	NATS  shard.Sink
	// Check, if set, is asked about every task (not dead letters: their
	// DLQ is the operator's) before it is published, as the config may
	// have changed since the task was checked at ingest (targets.allow
	// narrowed, the target made a delay source, its transport taken out).
	// A non-nil error is returned for the task instead of publishing it; a
	// *shard.RejectedError dead-letters it at once.
	Check func(t *codec.Task) error
}

// Deliver implements shard.Sink.
func (s Sinks) Deliver(ctx context.Context, batch []*codec.Task) []error {
	var kb, nb []*codec.Task
	var ki, ni []int
	var errs []error
	fail := func(i int, err error) {
		if errs == nil {
			errs = make([]error, len(batch))
		}
		errs[i] = err
	}
	for i, t := range batch {
		var sink shard.Sink
		switch t.Transport {
		case codec.TransportKafka:
			sink = s.Kafka
		case codec.TransportNATS:
			sink = s.NATS
		}
		// Checked first: a task whose transport left the config may be
		// rejected (when its DLQ's transport did not leave too).
		if s.Check != nil && t.Kind != codec.KindDeadLetter {
			if err := s.Check(t); err != nil {
				fail(i, err)
				continue
			}
		}
		if sink == nil {
			fail(i, fmt.Errorf("%w %s (target %s; not in the config): %w", ErrNoTransport, t.Transport, t.Target, shard.ErrUnavailable))
			continue
		}
		if t.Transport == codec.TransportKafka {
			kb, ki = append(kb, t), append(ki, i)
		} else {
			nb, ni = append(nb, t), append(ni, i)
		}
	}
	var kerrs, nerrs []error
	var wg sync.WaitGroup
	if len(kb) > 0 && len(nb) > 0 {
		wg.Go(func() { kerrs = s.Kafka.Deliver(ctx, kb) })
		nerrs = s.NATS.Deliver(ctx, nb)
		wg.Wait()
	} else if len(kb) > 0 {
		kerrs = s.Kafka.Deliver(ctx, kb)
	} else if len(nb) > 0 {
		nerrs = s.NATS.Deliver(ctx, nb)
	}
	for j, err := range kerrs {
		if err != nil {
			fail(ki[j], err)
		}
	}
	for j, err := range nerrs {
		if err != nil {
			fail(ni[j], err)
		}
	}
	return errs
}
