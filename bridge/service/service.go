// Package service assembles a delaybridge process from its configuration:
// the durable engine, the Kafka and NATS adapters, the ingest pipeline and
// the admin HTTP server, and shuts them down in a fixed order (stop sources,
// drain the fire loops, close publishers, sync and close the store).
//
// `delaybridge run`, `delaybridge dev` and the end-to-end tests all build the
// process through New, so what the tests prove is what ships.
package service

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	natsgo "github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/admin"
	"github.com/delaybridge/delaybridge/bridge"
	"github.com/delaybridge/delaybridge/bridge/kafka"
	"github.com/delaybridge/delaybridge/bridge/nats"
	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/config"
	"github.com/delaybridge/delaybridge/internal/clock"
	"github.com/delaybridge/delaybridge/internal/logthrottle"
	"github.com/delaybridge/delaybridge/metrics"
	"github.com/delaybridge/delaybridge/shard"
)

// ErrNotReady is wrapped by Ready while the process cannot do its job.
var ErrNotReady = errors.New("not ready")

// Options are the process-level parts that do not come from the config file.
type Options struct {
	Logger *zap.Logger
	// Registry receives the metrics; nil makes a fresh one with the Go and
	// process collectors.
	Registry *prometheus.Registry
	// Clock drives the engine; nil is the system clock. Tests inject a Fake.
	Clock clock.Clock
	// FS is the store's file system; nil is the OS. Fault tests inject
	// write errors here.
	FS vfs.FS
	// Kafka and NATS tune the adapters beyond what the config file sets
	// (tests shorten timeouts); nil keeps the adapter defaults.
	Kafka func(*kafka.Config)
	NATS  func(*nats.Config)
}

// Service is one running bridge process.
type Service struct {
	cfg      *config.Config
	log      *zap.Logger
	reg      *prometheus.Registry
	m        *metrics.Metrics
	eng      *shard.Engine
	pipeline *bridge.Pipeline
	sinks    bridge.Sinks
	health   []bridge.Healther
	closers  []func() error
	admin    http.Handler
	opts     Options
	// lateShutdown: the shutdown ran out of time, so the store is closed
	// without its memtable flush (set by Run before closeAll).
	lateShutdown bool

	// mu guards health, closers and closed, which each
	// transport's connector adds to once it has reached its brokers.
	mu sync.Mutex
	// closed is set once closeAll or closeAllBy took the closers: a
	// connector that reaches its brokers after that closes what it built.
	closed bool
	// late stands for each configured transport's sink until its
	// connector has reached the brokers (see lateSink); each holds the last
	// reason its transport could not be reached, for /readyz.
	late []*lateSink
	// stopping is set when Run begins its shutdown.
	stopping atomic.Bool
}

