package kafka

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/bridge"
	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/logthrottle"
	"github.com/delaybridge/delaybridge/metrics"
	"github.com/delaybridge/delaybridge/shard"
)

// Sink publishes fired tasks to Kafka topics. It implements shard.Sink.
type Sink struct {
	cfg       Config
	addr      net.Addr // the brokers
	transport *scopedTransport
	// produce is transport with at most maxProduceInFlight produce
	// requests at once, for the producers.
	produce kafkago.RoundTripper
	log     *zap.Logger
	m       *metrics.Metrics

	// gen is the producers Deliver takes now (see writerGen); wmu guards
	// it and every generation's refs, topics and retired.
	wmu sync.Mutex
	gen *writerGen

	// stopProbe cancels a running probe; Close calls it and then waits
	// for probes.
	stopProbe context.CancelFunc
	probeCtx  context.Context
	probes    sync.WaitGroup
	// answerLog throttles the probe's "answer again" line per set of
	// topics: a broker that answers the probe but drops or times out
	// every produce (a request over its socket limit, a hung disk) makes
	// the sink unhealthy at each retried publish and healthy at each
	// probe, 11 lines a minute with the default ProbeInterval for as long
	// as it takes nothing (hunt H204).
	answerLog logthrottle.Throttle

	mu      sync.Mutex
	health  topicHealth
	epoch   uint64 // bumped by every publish outcome that changes health
	probing bool   // a probe goroutine runs (only while health.err != nil)
	closed  bool   // no probe starts after Close
	// rechecked: when topics the cached metadata called unknown were last
	// asked about on the brokers, and whether they existed (see
	// recheckUnknown).
	rechecked map[string]recheck
	// recheckMu lets one recheckUnknown at a time ask the brokers, so a
	// lane that fails a topic another lane is asking about waits for the
	// answer instead of failing its tasks as missing.
	recheckMu sync.Mutex

	// pools drops the transport's connection pools (pools.go).
	pools poolDrops
}

// recheck is what the brokers said of a topic the cached metadata did
// not know (Sink.recheckUnknown).
type recheck struct {
	at    time.Time // asked then; when found, once the transport dropped its pools
	found bool
}

var (
	_ shard.Sink      = (*Sink)(nil)
	_ bridge.Healther = (*Sink)(nil)
)

// Health reports a connection-level publish failure (no broker,
// authentication) while a topic whose publish failed that way has not
// been written to since, or nil once every such topic took a publish again
// or, with nothing to publish, once a probe found the leaders of the
// failed topics answering again (see probe). A publish that succeeds to
// one topic says nothing about another: in a partial outage (the leader
// of one topic down, another's up) the sink stays unhealthy.
// Errors of single records or topics (missing topic, broker refusals) do
// not count.
func (s *Sink) Health() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.health.err
}

// topicHealth is the sink's connection-level health, kept per topic.
//
// The granularity is the topic, not the partition: kafka-go does not tell
// which partition a record went to, so a topic with one partition whose
// leader is down and another whose leader is up counts as failed after a
// call in which any of its records got no answer (the failure wins within
// a call), and as recovered after a call that wrote a record of it and
// lost none. Such a topic can still make Health alternate; a whole topic
// or broker being down, the common case, does not.
type topicHealth struct {
	err    error            // nil when healthy
	failed map[string]error // topics whose records got no answer, with the error; nil when healthy
}

// publish records the outcome of one publish call: written are the topics
// of which a record was acknowledged, down those of which a record got no
// answer from the brokers (err; ignored when nil). A written topic leaves
// the failed ones unless it is also down; Health becomes nil once no
// failed topic remains, and names a remaining topic's error when the one
// it named recovered. publish reports whether anything changed.
func (h *topicHealth) publish(written []string, err error, down []string) (changed bool) {
	for _, t := range written {
		if _, ok := h.failed[t]; ok && (err == nil || !slices.Contains(down, t)) {
			delete(h.failed, t)
			changed = true
		}
	}
	if err != nil {
		if h.failed == nil {
			h.failed = make(map[string]error)
		}
		for _, t := range down {
			h.failed[t] = err
		}
		h.err = err
		return true
	}
	switch {
	case h.err == nil:
		return changed
	case len(h.failed) == 0:
		h.err, h.failed = nil, nil
		return true
	case changed:
		h.err = h.failed[slices.Min(slices.Collect(maps.Keys(h.failed)))]
	}
	return changed
}

