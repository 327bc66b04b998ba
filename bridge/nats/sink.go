package nats

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/bridge"
	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/shard"
)

// dueLayout is delay-due's format: RFC 3339, milliseconds, UTC.
const dueLayout = "2006-01-02T15:04:05.000Z07:00"

// Sink delivers due tasks to NATS subjects. It implements shard.Sink and
// bridge.Healther; Deliver may be called from several shards at once. See
// the package documentation for the Nats-Msg-Id of deliveries, the headers
// not forwarded, and core NATS delivery to subjects without a stream.
type Sink struct {
	nc      *natsgo.Conn
	js      jetstream.JetStream
	cfg     Config
	log     *zap.Logger
	pubOpts []jetstream.PublishOpt

	mu        sync.Mutex
	filters   []string // subject filters of the account's streams
	listed    bool
	listUntil time.Time
	now       func() time.Time
}

var (
	_ shard.Sink      = (*Sink)(nil)
	_ bridge.Healther = (*Sink)(nil)
)

// NewSink returns a Sink publishing on nc.
func NewSink(nc *natsgo.Conn, cfg Config) (*Sink, error) {
	cfg.setDefaults()
	// The window bounds each Deliver call; the library-wide cap only has to
	// be out of the way of several shards delivering at once.
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(1<<16))
	if err != nil {
		return nil, fmt.Errorf("nats sink: jetstream context: %w", err)
	}
	return &Sink{
		nc:  nc,
		js:  js,
		cfg: cfg,
		log: cfg.Logger,
		// No retries on "no responders": the Sink checks itself whether a
		// stream exists, instead of waiting 2x250ms for every such subject.
		pubOpts: []jetstream.PublishOpt{jetstream.WithRetryAttempts(0), jetstream.WithStallWait(cfg.PublishTimeout)},
		now:     time.Now,
	}, nil
}

// Health is nil while the connection is up.
func (s *Sink) Health() error { return connErr(s.nc) }

// DeliveryID is the Nats-Msg-Id of a delivery: the task id (its origin when
// it has none, as dead letters may) and its delay-due, so a redelivery of
// the same firing is a duplicate and a later firing of the same id is not.
func DeliveryID(t *codec.Task) string {
	id := t.ID
	if id == "" {
		id = t.Origin
	}
	for _, h := range t.Headers {
		if strings.EqualFold(h.Key, codec.HeaderDue) {
			return id + "|" + string(h.Value)
		}
	}
	return id + "|" + time.UnixMilli(t.Due).UTC().Format(dueLayout)
}

// streamFilters returns the subject filters of the account's streams,
// listed at most once per NoStreamTTL. known is false when the list could
// not be read; the caller then tries JetStream and reads "no responders".
func (s *Sink) streamFilters(ctx context.Context) (filters []string, known bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	if s.listed && now.Before(s.listUntil) {
		return s.filters, true
	}
	var out []string
	l := s.js.ListStreams(ctx)
	for info := range l.Info() {
		out = append(out, info.Config.Subjects...)
	}
	if err := l.Err(); err != nil {
		if !errors.Is(err, jetstream.ErrJetStreamNotEnabled) && !errors.Is(err, jetstream.ErrJetStreamNotEnabledForAccount) {
			s.log.Warn("nats sink: list streams failed", zap.Error(err))
			return nil, false
		}
		out = nil // no JetStream: every target is core NATS
	}
	s.filters, s.listed, s.listUntil = out, true, now.Add(s.cfg.NoStreamTTL)
	return out, true
}

// forgetStreams makes the next Deliver list the streams again.
func (s *Sink) forgetStreams() {
	s.mu.Lock()
	s.listed = false
	s.mu.Unlock()
}

// noStream reports whether no stream captures subject, per filters.
func noStream(filters []string, subject string) bool {
	for _, f := range filters {
		if subjectMatch(f, subject) {
			return false
		}
	}
	return true
}