// New validates cfg and opens the store, recovering pending tasks. Brokers
// are reached by Run, so the admin server (liveness, readiness, metrics) is
// up while they are not.
func New(ctx context.Context, cfg *config.Config, o Options) (_ *Service, err error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	s := &Service{cfg: cfg, log: o.Logger, reg: o.Registry, opts: o}
	if s.log == nil {
		s.log = zap.NewNop()
	}
	if s.reg == nil {
		s.reg = prometheus.NewRegistry()
		s.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	s.m = metrics.New(s.reg)
	s.m.InitSeries(seriesOf(cfg))
	defer func() {
		if err != nil {
			s.closeAll()
		}
	}()

	start := time.Now()
	eo := engineOptions(cfg)
	eo.FS, eo.Clock, eo.Logger, eo.Metrics = o.FS, o.Clock, s.log.Named("engine"), s.m
	s.eng, err = shard.OpenContext(ctx, eo)
	if sc := (*shard.ShardCountError)(nil); errors.As(err, &sc) {
		return nil, fmt.Errorf("config: shards: %d, but the store in %s was created with %d shards, and the count cannot be changed (tasks are placed by it): set shards: %d: %w",
			sc.Asked, cfg.DataDir, sc.Stored, sc.Stored, err)
	}
	if err != nil {
		return nil, fmt.Errorf("open store %s: %w", cfg.DataDir, err)
	}
	s.closers = append(s.closers, func() error {
		if s.lateShutdown {
			return s.eng.CloseNoFlush()
		}
		return s.eng.Close()
	})
	st := s.eng.Stats()
	s.log.Info("store recovered", zap.Int64("pending", st.Pending), zap.Duration("took", time.Since(start)))
	if st.Pending > 0 && len(cfg.Targets.Allow) == 0 {
		// Pending tasks are checked against targets.allow again when they
		// come due (checkStoredTarget): a list lost in an upgrade would
		// dead-letter them all, one at a time, as they come due.
		s.log.Warn("targets.allow is empty, so no target is allowed: every pending task will be dead-lettered target-not-allowed when it comes due",
			zap.Int64("pending", st.Pending))
	}
	if cfg.CatchUpWait > 0 {
		s.eng.PauseFiring() // until Run's catchUp resumes it
	}
	s.pipeline = bridge.NewPipeline(s.eng, s.log.Named("pipeline"))
	s.admin = admin.NewHandler(admin.Options{
		Engine:   s.eng,
		Ready:    s.Ready,
		Live:     s.Live,
		Gatherer: s.reg,
		Token:    cfg.Admin.Token.Value(),
		// good for /metrics only
		MetricsToken: cfg.Admin.MetricsToken.Value(),
		// the *_file ones read again when they change
		TokenFunc:        config.SecretFunc("admin.token_file", cfg.Admin.TokenFile, cfg.Admin.Token, s.log.Named("admin")),
		MetricsTokenFunc: config.SecretFunc("admin.metrics_token_file", cfg.Admin.MetricsTokenFile, cfg.Admin.MetricsToken, s.log.Named("admin")),
		Pprof:            cfg.Admin.Pprof,
		Sources:          taskSources(cfg),
		Logger:           s.log.Named("admin"),
	})
	if cfg.Kafka != nil {
		l := newLateSink("kafka", func(ctx context.Context, b *built) error { return s.setupKafka(ctx, s.opts, b) })
		s.late, s.sinks.Kafka = append(s.late, l), l
	}
	if cfg.NATS != nil {
		l := newLateSink("nats", func(_ context.Context, b *built) error { return s.setupNATS(s.opts, b) })
		s.late, s.sinks.NATS = append(s.late, l), l
	}
	s.sinks.Check = func(t *codec.Task) error { return checkStoredTarget(cfg, t) }
	return s, nil
}

// taskSources names the delay sources of cfg as a task's source is named
// (admin's {source}): each Kafka delay topic, and the NATS stream.
func taskSources(cfg *config.Config) []string {
	var out []string
	if cfg.Kafka != nil {
		for _, src := range cfg.Kafka.Sources {
			out = append(out, src.Topic)
		}
	}
	if cfg.NATS != nil {
		out = append(out, cfg.NATS.Stream)
	}
	return out
}

// checkStoredTarget refuses a stored task whose target the running config
// no longer lets through, as ingest would under this config: its transport
// is no longer configured (bad-target), targets.allow was narrowed or the
// target made a delay source (target-not-allowed). The task is
// dead-lettered at its due time; it is not published. A task whose DLQ's
// transport is gone too has nowhere to go: it is let through, and waits as
// in an outage (bridge.ErrNoTransport).
func checkStoredTarget(cfg *config.Config, t *codec.Task) error {
	if !cfg.HasTransport(t.Transport) {
		if !cfg.HasTransport(t.DLQTransport) {
			return nil
		}
		return &shard.RejectedError{Code: codec.CodeBadTarget,
			Err: fmt.Errorf("target %s names transport %s, which is no longer configured (the config changed since the task was stored): not published", t.Destination(), t.Transport)}
	}
	var why string
	switch {
	case cfg.DelaySource(t.Transport, t.Target):
		why = "is now a delay source of this bridge"
	case !cfg.AllowTarget(t.Transport, t.Target):
		why = "is no longer matched by targets.allow"
	default:
		return nil
	}
	return &shard.RejectedError{Code: codec.CodeTargetNotAllowed,
		Err: fmt.Errorf("target %s %s (the config changed since the task was stored): not published", t.Destination(), why)}
}

// built is what one transport's connect made: its sink, sources, health
// checks and closers.
type built struct {
	sink    shard.Sink
	sources []bridge.Source
	health  []bridge.Healther
	closers []func() error
	// addSources, when set by a transport's setup, builds its sources
	// on the connection the setup made: retried on its own while the
	// brokers answer the publisher but not the source (a NATS cluster
	// without quorum answers 503 for the delay stream's consumer while a
	// target stream may be served), so deliveries go out meanwhile.
	addSources func(context.Context, *built) error
}

// lateSink is a configured transport's sink from the start of Run: until
// the transport's connector has reached its brokers a delivery waits (see
// tried), and once the connector has given up it fails as an outage
// (shard.ErrUnavailable: no retry budget used), so the other transport's
// sources and deliveries run meanwhile.
type lateSink struct {
	transport string
	setup     func(context.Context, *built) error
	real      atomic.Pointer[built] // connected: publisher and sources
	pub       atomic.Pointer[built] // its publisher is up (sources may not be yet)
	err       atomic.Pointer[error] // the last connect failure
	// tried is closed once the connector has reached the brokers (its
	// publisher is up) or given up (a fatal error, or the stop): a
	// delivery waits for it (or for waitedOut), so tasks overdue at start
	// are delivered once the brokers are reached, not held for an outage
	// backoff as long as they are overdue (up to retry.max). The lane of
	// this transport waits meanwhile; the other transport's lanes do not
	// (shard: lanes).
	tried     chan struct{}
	triedOnce sync.Once
	// waitedOut is closed lateGrace after the first failed connect
	// attempt: from then on a delivery fails at once as an outage, so the
	// engine's outage path bounds what waits in memory
	// (retry.waiting_in_memory, the rest held on disk). Waiting on for
	// tried instead kept the lane busy through the whole outage, every
	// task coming due set aside in memory (about 170 B each, without
	// bound: found by a hunt with Kafka down at a restart).
	waitedOut     chan struct{}
	waitedOutOnce sync.Once
	// kick asks the connector to try now rather than at the end of its
	// backoff: a delivery that finds no publisher once waitedOut closed
	// sends it and waits for that attempt (kickWait at most), so a broker
	// that answers again is reached by the engine's next probe, not a
	// connect backoff after it (which failed the probe in between and
	// added another retry.max).
	kick chan struct{}
	amu  sync.Mutex
	// attemptEnd is closed when the connector's current (or next)
	// attempt ends, and replaced.
	attemptEnd chan struct{}
}

// kickWait bounds how long a delivery waits for a connect attempt it asked for.
var kickWait = 2 * time.Second

func (l *lateSink) endAttempt() {
	l.amu.Lock()
	close(l.attemptEnd)
	l.attemptEnd = make(chan struct{})
	l.amu.Unlock()
}

func (l *lateSink) nextAttemptEnd() <-chan struct{} {
	l.amu.Lock()
	defer l.amu.Unlock()
	return l.attemptEnd
}

// lateGrace is how long after a transport's first failed connect attempt
// its deliveries keep waiting for the connector (a broker down for a
// moment at start: the tasks overdue at the restart go out as soon as it
// is reached) before they fail as an outage (a variable for tests).
var lateGrace = 5 * time.Second

func newLateSink(transport string, setup func(context.Context, *built) error) *lateSink {
	return &lateSink{transport: transport, setup: setup, tried: make(chan struct{}), waitedOut: make(chan struct{}),
		kick: make(chan struct{}, 1), attemptEnd: make(chan struct{})}
}

func (l *lateSink) Deliver(ctx context.Context, batch []*codec.Task) []error {
	select {
	case <-l.tried:
	case <-l.waitedOut:
	case <-ctx.Done():
	}
	if b := l.pub.Load(); b != nil {
		return b.sink.Deliver(ctx, batch)
	}
	select {
	case <-l.tried: // connected (pub set above) or given up
	default:
		// Past the grace, not connected: ask for an attempt now and wait
		// for it (the one in progress may have started before the broker
		// was back: then for the next one too).
		t := time.NewTimer(kickWait)
	wait:
		for range 2 {
			end := l.nextAttemptEnd()
			select {
			case l.kick <- struct{}{}:
			default:
			}
			select {
			case <-end:
			case <-ctx.Done():
				break wait
			case <-t.C:
				break wait
			}
			if l.pub.Load() != nil {
				break
			}
		}
		t.Stop()
		if b := l.pub.Load(); b != nil {
			return b.sink.Deliver(ctx, batch)
		}
	}
	reason := errors.New("not connected yet")
	if p := l.err.Load(); p != nil {
		reason = *p
	}
	errs := make([]error, len(batch))
	for i, t := range batch {
		errs[i] = fmt.Errorf("%s sink: publish to %q: %w: connecting to brokers: %w", l.transport, t.Target, shard.ErrUnavailable, reason)
	}
	return errs
}

// connect reaches one transport's brokers and builds its sources and
// publisher. A broker that does not answer is retried with backoff (the
// readiness says why) until ctx ends; a refused credential, a failed TLS
// handshake or a configuration the broker rejects is returned at once:
// retrying would not help and the operator must see it. Once the
// publisher is up, deliveries go out while the sources are still being
// set up (built.addSources, retried alone). The backoff doubles up to
// retry.max (at most 30 s): a transport reached later than that would
// hold its due tasks longer than an outage of a connected one does. While
// firing is paused at start (the catch-up pause) it is 2 s at most: no
// delivery asks for an attempt then, and a bridge restarted in an outage
// reaches the broker within 2 s of its return.
func (s *Service) connect(ctx context.Context, l *lateSink) (*built, error) {
	backoff := firstPause
	maxBackoff := max(firstPause, min(30*time.Second, s.cfg.Retry.Max.Std()))
	tried := func() { l.triedOnce.Do(func() { close(l.tried) }) }
	var b *built
	// The Warn of a failure is logged at once, then once per
	// logthrottle.DefaultEvery while it repeats (a new error text at
	// once): every 2 s while firing is paused at start, it was about 30
	// lines a minute per transport. Each attempt is at Debug. The key is
	// the error's shape, numbers aside: a connection reset or a read
	// timeout names the client's ephemeral port, new at each attempt, so
	// keyed by its text every attempt was a new failure with its Warn.
	var warns logthrottle.Throttle
	for attempt := 1; ; attempt++ {
		var err error
		if b == nil {
			nb := &built{}
			if err = l.setup(ctx, nb); err == nil {
				b = nb
				l.pub.Store(b)
				tried()
			} else {
				_ = closeEach(nb.closers)
			}
		}
		if err == nil && b.addSources != nil {
			if err = b.addSources(ctx, b); err == nil {
				b.addSources = nil
			}
		}
		l.endAttempt()
		if err == nil {
			l.err.Store(nil)
			l.real.Store(b)
			return b, nil
		}
		l.err.Store(&err)
		if attempt == 1 && b == nil {
			time.AfterFunc(lateGrace, func() { l.waitedOutOnce.Do(func() { close(l.waitedOut) }) })
		}
		if unreachable(err) && ctx.Err() == nil {
			d := connectPause(backoff, s.eng != nil && s.eng.FiringPaused(), err)
			fields := []zap.Field{zap.String("transport", l.transport), zap.Int("attempt", attempt),
				zap.Bool("publisher_up", b != nil), zap.Duration("backoff", d), zap.Error(err)}
			if held, ok := warns.AllowKey(time.Now(), logthrottle.Shape(err.Error())); ok {
				s.log.Warn("brokers unreachable; retrying", append(fields, zap.Int("held_back", held))...)
			} else {
				s.log.Debug("brokers unreachable; retrying", fields...)
			}
			if pause(ctx, l.kick, d) {
				backoff = min(2*backoff, maxBackoff)
				continue
			}
		}
		s.adopt(b)
		tried()
		return nil, err
	}
}

// connectPause is the connector's wait after a failed attempt: its
// backoff, or at most pausedConnectBackoff while firing is paused at
// start or after a NATS set-up answered that the cluster has no leader.
func connectPause(backoff time.Duration, paused bool, err error) time.Duration {
	// Paused: no delivery asks for an attempt while firing waits for the
	// sources to catch up (catchUp), so a bridge restarted in an outage
	// would reach the broker up to 30 s after its return (hunt H181:
	// 22 s). Leaderless: a NATS cluster without its quorum answers the
	// set-up 503 at once; tried every 2 s at most, the source is set up
	// within about 2 s of the quorum's return (hunt H192: up to 30 s
	// after it), each attempt a request or two, and readiness says why
	// meanwhile.
	if paused || nats.Leaderless(err) {
		return min(backoff, pausedConnectBackoff)
	}
	return backoff
}

// firstPause is the connector's first backoff, and the least time between
// two attempts however often deliveries ask for one.
const firstPause = 500 * time.Millisecond

// pausedConnectBackoff caps the connector's backoff while firing is paused
// at start, when no delivery asks for an attempt.
const pausedConnectBackoff = 2 * time.Second

// pause waits d before the next connect attempt, or, once a delivery asks
// for one (kick), until firstPause has passed since the last attempt. It
// reports false if ctx ended first.
func pause(ctx context.Context, kick <-chan struct{}, d time.Duration) bool {
	start := time.Now()
	t := time.NewTimer(d)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return false
		case <-t.C:
			return true
		case <-kick:
			kick = nil
			t.Reset(max(0, firstPause-time.Since(start)))
		}
	}
}