// recover clears Health and forgets the failed topics (a probe found
// their leaders answering).
func (h *topicHealth) recover() {
	h.err, h.failed = nil, nil
}

// setHealth records the outcome of a publish (see topicHealth.publish). A
// change bumps the epoch; while Health is not nil the probe goroutine runs
// (it is started unless one runs already or the sink is closed).
func (s *Sink) setHealth(written []string, err error, down []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.health.publish(written, err, down) {
		s.epoch++
	}
	if s.health.err != nil && !s.probing && !s.closed {
		s.probing = true
		s.probes.Add(1)
		go s.probe()
	}
}

// probe runs while the sink is unhealthy: every ProbeInterval it checks
// that the partition leaders of the failed topics answer (see ping). A
// success clears Health, unless a publish changed it while the probe ran;
// a failure replaces the error with the probe's. probe returns once Health
// is nil or on Close.
func (s *Sink) probe() {
	defer s.probes.Done()
	since := time.Now()
	t := time.NewTimer(s.cfg.ProbeInterval)
	defer t.Stop()
	for {
		select {
		case <-s.probeCtx.Done():
			s.mu.Lock()
			s.probing = false
			s.mu.Unlock()
			return
		case <-t.C:
		}
		s.mu.Lock()
		epoch, healthy := s.epoch, s.health.err == nil
		topics := slices.Sorted(maps.Keys(s.health.failed))
		if healthy {
			s.probing = false
		}
		s.mu.Unlock()
		if healthy {
			return // publishes to the failed topics succeeded in the meantime
		}
		err := s.ping(s.probeCtx, topics)
		if s.probeCtx.Err() != nil {
			continue // closing: the failure says nothing about the brokers
		}
		if s.probeDone(epoch, err) {
			f := []zap.Field{zap.Strings("brokers", s.cfg.Brokers), zap.Strings("topics", topics), zap.Duration("unhealthy_for", time.Since(since).Round(time.Millisecond))}
			if held, forgotten, ok := s.answerLog.AllowEachForgotten(time.Now(), strings.Join(topics, "\x00")); ok {
				s.log.Info("kafka partition leaders answer again; publishes are retried (a target that still hangs shows in the engine's log and /readyz)",
					append(f, zap.Int("held_back", held), logthrottle.Forgotten(forgotten))...)
			} else {
				s.log.Debug("kafka partition leaders answer again", f...)
			}
			return
		}
		if err != nil {
			s.log.Debug("kafka brokers still unreachable", zap.Strings("topics", topics), zap.Error(err))
		}
		t.Reset(s.cfg.ProbeInterval)
	}
}

// probeDone applies the result of a probe that started at epoch and
// reports whether the probe goroutine is to end (Health is nil). The
// result counts only if no publish changed Health or the failed topics
// since the probe started: a newer failure is newer news than a probe that
// began before it, and a probe that asked about topics since written to
// may blame a leader that answers now.
func (s *Sink) probeDone(epoch uint64, err error) (healthy bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.epoch == epoch && s.health.err != nil {
		if err == nil {
			s.health.recover()
		} else {
			s.health.err = fmt.Errorf("kafka: probe brokers: %w", classify(err))
		}
	}
	if s.health.err == nil {
		s.probing = false
		return true
	}
	return false
}

// ping checks that the brokers can take the publishes that failed: it
// reads the metadata of topics (all topics when none is known) and sends
// ApiVersions to the leader of each of their partitions. Checking only the
// bootstrap brokers would call the sink healthy while the one broker that
// leads a failed partition is down, and /readyz would flap. Any answer to
// ApiVersions, even an error code, means the leader is reachable; a topic
// that no longer exists has nothing to check (its tasks fail on their own).
//
// The requests go through a new transport with the sink's settings
// (dialer, TLS, SASL), closed on return: the sink's transport answers
// Metadata from its cache, which keeps the last good answer through an
// outage, while a new one reads it from the brokers on a new connection.
func (s *Sink) ping(ctx context.Context, topics []string) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.DialTimeout)
	defer cancel()
	c, done := s.freshClient(topics)
	defer done()
	md, err := c.Metadata(ctx, &kafkago.MetadataRequest{Topics: topics})
	if err != nil {
		return fmt.Errorf("metadata: %w", err)
	}
	leaders, err := partitionLeaders(md)
	if err != nil {
		return err
	}
	for _, addr := range leaders {
		if _, err := c.ApiVersions(ctx, &kafkago.ApiVersionsRequest{Addr: kafkago.TCP(addr)}); err != nil {
			return fmt.Errorf("api versions of partition leader %s: %w", addr, err)
		}
	}
	return nil
}

