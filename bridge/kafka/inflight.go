package kafka

import (
	"context"
	"net"

	kafkago "github.com/segmentio/kafka-go"
	produceapi "github.com/segmentio/kafka-go/protocol/produce"
)

// maxProduceInFlight bounds the produce requests a Sink (or a RawPipe) has
// in flight at once, over every broker and topic. kafka-go's Writer sends
// one produce request per topic-partition of a call, all at once, and its
// Transport dials a new connection for each request that finds none idle
// and keeps it idle for IdleTimeout (5 min): a fire batch spread over 512
// target topics opened 512 connections to one broker, and each shard's
// lane as many (hunt H177). Past the bound, a request waits for one in
// flight to end, on a connection that is then idle for it: at most
// maxProduceInFlight connections, as many as a Java producer's in-flight
// requests over 12 brokers. A variable for tests.
var maxProduceInFlight = 64

// inFlightLimit is a kafka-go RoundTripper that lets at most cap(sem)
// produce requests through rt at once. Other requests (metadata, which
// kafka-go's Writer asks for every call and its Transport mostly answers
// from its cache) are not held.
type inFlightLimit struct {
	rt  kafkago.RoundTripper
	sem chan struct{}
}

var _ kafkago.RoundTripper = (*inFlightLimit)(nil)

// limitInFlight returns rt with at most n produce requests in flight.
func limitInFlight(rt kafkago.RoundTripper, n int) *inFlightLimit {
	return &inFlightLimit{rt: rt, sem: make(chan struct{}, max(n, 1))}
}

// RoundTrip sends req through the underlying RoundTripper, a produce
// request once there is room for it (or fails with ctx's error, as a
// request whose connection does not come in time does).
func (l *inFlightLimit) RoundTrip(ctx context.Context, addr net.Addr, req kafkago.Request) (kafkago.Response, error) {
	if _, ok := req.(*produceapi.Request); !ok {
		return l.rt.RoundTrip(ctx, addr, req)
	}
	select {
	case l.sem <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	defer func() { <-l.sem }()
	return l.rt.RoundTrip(ctx, addr, req)
}