// adopt hands b's closers (b may be nil) to the shutdown, which closes
// them after the fire loops stopped: a connector that gives up with its
// publisher up (stopping, or a fatal error setting up a source) must not
// close it under a delivery in flight. After the shutdown took the
// closers, it closes them itself.
func (s *Service) adopt(b *built) {
	if b == nil {
		return
	}
	s.mu.Lock()
	if !s.closed {
		s.closers = append(s.closers, b.closers...)
		s.mu.Unlock()
		return
	}
	s.mu.Unlock()
	_ = closeEach(b.closers)
}

// unreachable reports whether err only says that no broker answered: for
// NATS also a host name that does not resolve (yet), a server that took
// the connection but did not answer in time, as the Kafka check classifies
// them (kafka.ErrUnreachable), and a JetStream API request (the delay
// stream's lookup) with no answer within its deadline: a server recovering
// its JetStream, or a cluster without a meta leader, or one answered 503 for
// JetStream itself ("JetStream system temporarily unavailable": a cluster
// that lost its quorum, a server still recovering; also "insufficient
// resources", which waits for the operator like a down broker), but not
// "JetStream not enabled" (for the account or the server): that ends the
// start, as a configuration the broker rejects.
func unreachable(err error) bool {
	// A joined error of several brokers (kafka check) may hold a refused
	// login or TLS handshake next to an unresolvable or silent one: the
	// refusal decides, it ends the start.
	if errors.Is(err, kafka.ErrAuth) || errors.Is(err, kafka.ErrTLS) {
		return false
	}
	var dns *net.DNSError
	if nats.TemporarilyUnavailable(err) {
		// Not JetStream off for the account or the server, which answers
		// 503 too but is a configuration the broker rejects: it ends the
		// start.
		return true
	}
	return errors.Is(err, kafka.ErrUnreachable) || errors.Is(err, natsgo.ErrNoServers) ||
		errors.Is(err, natsgo.ErrTimeout) || errors.Is(err, os.ErrDeadlineExceeded) ||
		errors.Is(err, context.DeadlineExceeded) || errors.As(err, &dns)
}