// freshClient is a client on a new transport with the sink's settings
// (dialer, TLS, SASL) that reads the metadata of topics from the brokers:
// the sink's own transport answers Metadata from its cache. done closes
// its connections.
func (s *Sink) freshClient(topics []string) (c *kafkago.Client, done func()) {
	t := s.cfg.transport()
	t.MetadataTopics = topics
	return &kafkago.Client{Addr: s.addr, Transport: t}, t.CloseIdleConnections
}

// partitionLeaders returns the address of every broker that leads a
// partition of md's topics, or an error naming a partition without a
// leader. Topics that do not exist are left out.
func partitionLeaders(md *kafkago.MetadataResponse) ([]string, error) {
	var addrs []string
	for _, t := range md.Topics {
		switch {
		case errors.Is(t.Error, kafkago.UnknownTopicOrPartition):
			continue
		case t.Error != nil:
			return nil, fmt.Errorf("metadata of %q: %w", t.Name, t.Error)
		}
		for _, p := range t.Partitions {
			switch {
			case p.Error != nil:
				return nil, fmt.Errorf("partition %d of %q: %w", p.ID, t.Name, p.Error)
			case p.Leader.Host == "":
				return nil, fmt.Errorf("partition %d of %q has no leader", p.ID, t.Name)
			}
			addr := net.JoinHostPort(p.Leader.Host, strconv.Itoa(p.Leader.Port))
			if !slices.Contains(addrs, addr) {
				addrs = append(addrs, addr)
			}
		}
	}
	return addrs, nil
}

// NewSink validates cfg and builds a Sink. It does no I/O; Check connects.
func NewSink(cfg Config) (*Sink, error) {
	cfg.setDefaults()
	if err := cfg.validate(false); err != nil {
		return nil, err
	}
	s := &Sink{
		cfg: cfg,
		log: cfg.Logger.With(zap.String("component", "kafka-sink")),
		m:   cfg.Metrics,
	}
	s.transport = newScopedTransport(&s.cfg, s.log)
	s.produce = limitInFlight(s.transport, maxProduceInFlight)
	s.probeCtx, s.stopProbe = context.WithCancel(context.Background())
	s.addr = kafkago.TCP(cfg.Brokers...)
	s.gen = s.newGen()
	return s, nil
}

// maxWriterTopics is how many distinct topics one writerGen publishes to
// before the sink moves to a fresh one (a variable for tests).
var maxWriterTopics = 1024

// writerGen is one pair of producers. kafka-go's Writer keeps a partition
// writer (about 5 KB) and its goroutine for every topic-partition it has
// written to, until Close: with thousands of target topics (and topics
// deleted and new ones created, tenant after tenant) that only grows. So
// once a pair has written to maxWriterTopics topics the sink takes a fresh
// pair for the next Deliver calls and closes the old one when the last
// call using it returns (Close flushes what kafka-go still writes in the
// background).
type writerGen struct {
	w *kafkago.Writer
	// alone is a producer that puts every record in a produce batch of
	// its own (BatchSize 1), for records w's batch got refused (see
	// resendAlone). It shares w's transport.
	alone   *kafkago.Writer
	refs    int                 // Deliver calls using it
	topics  map[string]struct{} // written to, up to maxWriterTopics
	retired bool                // no new calls; closed when refs is 0
	closed  bool
}

// closeLocked marks g closed and returns the function that closes it
// (outside wmu: Close flushes), or nil if it is closed already.
func (g *writerGen) closeLocked() func() error {
	if g.closed {
		return nil
	}
	g.closed = true
	return func() error { return errors.Join(g.w.Close(), g.alone.Close()) }
}

func (s *Sink) newGen() *writerGen {
	g := &writerGen{w: newWriter(&s.cfg, s.produce, s.log), alone: newWriter(&s.cfg, s.produce, s.log),
		topics: make(map[string]struct{})}
	g.alone.BatchSize = 1
	// A record alone in its batch is bounded by the broker's limit, not
	// by BatchBytes: a dead letter of a too-large message is the whole
	// source message, which the delay topic took and a DLQ configured
	// like it takes too (see Deliver).
	g.alone.BatchBytes = math.MaxInt32
	return g
}

// acquire returns the producers for one Deliver call.
func (s *Sink) acquire() *writerGen {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	s.gen.refs++
	return s.gen
}

