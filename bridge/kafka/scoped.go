package kafka

import (
	"context"
	"maps"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	metadataapi "github.com/segmentio/kafka-go/protocol/metadata"
	"go.uber.org/zap"
)

// maxScopedTopics is how many topics a scopedTransport reads the metadata
// of before it reads the whole cluster's instead (a variable for tests).
// It is maxWriterTopics: a sink that publishes to more topics than that
// turns its producers over anyway.
var maxScopedTopics = 1024

// scopedTransport is the Sink's kafka-go RoundTripper. It reads the
// metadata of the topics the sink publishes to, not the whole cluster's.
//
// kafka-go's Transport reads the metadata of its MetadataTopics, or of
// every topic of the cluster when that is empty, at start and every
// MetadataTTL (6 s), on every pool (one per connection reset, see
// poolDrops). The target topics are not configured (any topic
// targets.allow matches), so the sink read the whole cluster's: on a
// shared cluster of thousands of topics a metadata answer of megabytes
// every 6 s (kafka-go's issue #963 and xk6-kafka's #202 report about 1 MB),
// 637 KB held by each dropped pool against 9 KB for one topic (hunt F211),
// and, on a cluster with ACLs, a "Denied Operation = Describe" audit
// record for every topic the bridge's principal may not describe, every
// 6 s (kafka-go #963).
//
// A kafka-go pool's topics are fixed when it is made, so widening the set
// takes a new Transport: the next requests go through it (its first one
// waits for its first metadata answer, as a new pool's always does) and
// the old one's pools are dropped, closing their connections once the
// requests in flight on them end. Deliver widens once for all the topics
// of a fire batch (cover); RoundTrip widens for a metadata request naming
// a topic not covered, which kafka-go's Writer makes before producing to
// it, so no produce reaches a pool that does not know its topic. Topics
// are not forgotten: a missing topic stays, and is asked about every
// MetadataTTL (how the sink finds it created). Past maxScopedTopics the
// transport reads the whole cluster's metadata, as kafka-go does by
// default, rather than renew its connections at every new topic.
type scopedTransport struct {
	cfg *Config
	log *zap.Logger

	mu  sync.Mutex // serializes widening
	cur atomic.Pointer[scope]
	// widened counts the Transports made after the first (tests).
	widened atomic.Int64
	// failedReads drops the current Transport's pools after a metadata
	// request failed on a pool that never read the metadata (see
	// RoundTrip), once for the requests that began before the drop.
	failedReads poolDrops
}

// scope is one Transport and the topics it reads the metadata of; topics
// is nil when it reads the whole cluster's.
type scope struct {
	t      *kafkago.Transport
	topics map[string]struct{}
	// retired: a wider scope replaced this one and dropped t's pools. A
	// request that took this scope before then may still reach t and
	// make it a new pool; it drops t's pools again when it ends.
	retired atomic.Bool
}

var _ kafkago.RoundTripper = (*scopedTransport)(nil)

// newScopedTransport returns a transport with cfg's settings that reads
// the metadata of topics (none yet: the first publish names them).
func newScopedTransport(cfg *Config, log *zap.Logger, topics ...string) *scopedTransport {
	s := &scopedTransport{cfg: cfg, log: log}
	set := make(map[string]struct{}, len(topics))
	for _, t := range topics {
		set[t] = struct{}{}
	}
	s.cur.Store(s.scopeOf(set))
	return s
}

// scopeOf makes the Transport that reads the metadata of topics (of the
// whole cluster when topics is nil).
func (s *scopedTransport) scopeOf(topics map[string]struct{}) *scope {
	t := s.cfg.transport()
	if topics != nil {
		// Never empty: kafka-go reads every topic's metadata for an
		// empty MetadataTopics. A name no topic can have (Kafka topic
		// names are [a-zA-Z0-9._-]) stands in before the first publish.
		t.MetadataTopics = slices.Sorted(maps.Keys(topics))
		if len(t.MetadataTopics) == 0 {
			t.MetadataTopics = []string{noTopic}
		}
	}
	return &scope{t: t, topics: topics}
}