// clock is the bridge's clock: Options.Clock, else the system's.
func (s *Service) clock() clock.Clock {
	if s.opts.Clock != nil {
		return s.opts.Clock
	}
	return clock.Real{}
}

// rules builds the codec rules of one configured source.
func (s *Service) rules(dlq, defaultTarget string) *codec.Rules {
	cfg := s.cfg
	return &codec.Rules{
		DefaultTarget: defaultTarget,
		DLQ:           dlq,
		MaxDelay:      cfg.MaxDelay.Std(),
		Now:           s.clock().Now,
		MaxBytes:      cfg.MaxMessageBytes,
		Transports:    cfg.HasTransport,
		DelaySource:   cfg.DelaySource,
		Allow:         cfg.AllowTarget,
	}
}

// clientTLS is t's client TLS, or nil when TLS is off.
func clientTLS(t config.TLS, log *zap.Logger) (*config.ClientTLS, error) {
	if !t.Enabled {
		return nil, nil
	}
	return t.Client(log)
}

func (s *Service) setupKafka(ctx context.Context, o Options, b *built) error {
	k := s.cfg.Kafka
	kc := kafka.Config{
		Brokers:  k.Brokers,
		Group:    k.Group,
		ClientID: k.ClientID,
		Logger:   s.log.Named("kafka"),
		Metrics:  s.m,
		// The producer's own size check must not be the tighter bound:
		// a message within max_message_bytes, or its dead letter (the
		// error headers added), goes to the broker, whose limit decides.
		BatchBytes: max(1<<20, int64(s.cfg.MaxMessageBytes)+int64(codec.DeadLetterOverhead)+1024),
		FreshStore: s.eng.Fresh(),
		// Beside the store (Pebble ignores the names it does not use),
		// with the tasks of the process it belongs to.
		MemberFile: filepath.Join(s.cfg.DataDir, "kafka-member"),
		// Fetched records not stored yet, over all partitions.
		FetchMemory: int64(k.FetchMemoryMB) << 20,
	}
	ct, err := clientTLS(k.TLS, s.log.Named("kafka"))
	if err != nil {
		return fmt.Errorf("kafka.tls: %w", err)
	}
	if ct != nil {
		kc.NewTLS = ct.Config
	}
	if k.SASL.Mechanism != "" {
		pass := config.SecretFunc("kafka.sasl.password_file", k.SASL.PasswordFile, k.SASL.Password, s.log.Named("kafka"))
		if kc.SASL, err = kafka.SASLMechanismFunc(k.SASL.Mechanism, k.SASL.Username, pass); err != nil {
			return fmt.Errorf("kafka.sasl: %w", err)
		}
	}
	for _, src := range k.Sources {
		kc.Sources = append(kc.Sources, kafka.SourceConfig{Topic: src.Topic, Rules: s.rules(src.DLQ, src.DefaultTarget)})
	}
	if o.Kafka != nil {
		o.Kafka(&kc)
	}
	sink, err := kafka.NewSink(kc)
	if err != nil {
		return fmt.Errorf("kafka sink: %w", err)
	}
	b.closers = append(b.closers, sink.Close)
	if err := sink.Check(ctx); err != nil {
		return fmt.Errorf("kafka brokers %v: %w", k.Brokers, err)
	}
	b.sink = sink
	b.health = append(b.health, sink)
	// A DLQ topic that does not exist is not needed until the first bad
	// message, which then holds its partition until the topic exists:
	// say so now, while nothing waits for it.
	var dlqs []string
	for _, src := range k.Sources {
		if !slices.Contains(dlqs, src.DLQ) {
			dlqs = append(dlqs, src.DLQ)
		}
	}
	if missing := sink.MissingTopics(ctx, dlqs); len(missing) > 0 {
		s.log.Warn("kafka dlq topic missing: create it; until it exists a dead letter holds its partition and the bridge is not ready",
			zap.Strings("topics", missing))
	}
	src, err := kafka.NewSource(kc)
	if err != nil {
		return fmt.Errorf("kafka source: %w", err)
	}
	b.closers = append(b.closers, src.Close)
	// A delay topic that does not exist yet is not a reason to stop: the
	// source waits for it, not ready (its Health names the topic), while
	// the engine fires what is stored and the other sources run.
	if err := src.Check(ctx); err != nil && !errors.Is(err, kafka.ErrTopicMissing) {
		return fmt.Errorf("kafka source topics: %w", err)
	} else if err != nil {
		s.log.Warn("kafka source topic missing; waiting for it", zap.Error(err))
	}
	b.sources = append(b.sources, src)
	b.health = append(b.health, src)
	return nil
}

