package nats

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"

	"github.com/delaybridge/delaybridge/bridge"
	"github.com/delaybridge/delaybridge/codec"
)

// RawPipe measures the adapter without the engine: a Source on fromStream
// (a fresh durable consumer filtered on fromSubject, deleted afterwards)
// hands each batch to a Sink that publishes it to toSubject and waits for
// the PubAcks; the batch is acked after that. No delay, no store. It returns
// the time from the start until n messages were delivered.
//
// The consumer starts at the beginning of the stream, so fromStream should
// hold at least n messages on fromSubject (or they must arrive meanwhile).
func RawPipe(ctx context.Context, url, fromStream, fromSubject, toSubject string, n int) (time.Duration, error) {
	if n <= 0 {
		return 0, fmt.Errorf("%w: raw pipe: n must be positive", ErrConfig)
	}
	nc, err := Connect(Config{URL: url, Name: "delaybridge-rawpipe"})
	if err != nil {
		return 0, err
	}
	defer nc.Close()
	consumer := "rawpipe_" + nuid.Next()
	cfg := Config{
		Stream:   fromStream,
		Consumer: consumer,
		Create:   true,
		Sources:  []SourceConfig{{Subject: fromSubject}},
	}
	start := time.Now()
	src, err := NewSource(nc, cfg)
	if err != nil {
		return 0, err
	}
	defer func() {
		if js, err := jetstream.New(nc); err == nil {
			dctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			_ = js.DeleteConsumer(dctx, fromStream, consumer)
			cancel()
		}
	}()
	sink, err := NewSink(nc, cfg)
	if err != nil {
		return 0, err
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	p := &pipe{sink: sink, target: toSubject, n: int64(n), done: make(chan struct{})}
	runErr := make(chan error, 1)
	go func() { runErr <- src.Run(ctx, p) }()
	select {
	case <-p.done:
	case err := <-runErr:
		if err == nil {
			err = ctx.Err()
		}
		return 0, fmt.Errorf("nats raw pipe: source stopped after %d of %d: %w", p.count.Load(), n, err)
	case <-ctx.Done():
		err := ctx.Err()
		if last := p.err.Load(); last != nil {
			err = fmt.Errorf("%w (last delivery error: %w)", err, *last)
		}
		return 0, fmt.Errorf("nats raw pipe: %d of %d delivered: %w", p.count.Load(), n, err)
	}
	elapsed := time.Since(start)
	cancel()
	<-runErr
	return elapsed, nil
}

// pipe is a bridge.Handler that delivers each batch at once.
type pipe struct {
	sink   *Sink
	target string
	n      int64
	count  atomic.Int64
	done   chan struct{}
	closed bool
	tasks  []codec.Task
	ptrs   []*codec.Task
	err    atomic.Pointer[error]
}

func (p *pipe) Checkpoint(string) (int64, bool, error) { return 0, false, nil }

func (p *pipe) Handle(ctx context.Context, b *bridge.Batch) error {
	p.tasks = p.tasks[:0]
	p.ptrs = p.ptrs[:0]
	now := time.Now().UnixMilli()
	for i := range b.Items {
		m := &b.Items[i].Msg
		p.tasks = append(p.tasks, codec.Task{
			Kind: codec.KindSchedule, ID: m.Origin(), Source: m.Source, Origin: m.Origin(),
			Offset: m.Offset, Due: now, Transport: codec.TransportNATS, Target: p.target,
			Value: m.Value, Headers: m.Headers,
		})
	}
	for i := range p.tasks {
		p.ptrs = append(p.ptrs, &p.tasks[i])
	}
	if errs := p.sink.Deliver(ctx, p.ptrs); errs != nil {
		err := errors.Join(errs...)
		p.err.Store(&err) // the source retries the batch; kept for the report
		return err
	}
	p.err.Store(nil)
	if p.count.Add(int64(len(p.ptrs))) >= p.n && !p.closed {
		p.closed = true
		close(p.done)
	}
	return nil
}
