package kafka

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/shard"
)

// leaderOutage is a three-broker cluster whose topic "out" has one
// partition, led by broker 1, and a sink that bootstraps from broker 0
// only. While down is set, broker 1 drops the connection on every request;
// the other brokers keep answering.
type leaderOutage struct {
	c    *kfake.Cluster
	s    *Sink
	down atomic.Bool
	// Requests broker 1 refused, ApiVersions requests it answered, and
	// produce requests it received while up.
	refused, leaderAPIVersions, leaderProduces atomic.Int64
}

const outageLeader = 1

// newLeaderOutage starts the cluster and the sink, publishes one task while
// all is well, then takes broker 1 down and publishes again: the sink is
// unhealthy and probing.
func newLeaderOutage(t *testing.T) *leaderOutage {
	t.Helper()
	o := &leaderOutage{c: newCluster(t, kfake.NumBrokers(3), kfake.SeedTopics(1, "out"))}
	if err := o.c.MoveTopicPartition("out", 0, outageLeader); err != nil {
		t.Fatal(err)
	}
	o.c.Control(func(req kmsg.Request) (kmsg.Response, error, bool) {
		o.c.KeepControl()
		if o.c.CurrentNode() != outageLeader {
			return nil, nil, false
		}
		if o.down.Load() {
			o.refused.Add(1)
			return nil, errors.New("injected outage of the partition leader"), true
		}
		switch req.Key() {
		case int16(kmsg.ApiVersions):
			o.leaderAPIVersions.Add(1)
		case int16(kmsg.Produce):
			o.leaderProduces.Add(1)
		}
		return nil, nil, false
	})

	cfg := testConfig(t, o.c.ListenAddrs()[:1], "") // broker 0: not the leader
	cfg.ProbeInterval = 15 * time.Millisecond
	cfg.DialTimeout = 2 * time.Second
	s, err := NewSink(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	o.s = s

	if errs := s.Deliver(context.Background(), []*codec.Task{task("out", "k", "before")}); errs != nil {
		t.Fatalf("Deliver: %v", errs)
	}
	if o.leaderProduces.Load() == 0 {
		t.Fatal("the publish did not reach broker 1: it is not the leader of out/0")
	}
	o.down.Store(true)
	if errs := s.Deliver(context.Background(), []*codec.Task{task("out", "k", "during")}); len(errs) != 1 || !errors.Is(errs[0], shard.ErrUnavailable) {
		t.Fatalf("Deliver while the leader is down: %v, want shard.ErrUnavailable", errs)
	}
	if s.Health() == nil || !s.probeRunning() {
		t.Fatalf("Health %v, probe running %v after the publish to the down leader failed", s.Health(), s.probeRunning())
	}
	return o
}

// waitRefusedProbes waits until the leader refused n more requests (every
// probe sends it at least one, nothing else does while it is down) and
// asserts on every poll that the sink stays unhealthy meanwhile.
func (o *leaderOutage) waitRefusedProbes(t *testing.T, n int64) {
	t.Helper()
	seen := o.refused.Load()
	waitFor(t, "probes refused by the partition leader", func() bool {
		if err := o.s.Health(); err == nil {
			t.Fatal("Health nil while the leader of the failed partition is down: the probe asked only the bootstrap broker")
		}
		return o.refused.Load() >= seen+n
	})
}

// The bootstrap broker answering says nothing about the broker that leads
// the partition whose publish failed: the probe asks that leader, and the
// sink stays unhealthy (no /readyz flapping) while it is down.
func TestSinkProbeStaysUnhealthyWhileLeaderDown(t *testing.T) {
	o := newLeaderOutage(t)
	o.waitRefusedProbes(t, 5)
	err := o.s.Health()
	if err == nil || !strings.Contains(err.Error(), "probe brokers") || !strings.Contains(err.Error(), "partition leader") {
		t.Fatalf("Health = %v, want the probe's error naming the partition leader", err)
	}
	if !o.s.probeRunning() {
		t.Fatal("the probe stopped while the leader is down")
	}
}

// Once the partition leader is back, a probe clears Health without any
// publish, and the probe goroutine ends.
func TestSinkProbeRecoversWhenLeaderBack(t *testing.T) {
	o := newLeaderOutage(t)
	o.waitRefusedProbes(t, 1)
	answered, produces := o.leaderAPIVersions.Load(), o.leaderProduces.Load()
	o.down.Store(false)
	waitFor(t, "Health nil once the leader is back", func() bool { return o.s.Health() == nil })
	waitFor(t, "the probe to end", func() bool { return !o.s.probeRunning() })
	if o.leaderAPIVersions.Load() == answered {
		t.Fatal("Health cleared without the leader answering a probe")
	}
	if n := o.leaderProduces.Load() - produces; n != 0 {
		t.Fatalf("%d produce requests after the outage: the recovery was to come from the probe", n)
	}
}

// partitionLeaders wants a leader for every partition of a topic that
// exists, and names each leading broker once.
func TestPartitionLeaders(t *testing.T) {
	b0 := kafkago.Broker{ID: 0, Host: "10.0.0.1", Port: 9092}
	b1 := kafkago.Broker{ID: 1, Host: "10.0.0.2", Port: 9092}
	led := func(topic string, leaders ...kafkago.Broker) kafkago.Topic {
		tp := kafkago.Topic{Name: topic}
		for i, l := range leaders {
			tp.Partitions = append(tp.Partitions, kafkago.Partition{Topic: topic, ID: i, Leader: l})
		}
		return tp
	}

	got, err := partitionLeaders(&kafkago.MetadataResponse{Topics: []kafkago.Topic{
		led("a", b0, b1, b0),
		led("b", b1),
		{Name: "gone", Error: kafkago.UnknownTopicOrPartition},
	}})
	if err != nil || strings.Join(got, " ") != "10.0.0.1:9092 10.0.0.2:9092" {
		t.Fatalf("partitionLeaders = %q, %v; want each leader once", got, err)
	}

	noLeader := led("a", b0, kafkago.Broker{ID: -1})
	offline := led("a", b0, b1)
	offline.Partitions[1].Error = kafkago.LeaderNotAvailable
	for _, tc := range []struct {
		name  string
		topic kafkago.Topic
		want  string
	}{
		{"no leader", noLeader, `partition 1 of "a" has no leader`},
		{"partition error", offline, `partition 1 of "a": ` + kafkago.LeaderNotAvailable.Error()},
		{"topic error", kafkago.Topic{Name: "a", Error: kafkago.TopicAuthorizationFailed}, `metadata of "a"`},
	} {
		got, err := partitionLeaders(&kafkago.MetadataResponse{Topics: []kafkago.Topic{tc.topic}})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: partitionLeaders = %q, %v; want an error with %q", tc.name, got, err, tc.want)
		}
	}
}
