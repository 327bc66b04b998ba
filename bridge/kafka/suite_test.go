package kafka

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/delaybridge/delaybridge/bridge"
	"github.com/delaybridge/delaybridge/bridge/bridgetest"
	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/shard"
)

// kfakeBroker runs the shared adapter suite on an in-process kfake cluster.
type kfakeBroker struct {
	c    *kfake.Cluster
	prod *kgo.Client
	seq  atomic.Int64
}

var _ bridgetest.Broker = (*kfakeBroker)(nil)

func TestAdapterSuite(t *testing.T) {
	c := newCluster(t)
	bridgetest.Run(t, &kfakeBroker{c: c, prod: producer(t, c)})
}

func (b *kfakeBroker) Transport() codec.Transport { return codec.TransportKafka }

func (b *kfakeBroker) topic(t testing.TB, prefix string, partitions int32) string {
	t.Helper()
	name := fmt.Sprintf("%s-%d", prefix, b.seq.Add(1))
	if err := b.c.CreateTopic(name, partitions, nil); err != nil {
		t.Fatalf("create topic %s: %v", name, err)
	}
	return name
}

// NewDelaySource is one partition: the suite checks total order.
func (b *kfakeBroker) NewDelaySource(t testing.TB) string { return b.topic(t, "delay", 1) }

// NewTarget has several partitions: the suite checks order per key.
func (b *kfakeBroker) NewTarget(t testing.TB) string { return b.topic(t, "target", 3) }

func (b *kfakeBroker) Publish(t testing.TB, source string, m bridgetest.Msg) {
	t.Helper()
	r := &kgo.Record{Topic: source, Partition: 0, Key: m.Key, Value: m.Value}
	for _, h := range m.Headers {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: h.Key, Value: h.Value})
	}
	produce(t, b.prod, r)
}

func (b *kfakeBroker) NewSource(t testing.TB, source, group string, rules *codec.Rules) bridge.Source {
	t.Helper()
	cfg := testConfig(t, b.c.ListenAddrs(), group)
	cfg.Sources = []SourceConfig{{Topic: source, Rules: rules}}
	s, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func (b *kfakeBroker) NewSink(t testing.TB) shard.Sink {
	t.Helper()
	s, err := NewSink(testConfig(t, b.c.ListenAddrs(), ""))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func (b *kfakeBroker) Consume(t testing.TB, target string, n int) []bridgetest.Msg {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(b.c.ListenAddrs()...), kgo.ConsumeTopics(target),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var out []bridgetest.Msg
	for len(out) < n {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("consumed %d of %d from %s", len(out), n, target)
		}
		fs.EachRecord(func(r *kgo.Record) {
			m := bridgetest.Msg{Key: r.Key, Value: r.Value}
			for _, h := range r.Headers {
				m.Headers = append(m.Headers, codec.Header{Key: h.Key, Value: h.Value})
			}
			out = append(out, m)
		})
	}
	return out
}
