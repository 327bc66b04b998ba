package kafka

import (
	"context"
	"fmt"
	"testing"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"
)

// A source's transport reads the metadata of the source's topics, not the
// cluster's: each pool it drops when a fetch finds the metadata stale (a
// leader moved, once per such failure and partition) stays in memory up to
// transportIdle with that metadata. On a cluster of 2 000 partitions, 50
// drops held 32 MB (hunt H208).
func TestSourceDroppedPoolsHoldItsTopicsOnly(t *testing.T) {
	topics := make([]string, 200)
	for i := range topics {
		topics[i] = fmt.Sprintf("a-topic-with-a-longish-name-%03d", i)
	}
	c := newCluster(t, kfake.SeedTopics(10, topics...))
	s, err := NewSource(testConfig(t, c.ListenAddrs(), "g", topics[0]))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ask := func() {
		t.Helper()
		if _, err := listOffset(context.Background(), s.client, topics[0], 0, kafkago.FirstOffset); err != nil {
			t.Fatalf("list offsets: %v", err)
		}
	}
	ask()
	s.transport.CloseIdleConnections()
	h0 := heapInuse()
	const drops = 50
	for range drops {
		ask()
		s.transport.CloseIdleConnections()
	}
	held := heapInuse() - h0
	if held > 4<<20 {
		t.Fatalf("%d pools the source's transport dropped hold %d KB: the metadata of the cluster's %d partitions, not of its topic", drops, held>>10, 10*len(topics))
	}
	t.Logf("%d dropped pools hold %d KB", drops, held>>10)
}