func (s *Service) setupNATS(o Options, b *built) error {
	n := s.cfg.NATS
	nc := nats.Config{
		URL:         n.URL,
		Stream:      n.Stream,
		Consumer:    n.Consumer,
		Create:      n.Create,
		Replicas:    n.Replicas,
		CoreTargets: n.CoreTargets,
		User:        n.User,
		Password:    n.Password.Value(),
		Token:       n.Token.Value(),
		CredsFile:   n.CredsFile,
		Logger:      s.log.Named("nats"),
		Metrics:     s.m,
	}
	if n.PasswordFile != "" {
		nc.PasswordFunc = config.SecretFunc("nats.password_file", n.PasswordFile, n.Password, nc.Logger)
	}
	if n.TokenFile != "" {
		nc.TokenFunc = config.SecretFunc("nats.token_file", n.TokenFile, n.Token, nc.Logger)
	}
	ct, err := clientTLS(n.TLS, nc.Logger)
	if err != nil {
		return fmt.Errorf("nats.tls: %w", err)
	}
	if ct != nil {
		nc.TLS, nc.RootCAs = ct.Config(), ct.RootCAsFunc()
	}
	for _, src := range n.Sources {
		nc.Sources = append(nc.Sources, nats.SourceConfig{Subject: src.Subject, Rules: s.rules(src.DLQ, src.DefaultTarget)})
	}
	if o.NATS != nil {
		o.NATS(&nc)
	}
	conn, err := nats.Connect(nc)
	if err != nil {
		return fmt.Errorf("nats %s: %w", config.RedactURLs(n.URL), err)
	}
	b.closers = append(b.closers, func() error { conn.Close(); return nil })
	sink, err := nats.NewSink(conn, nc)
	if err != nil {
		return fmt.Errorf("nats sink: %w", err)
	}
	b.sink = sink
	b.health = append(b.health, sink)
	b.addSources = func(context.Context, *built) error {
		src, err := nats.NewSource(conn, nc)
		if err != nil {
			return err // it names the source
		}
		b.closers = append(b.closers, src.Close)
		b.sources = append(b.sources, src)
		b.health = append(b.health, src)
		return nil
	}
	return nil
}

