package shard

import (
	"context"
	"errors"

	"github.com/delaybridge/delaybridge/codec"
)

// Engine is the durable delay engine: one Pebble store, N shards, each with
// a timing wheel and a fire loop.
type Engine struct {
	opts Options
}

var errNotImplemented = errors.New("shard: not implemented yet")

// Open opens the store at opts.Dir and recovers pending tasks. The engine is
// ready when Open returns.
func Open(opts Options) (*Engine, error) {
	return nil, errNotImplemented
}

// Ingest durably stores a batch of tasks and checkpoints in one synced commit.
func (e *Engine) Ingest(ctx context.Context, tasks []codec.Task, cps []Checkpoint) error {
	return errNotImplemented
}

// Checkpoint returns the stored offset of a checkpoint key.
func (e *Engine) Checkpoint(key string) (offset int64, ok bool, err error) {
	return 0, false, errNotImplemented
}

// Run runs the fire loops and the horizon loader until ctx is done.
func (e *Engine) Run(ctx context.Context, sink Sink) error {
	return errNotImplemented
}

// Lookup reports a pending task.
func (e *Engine) Lookup(source, id string) (TaskInfo, error) {
	return TaskInfo{}, ErrNotFound
}

// Cancel removes a pending task (admin cancel).
func (e *Engine) Cancel(source, id string) error {
	return errNotImplemented
}

// Stats describes the engine.
func (e *Engine) Stats() Stats { return Stats{} }

// Err is nil when the engine is healthy.
func (e *Engine) Err() error { return nil }

// Close syncs and closes the store.
func (e *Engine) Close() error { return nil }