// release ends a Deliver call on g, which wrote to topics: it retires g
// once g has written to maxWriterTopics topics, and closes a retired g
// that no call uses any more.
func (s *Sink) release(g *writerGen, msgs []kafkago.Message) {
	s.wmu.Lock()
	g.refs--
	if !g.retired {
		for i := range msgs {
			if len(g.topics) >= maxWriterTopics {
				break
			}
			if i > 0 && msgs[i].Topic == msgs[i-1].Topic {
				continue // a run of one topic: one map write, not one a record
			}
			g.topics[msgs[i].Topic] = struct{}{}
		}
		if len(g.topics) >= maxWriterTopics && g == s.gen {
			g.retired, s.gen = true, s.newGen()
		}
	}
	var closeG func() error
	if g.retired && g.refs == 0 {
		closeG = g.closeLocked()
	}
	s.wmu.Unlock()
	if closeG != nil {
		if err := closeG(); err != nil {
			s.log.Warn("kafka: close a retired producer", zap.Error(err))
		}
	}
}

// newWriter is the producer shared by the Sink and RawPipe.
func newWriter(cfg *Config, t kafkago.RoundTripper, log *zap.Logger) *kafkago.Writer {
	return &kafkago.Writer{
		Addr: kafkago.TCP(cfg.Brokers...),
		// Java's default partitioner for keyed records (murmur2 of the
		// key). Records without a key go to a random partition: keeping
		// them on one (Consistent) would make a hot partition.
		Balancer:               &kafkago.Murmur2Balancer{},
		MaxAttempts:            cfg.WriteAttempts,
		WriteBackoffMin:        10 * time.Millisecond,
		WriteBackoffMax:        250 * time.Millisecond,
		BatchSize:              cfg.MaxBatch,
		BatchBytes:             cfg.BatchBytes,
		BatchTimeout:           cfg.BatchTimeout,
		WriteTimeout:           cfg.WriteTimeout,
		ReadTimeout:            cfg.WriteTimeout,
		RequiredAcks:           kafkago.RequireAll,
		AllowAutoTopicCreation: false,
		Transport:              t,
		ErrorLogger:            zapLogger(log, logDebug),
	}
}

// Check connects to the brokers and authenticates (see Source.Check).
func (s *Sink) Check(ctx context.Context) error {
	return check(ctx, &s.cfg, nil)
}

// MissingTopics returns those of topics (dead-letter topics) that do not
// exist, asking without creating them; nil when all exist or the brokers
// cannot tell now (the caller only warns).
func (s *Sink) MissingTopics(ctx context.Context, topics []string) []string {
	if len(topics) == 0 {
		return nil
	}
	return missingTopics(check(ctx, &s.cfg, topics))
}

// Close stops the probe, then flushes and closes the producers; those a
// Deliver still uses are closed when it returns (see release), so a
// publish in flight at shutdown completes rather than being cut.
func (s *Sink) Close() error {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	s.stopProbe()
	s.probes.Wait()
	s.wmu.Lock()
	g := s.gen
	g.retired = true
	var closeG func() error
	if g.refs == 0 { // else the last call using it closes it (release)
		closeG = g.closeLocked()
	}
	s.wmu.Unlock()
	var err error
	if closeG != nil {
		err = closeG()
	}
	s.transport.CloseIdleConnections()
	if err != nil {
		return fmt.Errorf("kafka: close writer: %w", err)
	}
	return nil
}