// Engine returns the durable engine (admin and tests use it).
func (s *Service) Engine() *shard.Engine { return s.eng }

// AdminHandler returns the admin HTTP handler (/healthz, /readyz, /metrics, /v1/...).
func (s *Service) AdminHandler() http.Handler { return s.admin }

// Live is nil unless the process cannot make progress without a restart:
// the store refuses writes after a failed write (sticky, see shard). Failing
// /healthz then lets the supervisor restart the process, which reopens the
// store from its last durable state and resumes once the fault (a full
// disk, say) has cleared. Broker outages are not liveness failures: they
// heal by reconnecting.
func (s *Service) Live() error {
	if err := s.eng.Err(); errors.Is(err, shard.ErrStoreFailed) {
		return err
	}
	return nil
}

// Ready is nil when the store is healthy and every source and publisher is
// connected; otherwise it says why.
func (s *Service) Ready() error {
	errs := []error{}
	if s.stopping.Load() {
		errs = append(errs, errors.New("shutting down"))
	}
	for _, l := range s.late {
		if l.real.Load() != nil {
			continue
		}
		reason := fmt.Errorf("connecting to brokers: %s", l.transport)
		if p := l.err.Load(); p != nil {
			reason = fmt.Errorf("connecting to brokers: %w", *p)
		}
		errs = append(errs, reason)
	}
	if err := s.eng.Err(); err != nil {
		errs = append(errs, err)
	}
	s.mu.Lock()
	health := slices.Clone(s.health)
	s.mu.Unlock()
	for _, h := range health {
		if err := h.Health(); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		s.m.Ready.Set(0)
		return fmt.Errorf("%w: %w", ErrNotReady, errors.Join(errs...))
	}
	s.m.Ready.Set(1)
	return nil
}

