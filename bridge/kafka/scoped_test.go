package kafka

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/delaybridge/delaybridge/codec"
)

// metadataAsks records the topics of every Metadata request c gets; a
// request for every topic of the cluster is recorded as nil.
func metadataAsks(c *kfake.Cluster) func() [][]string {
	var mu sync.Mutex
	var asks [][]string
	c.ControlKey(int16(kmsg.Metadata), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		req := kreq.(*kmsg.MetadataRequest)
		var topics []string
		if req.Topics != nil {
			topics = []string{}
			for _, rt := range req.Topics {
				if rt.Topic != nil {
					topics = append(topics, *rt.Topic)
				}
			}
		}
		mu.Lock()
		asks = append(asks, topics)
		mu.Unlock()
		return nil, nil, false
	})
	return func() [][]string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(asks)
	}
}

// manyTopicCluster is a cluster of 200 topics of 10 partitions that the
// sink does not publish to, and targets.
func manyTopicCluster(t *testing.T, targets ...string) *kfake.Cluster {
	t.Helper()
	others := make([]string, 200)
	for i := range others {
		others[i] = fmt.Sprintf("another-teams-topic-with-a-longish-name-%03d", i)
	}
	return newCluster(t, kfake.SeedTopics(10, others...), kfake.SeedTopics(2, targets...))
}

// The sink reads the metadata of the topics it publishes to, not the
// cluster's: kafka-go's Transport read every topic's at each pool's start
// and every MetadataTTL, megabytes every 6 s on a large shared cluster
// and, with ACLs, an audit record per topic the bridge may not describe
// (kafka-go #963). Each pool a leader move or a new topic drops holds
// that metadata up to transportIdle: here 50 drops on a cluster of 2 000
// partitions held 26-32 MB before (hunt H208's 640 KB a pool).
func TestSinkReadsItsTopicsMetadataOnly(t *testing.T) {
	c := manyTopicCluster(t, "orders", "reminders")
	asks := metadataAsks(c)
	s, err := NewSink(testConfig(t, c.ListenAddrs(), ""))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	deliver := func(tasks ...*codec.Task) {
		t.Helper()
		if errs := s.Deliver(ctx, tasks); errs != nil {
			t.Fatal(errors.Join(errs...))
		}
	}
	deliver(task("orders", "k", "1"))
	deliver(task("orders", "k", "2"), task("reminders", "k", "3"))
	if got := s.transport.topics(); !slices.Equal(got, []string{"orders", "reminders"}) {
		t.Fatalf("metadata scope %v, want [orders reminders]", got)
	}
	if n := s.transport.widened.Load(); n != 2 {
		t.Errorf("the scope was widened %d times, want 2 (once per batch with a new topic)", n)
	}
	h0 := heapInuse()
	const drops = 50
	for range drops {
		s.pools.drop(s.transport)
		deliver(task("reminders", "k", "again"))
	}
	held := heapInuse() - h0
	t.Logf("%d dropped pools hold %d KB", drops, held>>10)
	if held > 4<<20 {
		t.Errorf("%d pools the sink dropped hold %d KB: the metadata of the cluster's 2 000 partitions, not of its 2 topics", drops, held>>10)
	}
	for _, topics := range asks() {
		if topics == nil {
			t.Fatal("the sink asked for the metadata of every topic of the cluster")
		}
		for _, tp := range topics {
			if tp != "orders" && tp != "reminders" {
				t.Fatalf("the sink asked for the metadata of %q (asked %v)", tp, topics)
			}
		}
	}
	if recs := consumeAll(t, c, "reminders", 1+drops); len(recs) != 1+drops {
		t.Fatalf("reminders holds %d records, want %d", len(recs), 1+drops)
	}
}

// A metadata request through the sink's transport for a topic no Deliver
// named yet (kafka-go's Writer asks before it produces) widens the scope
// first, so the answer is the broker's, not a cached "unknown topic".
func TestScopedTransportWidensOnMetadata(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(3, "a", "b"))
	s, err := NewSink(testConfig(t, c.ListenAddrs(), ""))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	cl := kafkago.Client{Addr: kafkago.TCP(c.ListenAddrs()...), Transport: s.transport}
	md, err := cl.Metadata(context.Background(), &kafkago.MetadataRequest{Topics: []string{"b"}})
	if err != nil {
		t.Fatal(err)
	}
	if len(md.Topics) != 1 || md.Topics[0].Error != nil || len(md.Topics[0].Partitions) != 3 {
		t.Fatalf("metadata of b: %+v", md.Topics)
	}
	if got := s.transport.topics(); !slices.Equal(got, []string{"b"}) {
		t.Fatalf("metadata scope %v, want [b]", got)
	}
}

// Past maxScopedTopics the sink reads the whole cluster's metadata (as
// kafka-go does by default) instead of renewing its connections at every
// new topic, and still delivers to every topic.
func TestScopedTransportWholeClusterPastLimit(t *testing.T) {
	old := maxScopedTopics
	maxScopedTopics = 2
	t.Cleanup(func() { maxScopedTopics = old })
	c := newCluster(t, kfake.SeedTopics(1, "a", "b", "c", "d"))
	asks := metadataAsks(c)
	s, err := NewSink(testConfig(t, c.ListenAddrs(), ""))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	for _, batch := range [][]string{{"a", "b"}, {"c"}, {"d"}} {
		var tasks []*codec.Task
		for _, tp := range batch {
			tasks = append(tasks, task(tp, "k", tp))
		}
		if errs := s.Deliver(ctx, tasks); errs != nil {
			t.Fatalf("deliver %v: %v", batch, errors.Join(errs...))
		}
		want := batch
		if batch[0] != "a" {
			want = nil // the whole cluster
		}
		if got := s.transport.topics(); !slices.Equal(got, want) {
			t.Fatalf("after %v: scope %v, want %v", batch, got, want)
		}
	}
	if n := s.transport.widened.Load(); n != 2 {
		t.Errorf("widened %d times, want 2 (to a and b, then to the whole cluster)", n)
	}
	if !slices.ContainsFunc(asks(), func(topics []string) bool { return topics == nil }) {
		t.Error("no metadata request for the whole cluster past the limit")
	}
	for _, tp := range []string{"a", "b", "c", "d"} {
		if recs := consumeAll(t, c, tp, 1); len(recs) != 1 {
			t.Fatalf("%s holds %d records", tp, len(recs))
		}
	}
}