// Deliver publishes the batch with one WriteMessages call (acks=all) and
// returns nil when every record was acknowledged, otherwise the error of
// each task. A task whose topic does not exist fails alone: kafka-go fails
// a whole call on a metadata error, so the batch is then split by topic.
//
// kafka-go keeps writing a batch in the background after ctx ends, so a
// cancelled Deliver may still publish (at-least-once, as the contract
// allows).
//
// A refusal of a record batch (see batchRefusal) does not tell which of
// its records the broker refused, so the records it came back for are sent
// again, each in a batch of its own (see resendAlone), and only a record
// refused alone wraps shard.ErrRefused.
func (s *Sink) Deliver(ctx context.Context, batch []*codec.Task) []error {
	if len(batch) == 0 {
		return nil
	}
	start := time.Now()
	msgs := make([]kafkago.Message, len(batch))
	errs := make([]error, len(batch))
	idx := make([]int, 0, len(batch))
	var topics []string // distinct: a fire batch names few topics
	for i, t := range batch {
		msgs[i] = toKafkaMessage(t, start)
		if t.Target == "" {
			errs[i] = ErrNoTopic
			continue
		}
		idx = append(idx, i)
		if len(topics) == 0 || topics[len(topics)-1] != t.Target && !slices.Contains(topics, t.Target) {
			topics = append(topics, t.Target)
		}
	}
	// One wider metadata scope for all of the batch's new topics, not
	// one per topic as kafka-go's Writer asks (see scopedTransport).
	s.transport.cover(topics)
	g := s.acquire()
	defer s.release(g, msgs)
	s.send(ctx, g, msgs, idx, errs)
	if retry := staleOnes(errs); len(retry) > 0 && ctx.Err() == nil {
		// A leader moved. kafka-go's transport would keep its stale
		// metadata until MetadataTTL; drop its pools so the retry (and
		// every later publish) reloads it, unless another lane did
		// since this call began.
		s.pools.once(s.transport, start)
		for _, i := range retry {
			errs[i] = nil
		}
		s.send(ctx, g, msgs, retry, errs)
	}
	s.m.PublishSeconds.WithLabelValues(codec.TransportKafka.String()).Observe(time.Since(start).Seconds())
	for _, err := range errs {
		if err != nil {
			return errs
		}
	}
	return nil
}

// send sends msgs[idx]: those up to BatchBytes through g.w, each record
// over it in a batch of its own through g.alone, which has no such limit
// (the broker's decides). It overwrites idx.
func (s *Sink) send(ctx context.Context, g *writerGen, msgs []kafkago.Message, idx []int, errs []error) {
	n := 0
	var big []int
	for _, i := range idx {
		if int64(recordSize(&msgs[i])) > s.cfg.BatchBytes {
			big = append(big, i)
		} else {
			idx[n] = i
			n++
		}
	}
	s.write(ctx, g, g.w, msgs, idx[:n], errs, true)
	s.write(ctx, g, g.alone, msgs, big, errs, true)
}

// write sends msgs[idx] in one call to w (g.w or g.alone) and records
// per-message errors. The records g.w got a batch refusal for are sent
// again through g.alone (see resendAlone).
func (s *Sink) write(ctx context.Context, g *writerGen, w *kafkago.Writer, msgs []kafkago.Message, idx []int, errs []error, split bool) {
	if len(idx) == 0 {
		return
	}
	start := time.Now() // for recheckUnknown
	sub := make([]kafkago.Message, len(idx))
	for j, i := range idx {
		sub[j] = msgs[i]
	}
	err := w.WriteMessages(ctx, sub...)
	if err == nil {
		var written []string // distinct: a fire batch names few topics
		for j := range sub {
			if t := sub[j].Topic; !slices.Contains(written, t) {
				written = append(written, t)
			}
		}
		s.setHealth(written, nil, nil)
		return
	}
	var werrs kafkago.WriteErrors
	if errors.As(err, &werrs) && len(werrs) == len(idx) {
		// Per-record errors. The topics of the records written are
		// healthy again; those of records that failed without an
		// answer (a dropped connection, a timeout) are failed: their
		// partition leader is down even if other topics' leaders are
		// up. A protocol error is an answer: it changes nothing.
		var written, down []string
		var connErr error
		var again []int // refused with a batch: sent again alone
		for j, e := range werrs {
			topic := msgs[idx[j]].Topic
			var protoErr kafkago.Error
			switch {
			case e == nil:
				written = append(written, topic)
			case errors.As(e, &protoErr):
			default:
				down = append(down, topic)
				if connErr == nil {
					connErr = e
				}
			}
			switch {
			case e != nil && w != g.alone && batchRefusal(e):
				again = append(again, idx[j])
				errs[idx[j]] = e
			case e != nil:
				errs[idx[j]] = publishError(topic, e)
			}
		}
		if connErr != nil && ctx.Err() == nil { // stopping says nothing about the brokers
			connErr = fmt.Errorf("kafka: publish: %w", classify(connErr))
		} else {
			connErr = nil
		}
		s.setHealth(written, connErr, down)
		s.resendAlone(ctx, g, msgs, again, errs)
		return
	}
	// A whole-call failure: a metadata error for one topic (missing
	// topic), a cancelled ctx, or no broker. Retry topic by topic so only
	// the tasks of a bad topic fail.
	byTopic := make(map[string][]int)
	var order []string
	for _, i := range idx {
		t := msgs[i].Topic
		if _, ok := byTopic[t]; !ok {
			order = append(order, t)
		}
		byTopic[t] = append(byTopic[t], i)
	}
	var protoErr kafkago.Error
	if !errors.As(err, &protoErr) && ctx.Err() == nil {
		s.setHealth(nil, fmt.Errorf("kafka: publish: %w", classify(err)), order)
	}
	if errors.Is(err, kafkago.UnknownTopicOrPartition) && ctx.Err() == nil && s.recheckUnknown(ctx, order, start) {
		// A topic created since the transport's metadata was read: the
		// transport reloaded it since this call began, so send again.
		s.write(ctx, g, w, msgs, idx, errs, split)
		return
	}
	if !split || len(order) == 1 || ctx.Err() != nil {
		for _, i := range idx {
			errs[i] = publishError(msgs[i].Topic, err)
		}
		return
	}
	// Most often one topic of many is missing (a deleted tenant's): ask
	// the transport's metadata cache (no round trip) which topics fail,
	// fail their records and send the rest in one call. One call per
	// topic in a row would cost a produce round trip per distinct topic.
	if bad := s.badTopics(ctx, order); len(bad) > 0 {
		var rest []int
		for _, t := range order {
			if terr, ok := bad[t]; ok {
				for _, i := range byTopic[t] {
					errs[i] = publishError(t, terr)
				}
				continue
			}
			rest = append(rest, byTopic[t]...)
		}
		if len(rest) > 0 {
			s.write(ctx, g, w, msgs, rest, errs, true)
		}
		return
	}
	for _, t := range order {
		s.write(ctx, g, w, msgs, byTopic[t], errs, false)
	}
}