// noTopic is the one topic of a scope that covers none yet: a name Kafka
// refuses for a topic, so its metadata answer is one error entry.
const noTopic = "delaybridge:none"

// covers reports whether sc reads the metadata of every one of topics.
func (sc *scope) covers(topics []string) bool {
	if sc.topics == nil {
		return true
	}
	for _, t := range topics {
		if _, ok := sc.topics[t]; !ok && t != "" {
			return false
		}
	}
	return true
}

// cover makes the transport read the metadata of topics too (empty names
// are left out), unless it does already.
func (s *scopedTransport) cover(topics []string) {
	if s.cur.Load().covers(topics) {
		return
	}
	s.mu.Lock()
	cur := s.cur.Load()
	if cur.covers(topics) {
		s.mu.Unlock()
		return
	}
	set := maps.Clone(cur.topics)
	for _, t := range topics {
		if t != "" {
			set[t] = struct{}{}
		}
	}
	whole := len(set) > maxScopedTopics
	if whole {
		set = nil
	}
	next := s.scopeOf(set)
	s.cur.Store(next)
	s.widened.Add(1)
	s.mu.Unlock()
	// Requests in flight on the old pools hold them until they end.
	// Retired first: a request that took cur and reaches its Transport
	// after this drop drops the pool it made there (see RoundTrip).
	cur.retired.Store(true)
	cur.t.CloseIdleConnections()
	if whole {
		s.log.Info("kafka: the sink publishes to more topics than it reads the metadata of one by one; it reads the whole cluster's metadata from now on",
			zap.Int("topics", maxScopedTopics))
		return
	}
	s.log.Debug("kafka: the sink reads the metadata of more target topics", zap.Int("topics", len(set)))
}

// RoundTrip sends req through the current Transport, after widening it
// to the topics of a metadata request that names some it does not cover.
//
// A request that took a scope a widening then retired may have reached
// its Transport after the widening dropped its pools: kafka-go made it a
// new pool there, which nothing else would drop, its discover goroutine
// and control connection kept for the life of the process and the
// metadata read every MetadataTTL (review R218). So a request on a
// retired scope drops its Transport's pools when it ends (in-flight
// requests hold theirs until they end).
//
// kafka-go answers a metadata request from its pool's cache, and fails
// it only when the pool never read the metadata (its first read failed)
// or ctx ended. The pool keeps that error until its next read, a random
// time up to MetadataTTL later, even once the brokers answer again; a
// widening during a blip (a broker restarting) failed the publishes to
// every topic, the old ones too, where the old pool would have sent them
// from its cache (review R218). Such a failure drops the pools (once for
// the requests that began before the drop), so the next request reads
// the metadata anew.
func (s *scopedTransport) RoundTrip(ctx context.Context, addr net.Addr, req kafkago.Request) (kafkago.Response, error) {
	m, meta := req.(*metadataapi.Request)
	if meta && m.TopicNames != nil {
		s.cover(m.TopicNames)
	}
	var start time.Time // for failedReads: only a metadata request's failure drops
	if meta {
		start = time.Now()
	}
	sc := s.cur.Load()
	scopeLoaded()
	res, err := sc.t.RoundTrip(ctx, addr, req)
	switch {
	case sc.retired.Load():
		sc.t.CloseIdleConnections()
	case meta && err != nil && ctx.Err() == nil:
		s.failedReads.once(sc.t, start)
	}
	return res, err
}

// scopeLoaded runs between RoundTrip's taking the scope and its request
// (tests: a widening retires the scope meanwhile).
var scopeLoaded = func() {}

// CloseIdleConnections drops the current Transport's pools (see
// poolDrops): the next request reads the metadata anew.
func (s *scopedTransport) CloseIdleConnections() {
	s.cur.Load().t.CloseIdleConnections()
}

// topics is what the transport reads the metadata of, sorted; nil when
// it reads the whole cluster's (tests).
func (s *scopedTransport) topics() []string {
	sc := s.cur.Load()
	if sc.topics == nil {
		return nil
	}
	return slices.Sorted(maps.Keys(sc.topics))
}
