package kafka

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	metadataapi "github.com/segmentio/kafka-go/protocol/metadata"
	produceapi "github.com/segmentio/kafka-go/protocol/produce"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/delaybridge/delaybridge/codec"
)

// connsTo counts the established TCP connections of this process (and
// any other on the machine) to the ports of addrs, from the client side:
// /proc/net/tcp{,6} lines whose remote port is one of them. Counting
// kafka-go's connection goroutines in the whole process instead took in
// those of earlier tests' transports still dialling (CI: 11 before, 29
// after, bound 16+1). The test's brokers listen on ports of their own,
// so only its clients count.
func connsTo(t *testing.T, addrs []string) int {
	t.Helper()
	ports := map[string]bool{}
	for _, a := range addrs {
		_, port, err := net.SplitHostPort(a)
		if err != nil {
			t.Fatal(err)
		}
		n, err := strconv.Atoi(port)
		if err != nil {
			t.Fatal(err)
		}
		ports[fmt.Sprintf("%04X", n)] = true
	}
	n := 0
	for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		b, err := os.ReadFile(f)
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				continue
			}
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(b), "\n")[1:] {
			fs := strings.Fields(line)
			if len(fs) < 4 || fs[3] != "01" { // ESTABLISHED
				continue
			}
			if i := strings.LastIndexByte(fs[2], ':'); i >= 0 && ports[fs[2][i+1:]] {
				n++
			}
		}
	}
	return n
}

// TestConnectionsPerDistinctTopics (hunt H177): one Deliver of a batch
// spread over 512 topics opened 512 connections to the (single) broker:
// kafka-go sends a produce request per partition, all at once, and its
// transport dials a new connection for every request that finds none
// idle, then keeps them idle for IdleTimeout (transportIdle). Each shard's lane
// did the same. Now at most maxProduceInFlight produce requests are in
// flight (here 16), so at most as many connections, and every task is
// delivered.
func TestConnectionsPerDistinctTopics(t *testing.T) {
	old := maxProduceInFlight
	maxProduceInFlight = 16
	t.Cleanup(func() { maxProduceInFlight = old })
	var topics []string
	for i := range 512 {
		topics = append(topics, fmt.Sprintf("tenant-%d", i))
	}
	c := newCluster(t, kfake.SeedTopics(1, topics...))
	s, err := NewSink(testConfig(t, c.ListenAddrs(), ""))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if errs := s.Deliver(context.Background(), []*codec.Task{task(topics[0], "k", "v")}); errs != nil {
		t.Fatal(errors.Join(errs...))
	}
	before := connsTo(t, c.ListenAddrs())
	var batch []*codec.Task
	for _, tp := range topics {
		batch = append(batch, task(tp, "k", "v"))
	}
	if errs := s.Deliver(context.Background(), batch); errs != nil {
		t.Fatal(errors.Join(errs...))
	}
	after := connsTo(t, c.ListenAddrs())
	t.Logf("kafka-go connections: %d before, %d after one batch of 512 tasks over 512 topics", before, after)
	// The bound, one for metadata, and those the warm-up left open
	// (before).
	if after > before+maxProduceInFlight+1 {
		t.Errorf("%d connections after one batch (%d before, bound %d)", after, before, maxProduceInFlight)
	}
	// Every topic got its task (and the warm-up's one more for topics[0]).
	cl := producer(t, c, kgo.ConsumeTopics(topics...), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.FetchMaxWait(100*time.Millisecond))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	per := map[string]int{}
	for n := 0; n < len(topics)+1; {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("read %d of %d records", n, len(topics)+1)
		}
		fs.EachRecord(func(r *kgo.Record) { per[r.Topic]++; n++ })
	}
	for i, tp := range topics {
		want := 1
		if i == 0 {
			want = 2
		}
		if per[tp] != want {
			t.Errorf("topic %s holds %d records, want %d", tp, per[tp], want)
		}
	}
}

// TestInFlightLimit: the limiter lets at most its bound of produce
// requests to one broker through at once (the leader of the request's
// partition in the transport's metadata), never holds a request to another
// broker nor other requests, and a produce request waiting for room fails
// with its context's error.
func TestInFlightLimit(t *testing.T) {
	rt := &blockingRT{release: make(chan struct{}), leaders: map[string]int32{"a": 1, "b": 2}}
	l := limitInFlight(rt, 3)
	errc := make(chan error, 10)
	for range 5 {
		go func() {
			_, err := l.RoundTrip(context.Background(), nil, produceTo("a"))
			errc <- err
		}()
	}
	eventuallyTrue(t, "3 produce requests in flight", func() bool { return rt.inFlight.Load() == 3 })
	// A metadata request is not held behind them.
	if _, err := l.RoundTrip(context.Background(), nil, &metadataapi.Request{}); err != nil {
		t.Fatal(err)
	}
	// Nor is a produce request to another broker.
	if _, err := l.RoundTrip(context.Background(), nil, produceTo("b")); err != nil {
		t.Fatal(err)
	}
	// A produce request whose context ends while it waits fails with it.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	if _, err := l.RoundTrip(ctx, nil, produceTo("a")); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("waiting produce request: %v, want the deadline", err)
	}
	if got := rt.max.Load(); got != 3 {
		t.Fatalf("%d produce requests to one broker were in flight at once, want 3", got)
	}
	close(rt.release)
	for range 5 {
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
	}
	if got := rt.max.Load(); got != 3 {
		t.Errorf("%d produce requests to one broker were in flight at once, want at most 3", got)
	}
	if got := rt.produced.Load(); got != 6 {
		t.Errorf("%d produce requests reached the transport, want 6", got)
	}
}

func produceTo(topic string) *produceapi.Request {
	return &produceapi.Request{Topics: []produceapi.RequestTopic{{Topic: topic, Partitions: []produceapi.RequestPartition{{Partition: 0}}}}}
}

// blockingRT answers metadata with leaders (topic -> broker id, partition
// 0) and holds every produce request to broker 1 until release is closed,
// counting those in flight and the most at once.
type blockingRT struct {
	release  chan struct{}
	leaders  map[string]int32
	inFlight atomic.Int32
	max      atomic.Int32
	produced atomic.Int32
}

func (b *blockingRT) RoundTrip(_ context.Context, _ net.Addr, req kafkago.Request) (kafkago.Response, error) {
	p, ok := req.(*produceapi.Request)
	if !ok {
		md := &metadataapi.Response{}
		if m, ok := req.(*metadataapi.Request); ok {
			for _, tp := range m.TopicNames {
				md.Topics = append(md.Topics, metadataapi.ResponseTopic{Name: tp,
					Partitions: []metadataapi.ResponsePartition{{PartitionIndex: 0, LeaderID: b.leaders[tp]}}})
			}
		}
		return md, nil
	}
	b.produced.Add(1)
	if b.leaders[p.Topics[0].Topic] != 1 {
		return nil, nil
	}
	n := b.inFlight.Add(1)
	for {
		m := b.max.Load()
		if n <= m || b.max.CompareAndSwap(m, n) {
			break
		}
	}
	<-b.release
	b.inFlight.Add(-1)
	return nil, nil
}

func eventuallyTrue(t *testing.T, what string, f func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !f(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}