// badTopics returns those of topics whose metadata, as the sink's
// transport has it cached, carries an error (a missing topic, one the
// principal may not describe), with it; nil if it cannot tell.
func (s *Sink) badTopics(ctx context.Context, topics []string) map[string]error {
	c := kafkago.Client{Addr: s.addr, Transport: s.transport}
	md, err := c.Metadata(ctx, &kafkago.MetadataRequest{Topics: topics})
	if err != nil {
		return nil
	}
	var bad map[string]error
	for _, t := range md.Topics {
		if t.Error != nil {
			if bad == nil {
				bad = make(map[string]error)
			}
			bad[t.Name] = t.Error
		}
	}
	return bad
}

// recheckUnknown asks the brokers about those of topics that the
// transport's cached metadata does not know, and reports whether one of
// them exists after all, its metadata reloaded since since (when the
// write that failed began): the transport then reloads its metadata
// (CloseIdleConnections drops its pools). The cache is up to MetadataTTL
// old, so a target topic created just before its task came due (a new
// tenant's) failed as missing: an attempt charged and a "refused" Warn per
// try until the cache caught up, and, with retry.max_attempts of 3 or
// less, a publish-failed dead letter of a task whose topic exists (hunt
// H177). Each topic is asked about at most once per MetadataTTL, so a
// deleted tenant's topic that still gets tasks costs one metadata request
// per MetadataTTL, not one per publish. One call asks at a time: another
// lane's publish that failed the same topic meanwhile (the tenant's tasks
// are spread over the shards) takes its answer, and sends again if it
// found the topic after that publish began; a write sent again after the
// reload does not send again (it began after it), which bounds the
// recursion in write.
func (s *Sink) recheckUnknown(ctx context.Context, topics []string, since time.Time) bool {
	bad := s.badTopics(ctx, topics)
	s.recheckMu.Lock()
	defer s.recheckMu.Unlock()
	now := time.Now()
	var ask []string
	again := false
	s.mu.Lock()
	for _, t := range topics {
		// Found by another lane's call since this write began (the
		// cache may know it by now, so bad may not name it).
		if r, ok := s.rechecked[t]; ok && r.found && r.at.After(since) {
			again = true
		}
	}
	for t, err := range bad {
		if !errors.Is(err, kafkago.UnknownTopicOrPartition) {
			continue
		}
		if r, ok := s.rechecked[t]; ok && now.Sub(r.at) < s.cfg.MetadataTTL {
			continue
		}
		ask = append(ask, t)
	}
	if len(ask) > 0 {
		if s.rechecked == nil || len(s.rechecked) >= maxRechecked {
			s.rechecked = make(map[string]recheck)
		}
		for _, t := range ask {
			s.rechecked[t] = recheck{at: now}
		}
	}
	s.mu.Unlock()
	if len(ask) == 0 {
		return again
	}
	found, err := s.existing(ctx, ask)
	if err != nil {
		s.log.Debug("kafka: cannot ask the brokers about topics missing from the cached metadata", zap.Strings("topics", ask), zap.Error(err))
		return again
	}
	if len(found) == 0 {
		return again
	}
	s.log.Debug("kafka: target topics created since the metadata was read; reloading it", zap.Strings("topics", found))
	s.pools.drop(s.transport)
	reloaded := time.Now()
	s.mu.Lock()
	for _, t := range found {
		s.rechecked[t] = recheck{at: reloaded, found: true}
	}
	s.mu.Unlock()
	return true
}

