package nats

import (
	"bytes"
	"context"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// BenchmarkRawPipe measures the adapter alone: consume 1 KB messages from
// one JetStream stream and publish them to another (file storage both), no
// delay and no store, in one process with an in-process server.
func BenchmarkRawPipe(b *testing.B) {
	s := startServer(b, jsOptions(b))
	nc, err := natsgo.Connect(serverURL(s))
	if err != nil {
		b.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(4096))
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	for _, sc := range []jetstream.StreamConfig{
		{Name: "FROM", Subjects: []string{"from.>"}},
		{Name: "TO", Subjects: []string{"to.>"}},
	} {
		if _, err := js.CreateStream(ctx, sc); err != nil {
			b.Fatal(err)
		}
	}
	payload := bytes.Repeat([]byte("x"), 1024)
	for range b.N {
		if _, err := js.PublishAsync("from.x", payload); err != nil {
			b.Fatal(err)
		}
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-time.After(time.Minute):
		b.Fatal("prefill not acknowledged")
	}
	b.ReportAllocs()
	b.SetBytes(int64(len(payload)))
	b.ResetTimer()
	d, err := RawPipe(ctx, serverURL(s), "FROM", "from.x", "to.x", b.N)
	b.StopTimer()
	if err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(b.N)/d.Seconds(), "msgs/s")
	info, err := js.Stream(ctx, "TO")
	if err != nil {
		b.Fatal(err)
	}
	if got := info.CachedInfo().State.Msgs; got < uint64(b.N) {
		b.Fatalf("target holds %d of %d", got, b.N)
	}
}
