package kafka

import (
	"context"
	"net"
	"sync"

	kafkago "github.com/segmentio/kafka-go"
	metadataapi "github.com/segmentio/kafka-go/protocol/metadata"
	produceapi "github.com/segmentio/kafka-go/protocol/produce"
)

// maxProduceInFlight bounds the produce requests a Sink (or a RawPipe) has
// in flight at once to one broker. kafka-go's Writer sends one produce
// request per topic-partition of a call, all at once, and its Transport
// dials a new connection for each request that finds none idle and keeps
// it idle for IdleTimeout (5 min): a fire batch spread over 512 target
// topics opened 512 connections to one broker, and each shard's lane as
// many (hunt H177). Past the bound, a request waits for one in flight to
// the same broker to end, on a connection that is then idle for it: at
// most maxProduceInFlight connections a broker. The bound is per broker,
// not per process: a broker that takes requests and does not answer (a
// stalled disk) holds its own requests' slots until WriteTimeout, and a
// bound shared by all brokers made every other broker's deliveries wait
// as long (review R186). A variable for tests.
var maxProduceInFlight = 64

// inFlightLimit is a kafka-go RoundTripper that lets at most
// maxProduceInFlight produce requests to one broker through rt at once.
// The broker is the partition's leader in rt's cached metadata (the one
// kafka-go's Transport sends the request to); a request whose leader it
// cannot tell shares one more bound. Other requests (metadata, which
// kafka-go's Writer asks for every call and its Transport mostly answers
// from its cache) are not held.
type inFlightLimit struct {
	rt kafkago.RoundTripper
	n  int

	mu   sync.Mutex
	sems map[int32]chan struct{} // per leader id; -1: not known
}

var _ kafkago.RoundTripper = (*inFlightLimit)(nil)

// limitInFlight returns rt with at most n produce requests in flight to a
// broker.
func limitInFlight(rt kafkago.RoundTripper, n int) *inFlightLimit {
	return &inFlightLimit{rt: rt, n: max(n, 1), sems: map[int32]chan struct{}{}}
}

// RoundTrip sends req through the underlying RoundTripper, a produce
// request once there is room for it at its broker (or fails with ctx's
// error, as a request whose connection does not come in time does).
func (l *inFlightLimit) RoundTrip(ctx context.Context, addr net.Addr, req kafkago.Request) (kafkago.Response, error) {
	p, ok := req.(*produceapi.Request)
	if !ok {
		return l.rt.RoundTrip(ctx, addr, req)
	}
	sem := l.sem(l.leader(ctx, addr, p))
	select {
	case sem <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	defer func() { <-sem }()
	return l.rt.RoundTrip(ctx, addr, req)
}

// sem is the bound of the broker with id leader.
func (l *inFlightLimit) sem(leader int32) chan struct{} {
	l.mu.Lock()
	defer l.mu.Unlock()
	s, ok := l.sems[leader]
	if !ok {
		// Broker ids are few and stay: no eviction.
		s = make(chan struct{}, l.n)
		l.sems[leader] = s
	}
	return s
}

// leader is the id of the leader of p's (first) partition in rt's
// metadata, which kafka-go's Transport answers from its cache, or -1.
// kafka-go's Writer sends one partition a request.
func (l *inFlightLimit) leader(ctx context.Context, addr net.Addr, p *produceapi.Request) int32 {
	if len(p.Topics) == 0 || len(p.Topics[0].Partitions) == 0 {
		return -1
	}
	topic, part := p.Topics[0].Topic, p.Topics[0].Partitions[0].Partition
	r, err := l.rt.RoundTrip(ctx, addr, &metadataapi.Request{TopicNames: []string{topic}})
	if err != nil {
		return -1
	}
	md, ok := r.(*metadataapi.Response)
	if !ok {
		return -1
	}
	for _, t := range md.Topics {
		if t.Name != topic {
			continue
		}
		for _, pp := range t.Partitions {
			if pp.PartitionIndex == part {
				return pp.LeaderID
			}
		}
	}
	return -1
}
