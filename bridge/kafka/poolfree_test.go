package kafka

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"
)

func heapInuse() int64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapInuse)
}

// A connection pool the transport drops (CloseIdleConnections: a Close,
// or a reload of stale metadata after a leader moved, once per such
// failure) holds the whole cluster's metadata until kafka-go's timer of
// its idle connection fires, which CloseIdleConnections does not stop: it
// must be freed within transportIdle, not stay for 5 min (hunt H208: 100
// drops on a cluster of 2 000 partitions held 64 MB).
func TestDroppedPoolsAreFreed(t *testing.T) {
	if os.Getenv("DELAYBRIDGE_LONG") != "1" {
		t.Skip("long form only (DELAYBRIDGE_LONG=1): waits transportIdle, about 30 s")
	}
	topics := make([]string, 200)
	for i := range topics {
		topics[i] = fmt.Sprintf("a-topic-with-a-longish-name-%03d", i)
	}
	c := newCluster(t, kfake.SeedTopics(10, topics...))
	cfg := Config{Brokers: c.ListenAddrs()}
	cfg.setDefaults()
	tp := cfg.transport()
	cl := &kafkago.Client{Addr: kafkago.TCP(c.ListenAddrs()...), Transport: tp}
	ask := func() {
		t.Helper()
		_, err := cl.ListOffsets(context.Background(), &kafkago.ListOffsetsRequest{
			Topics: map[string][]kafkago.OffsetRequest{topics[0]: {kafkago.FirstOffsetOf(0)}}})
		if err != nil {
			t.Fatalf("list offsets: %v", err)
		}
	}
	ask()
	tp.CloseIdleConnections()
	h0 := heapInuse()
	const drops = 50
	for range drops {
		ask()
		tp.CloseIdleConnections()
	}
	held := heapInuse() - h0
	if held < 8<<20 {
		t.Fatalf("%d dropped pools hold %d KB: too little to tell when they are freed", drops, held>>10)
	}
	start := time.Now()
	deadline := start.Add(transportIdle + 30*time.Second)
	for {
		now := heapInuse() - h0
		if now < held/4 {
			t.Logf("%d dropped pools held %d KB, freed within %v", drops, held>>10, time.Since(start).Round(time.Second))
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d dropped pools held %d KB; %d KB still held %v later", drops, held>>10, now>>10, time.Since(start).Round(time.Second))
		}
		time.Sleep(500 * time.Millisecond)
	}
}