// maxRechecked bounds Sink.rechecked; past it the map starts over (a
// topic forgotten is only asked about again).
const maxRechecked = 4096

// existing returns those of topics that exist, asking the brokers through
// a new transport (see ping: the sink's answers Metadata from its cache)
// for the metadata of these topics only.
func (s *Sink) existing(ctx context.Context, topics []string) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.DialTimeout)
	defer cancel()
	c, done := s.freshClient(topics)
	defer done()
	md, err := c.Metadata(ctx, &kafkago.MetadataRequest{Topics: topics})
	if err != nil {
		return nil, fmt.Errorf("metadata: %w", err)
	}
	var found []string
	for _, tp := range md.Topics {
		if tp.Error == nil && slices.Contains(topics, tp.Name) {
			found = append(found, tp.Name)
		}
	}
	return found, nil
}

// resendAlone sends msgs[idx] again, each record in a produce batch of its
// own, and records their errors; errs[idx] hold the batch refusals g.w got
// for them.
//
// A broker checks the size limit (max.message.bytes) against the whole
// record batch of a partition, and rejects a whole batch as invalid or
// corrupt if one record in it is; kafka-go hands the batch's error to every
// record in it, and the batch may have held records of other Deliver calls
// (g.w batches across concurrent calls). So the refusal does not say that
// the topic will never take a given record: only its answer to the record
// alone does. g.alone (BatchSize 1) sends every record in a batch of its
// own, in one call: a refusal from it is the record's own.
//
// This runs only after a batch refusal, never on success; a record the
// topic refuses alone is sent twice per Deliver (a parked dead letter, once
// per retry).
func (s *Sink) resendAlone(ctx context.Context, g *writerGen, msgs []kafkago.Message, idx []int, errs []error) {
	if len(idx) == 0 {
		return
	}
	if ctx.Err() != nil {
		// Stopping: the refusal stays unexplained, so it is no
		// refusal of the record (a dead letter holds its source).
		for _, i := range idx {
			errs[i] = fmt.Errorf("kafka: publish to %q: %w, to a batch of several records; not sent again alone: %w",
				msgs[i].Topic, errs[i], ctx.Err())
		}
		return
	}
	s.log.Debug("kafka refused a record batch; sending its records again one per batch",
		zap.Int("records", len(idx)), zap.Error(errs[idx[0]]))
	for _, i := range idx {
		errs[i] = nil
	}
	s.write(ctx, g, g.alone, msgs, idx, errs, true)
}

// batchRefusal reports whether err is a refusal that a broker gives a
// whole record batch for one of its records, or for their sum: kafka-go
// reports it for every record of the batch (see resendAlone). These are
// the broker's answers refused treats as refusals of the record. kafka-go's
// own size check (MessageTooLargeError, against BatchBytes) is not one: it
// names the one record too large (the sink sends a record over BatchBytes
// alone, to a writer without that limit, see Deliver).
func batchRefusal(err error) bool {
	var own kafkago.MessageTooLargeError
	if errors.As(err, &own) {
		return false
	}
	return recordRefusal(err)
}

// recordRefusal reports whether err is a broker answer that refuses a
// record or its batch as such: MESSAGE_TOO_LARGE (max.message.bytes),
// RECORD_LIST_TOO_LARGE (a batch larger than the topic's segment.bytes),
// INVALID_RECORD and CORRUPT_MESSAGE.
func recordRefusal(err error) bool {
	return errors.Is(err, kafkago.MessageSizeTooLarge) || errors.Is(err, kafkago.RecordListTooLarge) ||
		errors.Is(err, kafkago.InvalidRecord) || errors.Is(err, kafkago.InvalidMessage)
}

