package kafka

import (
	"context"
	"errors"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/delaybridge/delaybridge/codec"
)

// createTopic creates topic (one partition) on c.
func createTopic(t *testing.T, c *kfake.Cluster, topic string) {
	t.Helper()
	req := kmsg.NewPtrCreateTopicsRequest()
	rt := kmsg.NewCreateTopicsRequestTopic()
	rt.Topic, rt.NumPartitions, rt.ReplicationFactor = topic, 1, 1
	req.Topics = append(req.Topics, rt)
	resp, err := req.RequestWith(context.Background(), producer(t, c))
	if err != nil {
		t.Fatalf("create topic %s: %v", topic, err)
	}
	if err := kerr.ErrorForCode(resp.Topics[0].ErrorCode); err != nil {
		t.Fatalf("create topic %s: %v", topic, err)
	}
}

// TestSinkTopicCreatedSinceMetadata: a target topic created after the
// sink's transport read its metadata (a new tenant's, its task
// due at once) is delivered to, alone or among other topics, instead of
// failing as missing until the cache is MetadataTTL old (an attempt
// charged per try, and with a small retry.max_attempts a publish-failed
// dead letter of a task whose topic exists, hunt H177). A topic that is
// missing still fails as missing.
func TestSinkTopicCreatedSinceMetadata(t *testing.T) {
	c, s := warmSink(t, "new-alone", "new-among")
	ctx := context.Background()

	createTopic(t, c, "new-alone")
	if errs := s.Deliver(ctx, []*codec.Task{task("new-alone", "k", "v1")}); errs != nil {
		t.Fatalf("a topic created since the metadata was read, alone in its batch: %v", errors.Join(errs...))
	}

	createTopic(t, c, "new-among")
	batch := []*codec.Task{task("old", "k", "v2"), task("new-among", "k", "v3"), task("gone", "k", "v4")}
	errs := s.Deliver(ctx, batch)
	if errs == nil || errs[0] != nil || errs[1] != nil {
		t.Fatalf("old and a topic created since the metadata was read, among a missing one: %v", errs)
	}
	if !errors.Is(errs[2], kafkago.UnknownTopicOrPartition) {
		t.Fatalf("missing topic: %v, want UnknownTopicOrPartition", errs[2])
	}
	for _, tp := range []string{"new-alone", "new-among"} {
		if recs := consumeAll(t, c, tp, 1); len(recs) != 1 {
			t.Fatalf("%s: %d records", tp, len(recs))
		}
	}
	// Asked about once per MetadataTTL: a missing topic that keeps
	// getting tasks costs no metadata request per publish.
	s.mu.Lock()
	at, ok := s.rechecked["gone"]
	s.mu.Unlock()
	if errs := s.Deliver(ctx, []*codec.Task{task("gone", "k", "v5")}); errs == nil || !errors.Is(errs[0], kafkago.UnknownTopicOrPartition) {
		t.Fatalf("missing topic again: %v", errs)
	}
	s.mu.Lock()
	again := s.rechecked["gone"]
	s.mu.Unlock()
	if !ok || !again.at.Equal(at.at) {
		t.Fatalf("missing topic asked about again within MetadataTTL (%v, %v -> %v)", ok, at, again)
	}
}

// warmSink is a sink on a new cluster with topic "old" whose transport
// has read the metadata (a delivery to "old"), cached for 10 minutes: not
// refreshed during a test. The transport reads the metadata of "old" and
// of unborn too (see scopedTransport), topics that do not exist yet: a
// topic the sink publishes to that is created after the transport read
// it is not in the cached metadata until the next MetadataTTL.
func warmSink(t *testing.T, unborn ...string) (*kfake.Cluster, *Sink) {
	t.Helper()
	c := newCluster(t, kfake.SeedTopics(1, "old"))
	cfg := testConfig(t, c.ListenAddrs(), "")
	cfg.MetadataTTL = 10 * time.Minute
	s, err := NewSink(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	s.transport.cover(unborn)
	if errs := s.Deliver(context.Background(), []*codec.Task{task("old", "k", "warm")}); errs != nil {
		t.Fatal(errors.Join(errs...))
	}
	if bad := s.badTopics(context.Background(), unborn); len(bad) != len(unborn) {
		t.Fatalf("cached metadata of %v: errors %v, want each missing", unborn, bad)
	}
	return c, s
}