// Deliver publishes the batch: JetStream async publishes with at most
// PublishWindow in flight, then waits for every PubAck (at most
// PublishTimeout). errs[i] is nil when batch[i] was acknowledged (or, for
// a subject without a stream, published and flushed).
func (s *Sink) Deliver(ctx context.Context, batch []*codec.Task) []error {
	if len(batch) == 0 {
		return nil
	}
	start := time.Now()
	errs := make([]error, len(batch))
	failed, timedOut := false, false
	fail := func(i int, err error) {
		errs[i] = err
		failed = true
	}
	if err := connErr(s.nc); err != nil {
		for i := range batch {
			fail(i, fmt.Errorf("nats sink: publish to %q: %w: %w", batch[i].Target, shard.ErrUnavailable, err))
		}
		return errs
	}
	dctx, cancel := context.WithTimeout(ctx, s.cfg.PublishTimeout)
	defer cancel()

	msgs := make([]*natsgo.Msg, len(batch))
	futs := make([]jetstream.PubAckFuture, len(batch))
	var core []int                       // delivered with core NATS
	var noResp []int                     // JetStream had no responders
	window := make([]int, 0, len(batch)) // published, in order; window[head:] in flight
	head := 0
	filters, known := s.streamFilters(dctx)
	coreSubj := map[string]bool{} // per batch: targets repeat
	isCore := func(subject string) bool {
		c, ok := coreSubj[subject]
		if !ok {
			c = noStream(filters, subject)
			coreSubj[subject] = c
		}
		return c
	}

	wait := func(i int) {
		f := futs[i]
		select {
		case <-f.Ok():
		case err := <-f.Err():
			if errors.Is(err, jetstream.ErrNoStreamResponse) {
				noResp = append(noResp, i)
				return
			}
			fail(i, fmt.Errorf("nats sink: publish to %q: %w", batch[i].Target, err))
		case <-dctx.Done():
			timedOut = true
			fail(i, s.ctxErr(ctx, batch[i].Target))
		}
	}

	for i, t := range batch {
		if t.Transport != codec.TransportNATS {
			fail(i, fmt.Errorf("%w: %s to %q", ErrWrongTransport, t.Transport, t.Target))
			continue
		}
		msgs[i] = &natsgo.Msg{Subject: t.Target, Data: t.Value, Header: headersOut(t.Headers, DeliveryID(t))}
		if known && isCore(t.Target) {
			core = append(core, i)
			continue
		}
		if len(window)-head >= s.cfg.PublishWindow {
			wait(window[head])
			head++
		}
		f, err := s.js.PublishMsgAsync(msgs[i], s.pubOpts...)
		if err != nil {
			fail(i, fmt.Errorf("nats sink: publish to %q: %w", t.Target, err))
			continue
		}
		futs[i] = f
		window = append(window, i)
	}
	for _, i := range window[head:] {
		wait(i)
	}

	if timedOut {
		s.forgetStreams()
	}
	// "No responders": the stream went away (or the list was unknown). Fall
	// back to core NATS only where a fresh list confirms there is no stream;
	// otherwise (e.g. a stream leader election) it is an error the engine
	// retries.
	if len(noResp) > 0 {
		s.forgetStreams()
		filters, known := s.streamFilters(dctx)
		for _, i := range noResp {
			if known && noStream(filters, batch[i].Target) {
				core = append(core, i)
				continue
			}
			fail(i, fmt.Errorf("nats sink: publish to %q: %w", batch[i].Target, jetstream.ErrNoStreamResponse))
		}
	}

	if len(core) > 0 {
		var sent []int
		for _, i := range core {
			if err := s.nc.PublishMsg(msgs[i]); err != nil {
				fail(i, fmt.Errorf("nats sink: core publish to %q: %w", batch[i].Target, err))
				continue
			}
			sent = append(sent, i)
		}
		if len(sent) > 0 {
			if err := s.nc.FlushWithContext(dctx); err != nil {
				for _, i := range sent {
					fail(i, fmt.Errorf("nats sink: core publish to %q: flush: %w", batch[i].Target, err))
				}
			} else {
				s.cfg.Metrics.BestEffort.WithLabelValues(codec.TransportNATS.String()).Add(float64(len(sent)))
			}
		}
	}

	s.cfg.Metrics.PublishSeconds.WithLabelValues(codec.TransportNATS.String()).Observe(time.Since(start).Seconds())
	if !failed {
		return nil
	}
	for i, err := range errs {
		if err != nil && ctx.Err() == nil && unavailable(err) {
			errs[i] = fmt.Errorf("%w: %w", shard.ErrUnavailable, err)
		}
	}
	return errs
}

// unavailable reports whether a publish failed for want of a working server
// rather than because of the message or its stream: no connection, no
// PubAck in time, no responder for a subject that has a stream (a leader
// election, JetStream down), or JetStream answering 503 for itself. A
// stream's refusal (limits, expected sequence, a bad header) is the task's
// own, although the server answers some of those with 503 too.
func unavailable(err error) bool {
	for _, e := range []error{
		ErrDisconnected, ErrPublishTimeout, natsgo.ErrConnectionClosed, natsgo.ErrDisconnected,
		natsgo.ErrConnectionReconnecting, natsgo.ErrConnectionDraining, natsgo.ErrTimeout,
		natsgo.ErrNoResponders, jetstream.ErrNoStreamResponse, jetstream.ErrAsyncPublishTimeout, jetstream.ErrJetStreamNotEnabled,
		jetstream.ErrJetStreamNotEnabledForAccount, context.DeadlineExceeded,
	} {
		if errors.Is(err, e) {
			return true
		}
	}
	var api *jetstream.APIError
	return errors.As(err, &api) && api.Code == 503 && !streamRefusal(api)
}

// JetStream error codes the server answers a publish with, code 503, when
// the stream refuses the message rather than cannot take it now.
const (
	jsErrStreamStoreFailed     = 10077 // its limits with DiscardNew, or its storage failing
	jsErrStreamSequenceNoMatch = 10063 // an expected sequence
	jsErrInsufficientResources = 10023 // the account's or server's storage limits
)

// streamRefusal reports whether a 503 answer is the stream refusing the
// message. A store failure is one only when it names a limit (the
// server's ErrMaxMsgs, ErrMaxBytes, ErrMaxMsgsPerSubject, ErrMsgTooLarge);
// a closed store or a disk error is JetStream not working.
func streamRefusal(api *jetstream.APIError) bool {
	switch api.ErrorCode {
	case jsErrStreamSequenceNoMatch, jsErrInsufficientResources:
		return true
	case jsErrStreamStoreFailed:
		d := strings.ToLower(api.Description)
		return strings.HasPrefix(d, "maximum ") || d == "message too large"
	}
	return false
}

func (s *Sink) ctxErr(ctx context.Context, target string) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("nats sink: publish to %q: %w", target, err)
	}
	return fmt.Errorf("%w: publish to %q after %s", ErrPublishTimeout, target, s.cfg.PublishTimeout)
}