// staleOnes returns the indexes of errors caused by a moved leader.
func staleOnes(errs []error) []int {
	var out []int
	for i, err := range errs {
		if err != nil && staleMetadata(err) && !errors.Is(err, kafkago.UnknownTopicOrPartition) {
			out = append(out, i)
		}
	}
	return out
}

// publishError wraps a record's publish failure; one that says the brokers
// cannot take it now (unavailable) also wraps shard.ErrUnavailable, so the
// engine retries it without charging an attempt; one that refuses the
// record itself (refused) wraps shard.ErrRefused, so a dead letter its DLQ
// will never take as is can be parked.
func publishError(topic string, err error) error {
	err = classify(err)
	switch {
	case unavailable(err):
		return fmt.Errorf("kafka: publish to %q: %w: %w", topic, shard.ErrUnavailable, err)
	case refused(err):
		return fmt.Errorf("kafka: publish to %q: %w: %w", topic, shard.ErrRefused, err)
	}
	return fmt.Errorf("kafka: publish to %q: %w", topic, err)
}

// refused reports whether the broker refused the record itself, so that it
// will never take it as is: larger than the topic or broker allows
// (MESSAGE_TOO_LARGE; RECORD_LIST_TOO_LARGE, larger than a log segment), or a
// record the broker rejects (INVALID_RECORD, CORRUPT_MESSAGE: e.g. a
// record without a key for a compacted topic). A failure of the topic as a
// whole (missing, not authorized, no leader) is not a refusal: it heals
// when the operator fixes the topic.
func refused(err error) bool {
	return recordRefusal(err)
}

// unavailable reports whether a publish failed for want of a working
// cluster rather than because of the record or its topic: no connection
// or answer (dial, TLS, dropped connection, timeout), a failed SASL
// handshake, or a broker answer that the partition cannot take writes now
// (no leader, too few in-sync replicas, storage error, throttling). A
// missing topic, a refused or oversized record and a topic the principal
// may not write to are the task's own failures.
func unavailable(err error) bool {
	var tooLarge kafkago.MessageTooLargeError
	if errors.As(err, &tooLarge) || errors.Is(err, context.Canceled) {
		return false
	}
	var pe kafkago.Error
	if !errors.As(err, &pe) {
		return true
	}
	switch pe {
	case kafkago.LeaderNotAvailable, kafkago.NotLeaderForPartition, kafkago.RequestTimedOut,
		kafkago.NetworkException, kafkago.NotEnoughReplicas, kafkago.NotEnoughReplicasAfterAppend,
		kafkago.KafkaStorageError, kafkago.FencedLeaderEpoch, kafkago.UnknownLeaderEpoch,
		kafkago.PreferredLeaderNotAvailable, kafkago.EligibleLeadersNotAvailable,
		kafkago.ListenerNotFound, kafkago.NotController, kafkago.ThrottlingQuotaExceeded,
		kafkago.BrokerNotAvailable, kafkago.ReplicaNotAvailable,
		kafkago.SASLAuthenticationFailed, kafkago.UnsupportedSASLMechanism, kafkago.IllegalSASLState,
		kafkago.ClusterAuthorizationFailed:
		return true
	}
	return false
}

func toKafkaMessage(t *codec.Task, now time.Time) kafkago.Message {
	var headers []kafkago.Header
	if len(t.Headers) > 0 {
		headers = make([]kafkago.Header, len(t.Headers))
		for i, h := range t.Headers {
			headers[i] = kafkago.Header{Key: h.Key, Value: h.Value}
		}
	}
	return kafkago.Message{
		Topic:   t.Target,
		Key:     t.Key,
		Value:   t.Value,
		Headers: headers,
		Time:    now,
	}
}

// recordSize is kafka-go's size estimate of a message (Message.totalSize,
// unexported), which WriteMessages compares with BatchBytes. Checking it
// first sends a record over BatchBytes alone (the broker's limit decides)
// instead of failing the whole call with MessageTooLargeError.
func recordSize(m *kafkago.Message) int {
	n := 4 + 1 + 1 + 4 + len(m.Key) + 4 + len(m.Value) + 8
	n += varintLen(int64(len(m.Headers)))
	for _, h := range m.Headers {
		n += varintLen(int64(len(h.Key))) + len(h.Key)
		n += varintLen(int64(len(h.Value))) + len(h.Value)
	}
	return n
}

// varintLen is the length of a zig-zag varint.
func varintLen(v int64) int {
	u := uint64((v << 1) ^ (v >> 63))
	n := 1
	for u >= 0x80 {
		u >>= 7
		n++
	}
	return n
}
