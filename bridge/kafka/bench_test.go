package kafka

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
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