// Run serves until ctx is cancelled, then shuts down in order: stop the
// sources (the batch in flight finishes its store commit and broker
// commit), stop the fire loops (the batch in flight is acknowledged and
// deleted, or stays stored), close publishers and connections, sync and
// close the store. Pending tasks stay in the store for the next start.
// Run returns the first fatal error of a source, or nil.
func (s *Service) Run(ctx context.Context) error {
	srcCtx, stopSources := context.WithCancel(ctx)
	defer stopSources()
	engCtx, stopEngine := context.WithCancel(context.WithoutCancel(ctx))
	defer stopEngine()
	adminCtx, stopAdmin := context.WithCancel(context.WithoutCancel(ctx))
	defer stopAdmin()

	var fatal error
	var fatalOnce sync.Once
	setFatal := func(err error) {
		fatalOnce.Do(func() { fatal = err; stopSources() })
	}

	adminDone := make(chan struct{})
	go func() {
		defer close(adminDone)
		if err := admin.Serve(adminCtx, s.cfg.Admin.Listen, s.admin, s.log.Named("admin")); err != nil {
			setFatal(err) // says "admin: listen ... (admin.listen)" or "admin: serve ..."
		}
	}()
	// Firing, paused by New, waits (catch_up_wait at most) until every
	// transport's sources have read what they held: see catchUp.
	caught := make(chan string, len(s.late))
	if wait := s.cfg.CatchUpWait.Std(); wait > 0 {
		go s.catchUp(srcCtx, wait, caught)
	}
	// Each transport connects on its own (s.late): one whose brokers are
	// down does not hold the other's sources and deliveries (its own wait
	// in its lateSink).
	engDone := make(chan struct{})
	go func() {
		defer close(engDone)
		if err := s.eng.Run(engCtx, s.sinks); err != nil {
			setFatal(fmt.Errorf("engine: %w", err))
		}
	}()
	var srcWG sync.WaitGroup
	var nConnected, nSources atomic.Int32
	for _, l := range s.late {
		srcWG.Go(func() {
			b, err := s.connect(srcCtx, l)
			if err != nil {
				if srcCtx.Err() == nil {
					setFatal(err)
				}
				return
			}
			s.mu.Lock()
			if s.closed {
				// Reached after the shutdown closed everything (it did
				// not wait past its deadline for this connect).
				s.mu.Unlock()
				_ = closeEach(b.closers)
				return
			}
			s.closers = append(s.closers, b.closers...)
			s.health = append(s.health, b.health...)
			s.mu.Unlock()
			if srcCtx.Err() != nil {
				return // stopping: the closers above close it
			}
			for _, src := range b.sources {
				// srcWG counts this goroutine, so Go may be called here.
				srcWG.Go(func() {
					if err := src.Run(srcCtx, s.pipeline); err != nil {
						setFatal(fmt.Errorf("source: %w", err))
					}
				})
			}
			n := nSources.Add(int32(len(b.sources)))
			if int(nConnected.Add(1)) == len(s.late) {
				s.log.Info("delaybridge running", zap.Int32("sources", n), zap.String("admin", s.cfg.Admin.Listen))
			}
			for _, src := range b.sources {
				if cu, ok := src.(bridge.CatchingUp); ok {
					select {
					case <-cu.CaughtUp():
					case <-srcCtx.Done():
						return
					}
				}
			}
			caught <- l.transport // buffered: one per transport
		})
	}
	// delaybridge_ready is set by Ready; keep it current without a
	// readiness probe calling /readyz.
	readyDone := make(chan struct{})
	go func() {
		defer close(readyDone)
		t := time.NewTicker(readyRefresh)
		defer t.Stop()
		for {
			_ = s.Ready()
			select {
			case <-srcCtx.Done():
				return
			case <-t.C:
			}
		}
	}()

	<-srcCtx.Done()
	s.stopping.Store(true)
	<-readyDone
	_ = s.Ready() // not ready from here on; sets the gauge to 0
	s.log.Info("shutting down: stopping sources")
	// Sources, fire loops and admin requests share shutdown_timeout less a
	// reserve for closing the store. Out of time, the store is closed
	// without its flush, so the process still exits within the timeout.
	timeout := s.cfg.ShutdownTimeout.Std()
	start := time.Now()
	deadline := start.Add(timeout - min(closeReserve, timeout/5))
	if !waitUntil(func() { srcWG.Wait() }, deadline) {
		s.lateShutdown = true
		s.log.Warn("sources did not stop in time; their uncommitted messages will be redelivered")
	}
	s.log.Info("shutting down: draining fire loops")
	stopEngine()
	if !waitUntil(func() { <-engDone }, deadline) {
		s.lateShutdown = true
		s.log.Warn("fire loops did not stop in time; in-flight deliveries stay stored and may repeat")
	}
	stopAdmin()
	if !waitUntil(func() { <-adminDone }, deadline) {
		s.lateShutdown = true
		s.log.Warn("admin requests did not finish in time")
	}
	// Closing the sinks waits for their in-flight publishes (kafka-go's
	// Writer.Close, up to WriteTimeout times WriteAttempts), which a hung
	// broker can stretch past the timeout: what is not closed by then is
	// left to the process exit, and the store is still closed.
	if err := s.closeAllBy(start.Add(timeout), engDone); err != nil {
		s.log.Error("close", zap.Error(err))
		if fatal == nil {
			fatal = err
		}
	}
	s.log.Info("stopped; pending tasks are kept in the store")
	return fatal
}

// catchUp resumes firing (paused by New) once every transport reported on
// caught that its sources have read what they held at start, or when wait
// has passed. A bridge that was down finds overdue tasks in its store and
// a backlog in its sources, which may cancel or replace them: fired at
// once, such a task would be delivered before the cancel its publisher
// sent before its due time is read. A source that cannot be read (its
// broker down) holds deliveries for wait at most.
func (s *Service) catchUp(ctx context.Context, wait time.Duration, caught <-chan string) {
	clk := s.clock()
	start := clk.Now()
	t := clk.NewTimer(wait)
	defer t.Stop()
	waiting := make(map[string]bool, len(s.late))
	for _, l := range s.late {
		waiting[l.transport] = true
	}
	s.log.Info("firing paused until the sources have read their backlog", zap.Duration("catch_up_wait", wait))
	for len(waiting) > 0 {
		select {
		case tr := <-caught:
			delete(waiting, tr)
		case <-t.C():
			s.log.Warn("catch_up_wait passed: firing, though these transports' sources have not read their backlog; a cancel or replace in it that is read later does not stop a task that fired already (catch_up_wait)",
				zap.Strings("transports", slices.Sorted(maps.Keys(waiting))), zap.Duration("catch_up_wait", wait))
			s.eng.ResumeFiring()
			return
		case <-ctx.Done():
			return // stopping: the tasks stay stored
		}
	}
	s.eng.ResumeFiring()
	if p := s.eng.Firing().Operator; p != nil {
		s.log.Info("sources caught up; firing stays paused by the operator until POST /v1/firing/resume",
			zap.Duration("after", clk.Now().Sub(start)), zap.Time("paused_since", p.Since.Time), zap.String("reason", p.Reason))
		return
	}
	s.log.Info("sources caught up: firing", zap.Duration("after", clk.Now().Sub(start)))
}

