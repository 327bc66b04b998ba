package kafka

import (
	"bytes"
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/delaybridge/delaybridge/bridge"
)

// BenchmarkRawPipe is the floor under the bridge's Kafka throughput: 1 KB
// records copied from one topic to another through the adapter's fetch
// path and producer (acks=all), with no parsing, store or delay, on an
// in-process kfake broker.
func BenchmarkRawPipe(b *testing.B) {
	for _, parts := range []int32{1, 4} {
		b.Run(fmt.Sprintf("partitions=%d", parts), func(b *testing.B) {
			c := newCluster(b, kfake.SeedTopics(parts, "from", "to"))
			cl := producer(b, c, kgo.ProducerBatchMaxBytes(1<<20))
			value := bytes.Repeat([]byte("x"), 1024)
			const chunk = 1000
			for i := 0; i < b.N; i += chunk {
				n := min(chunk, b.N-i)
				rs := make([]*kgo.Record, n)
				for j := range rs {
					rs[j] = &kgo.Record{Topic: "from", Partition: int32(i+j) % parts, Key: fmt.Appendf(nil, "k%d", i+j), Value: value}
				}
				produce(b, cl, rs...)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer cancel()
			b.SetBytes(1024)
			b.ReportAllocs()
			b.ResetTimer()
			d, err := RawPipe(ctx, c.ListenAddrs(), "from", "to", b.N)
			b.StopTimer()
			if err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(float64(b.N)/d.Seconds(), "msgs/s")
		})
	}
}

// countHandler stores nothing; it counts, so the benchmark measures the
// source: group, fetch, decode, batch, commit.
type countHandler struct {
	n    atomic.Int64
	done chan struct{}
	want int64
}

func (h *countHandler) Handle(_ context.Context, b *bridge.Batch) error {
	if h.n.Add(int64(len(b.Items))) == h.want {
		close(h.done)
	}
	return nil
}

func (h *countHandler) Checkpoint(string) (int64, bool, error) { return 0, false, nil }

// BenchmarkSourceIngest is the Source alone: b.N 1 KB records over 4
// partitions handed to a handler that only counts, offsets committed per
// batch.
func BenchmarkSourceIngest(b *testing.B) {
	c := newCluster(b, kfake.SeedTopics(4, "delay"))
	cl := producer(b, c, kgo.ProducerBatchMaxBytes(1<<20))
	value := bytes.Repeat([]byte("x"), 1024)
	for i := 0; i < b.N; i += 1000 {
		rs := make([]*kgo.Record, min(1000, b.N-i))
		for j := range rs {
			rs[j] = &kgo.Record{Topic: "delay", Partition: int32(i+j) % 4, Value: value}
		}
		produce(b, cl, rs...)
	}
	cfg := testConfig(b, c.ListenAddrs(), "bench", "delay")
	cfg.Logger = nil
	s, err := NewSource(cfg)
	if err != nil {
		b.Fatal(err)
	}
	h := &countHandler{done: make(chan struct{}), want: int64(b.N)}
	b.SetBytes(1024)
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	stop := runSource(b, s, h)
	select {
	case <-h.done:
	case <-time.After(10 * time.Minute):
		b.Fatalf("consumed %d of %d", h.n.Load(), b.N)
	}
	d := time.Since(start)
	b.StopTimer()
	if err := stop(); err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(b.N)/d.Seconds(), "msgs/s")
}

func TestRawPipe(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(2, "from", "to"))
	produceN(t, producer(t, c), "from", 2, 0, 50)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := RawPipe(ctx, c.ListenAddrs(), "from", "to", 50); err != nil {
		t.Fatal(err)
	}
	recs := consumeAll(t, c, "to", 50)
	if len(recs) != 50 {
		t.Fatalf("copied %d", len(recs))
	}
	if _, err := RawPipe(ctx, c.ListenAddrs(), "nope", "to", 1); err == nil {
		t.Fatal("RawPipe from a missing topic succeeded")
	}
	short, cancelShort := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancelShort()
	if _, err := RawPipe(short, c.ListenAddrs(), "from", "to", 1000); err == nil {
		t.Fatal("RawPipe copied more messages than the topic holds")
	}
}