// closeAllBy is closeAll within deadline: the closers but the store's (the
// first) run in order until deadline less the store's share, and one still
// running then is left behind with those after it (logged). The store
// closes once the fire loops have stopped (engDone); if they outlast the
// deadline too (a publish still held), it closes when they stop, unless the
// process exits first, which the store recovers from as from a crash
// (every commit was synced). So does a store whose close outlasts the
// deadline.
func (s *Service) closeAllBy(deadline time.Time, engDone <-chan struct{}) error {
	closers := s.takeClosers()
	if len(closers) == 0 {
		return nil
	}
	store, rest := closers[0], closers[1:]
	others := deadline.Add(-min(closeReserve, max(time.Until(deadline), 0)/2))
	// In one goroutine, so a late closer is left behind with those after
	// it; restErr is read only if it returned.
	var restErr, err error
	if waitUntil(func() { restErr = closeEach(rest) }, others) {
		err = restErr
	} else {
		s.lateShutdown = true
		s.log.Warn("shutting down: a publisher or source did not close in time; it and those after it are left to the process exit")
	}
	if !waitUntil(func() { <-engDone }, deadline) {
		s.log.Warn("shutting down: a fire loop is still in a publish; the store closes when it returns or stays to the process exit, which it recovers from like a crash")
		go func() {
			<-engDone
			if err := store(); err != nil {
				s.log.Error("close store", zap.Error(err))
			}
		}()
		return err
	}
	// The store's close waits for every write in flight, and a write
	// Pebble holds in a stall (its flushes failing: a full disk) does not
	// end, so an Ingest in it would hold the close, and the process,
	// forever. Past the deadline the store is left to the process exit.
	var storeErr error
	if waitUntil(func() { storeErr = store() }, deadline) {
		return errors.Join(err, storeErr)
	}
	s.log.Warn("shutting down: the store did not close in time (a write in it is held: see the store's readiness error); it is left to the process exit, which it recovers from like a crash")
	return err
}

// closeReserve is the part of shutdown_timeout (at most a fifth of it)
// kept for closing the store.
const closeReserve = 2 * time.Second

// readyRefresh is how often a running service re-evaluates Ready, so the
// delaybridge_ready gauge is current without a readiness probe.
const readyRefresh = 5 * time.Second

// waitUntil runs wait and reports whether it returned before deadline.
func waitUntil(wait func(), deadline time.Time) bool {
	done := make(chan struct{})
	go func() { wait(); close(done) }()
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case <-done:
		return true
	case <-t.C:
		return false
	}
}

// closeAll closes what New opened, newest first (sources before
// connections, the store last).
func (s *Service) closeAll() error {
	return closeEach(s.takeClosers())
}

// takeClosers takes the closers for closing; a connector that reaches its
// brokers after that closes what it built itself (closed).
func (s *Service) takeClosers() []func() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	closers := s.closers
	s.closers, s.closed = nil, true
	return closers
}

// closeEach runs closers newest first and joins their errors.
func closeEach(closers []func() error) error {
	var errs []error
	for i := len(closers) - 1; i >= 0; i-- {
		if err := closers[i](); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// engineOptions maps the validated config onto the engine's options. The
// config holds every default already, so a zero in it is the operator's
// explicit choice; where the engine reads zero as "default" (retry.jitter,
// cancel_retention), the zero is passed as the engine's "none" (negative).
func engineOptions(cfg *config.Config) shard.Options {
	eo := shard.Options{
		Dir:            cfg.DataDir,
		Shards:         cfg.Shards,
		Horizon:        cfg.Horizon.Std(),
		FireBatch:      cfg.FireBatch,
		FireBatchBytes: cfg.FireBatchBytes,
		CacheBytes:     int64(cfg.Store.CacheMB) << 20,
		MemTableBytes:  int64(cfg.Store.MemtableMB) << 20,
		ReserveBytes:   int64(cfg.Store.ReserveMB) << 20,
		Retry: shard.RetryPolicy{
			Initial:     cfg.Retry.Initial.Std(),
			Max:         cfg.Retry.Max.Std(),
			Multiplier:  cfg.Retry.Multiplier,
			Jitter:      cfg.Retry.Jitter,
			MaxAttempts: cfg.Retry.MaxAttempts,
		},
		CancelRetention: cfg.CancelRetention.Std(),
		// Per shard, rounded up; 0 (hold every waiting task on disk) is
		// the engine's negative.
		OutageMemory: -1,
	}
	if n := cfg.Retry.WaitingInMemory; n > 0 {
		eo.OutageMemory = (n + max(cfg.Shards, 1) - 1) / max(cfg.Shards, 1)
	}
	if eo.Retry.Jitter == 0 {
		eo.Retry.Jitter = -1
	}
	if eo.CancelRetention == 0 {
		eo.CancelRetention = -1
	}
	return eo
}

// seriesOf is the delay sources (the label of their counters: a Kafka
// topic, the NATS stream) and the target transports a configuration has,
// for Metrics.InitSeries.
func seriesOf(cfg *config.Config) (sources, transports []string) {
	if k := cfg.Kafka; k != nil {
		transports = append(transports, codec.TransportKafka.String())
		for _, src := range k.Sources {
			sources = append(sources, src.Topic)
		}
	}
	if n := cfg.NATS; n != nil {
		transports = append(transports, codec.TransportNATS.String())
		sources = append(sources, n.Stream)
	}
	return sources, transports
}
