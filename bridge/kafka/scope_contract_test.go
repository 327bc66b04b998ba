package kafka

import (
	"errors"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/delaybridge/delaybridge/bridge"
	"github.com/delaybridge/delaybridge/shard"
)

// TestIDScopeAndOrderThroughTheStore pins CONTRACT §1's replace/cancel
// rules end to end (kfake, the source, the pipeline and a Pebble store):
// ids are scoped to their topic (the same key in two topics is two
// tasks, and a cancel in one leaves the other), not to a partition (a
// cancel on another partition reaches its schedule); across partitions
// the later broker timestamp wins (the source reads the two partitions
// in whatever order its fetches return them, so a run covers one order;
// shard's TestReplace and TestCancel pin both); in one partition the
// later offset wins, even with an earlier timestamp; a tombstone with a
// (binary) key cancels the task whose id is that key.
func TestIDScopeAndOrderThroughTheStore(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(2, "delay-a", "delay-b"))
	eng, err := shard.Open(shard.Options{Dir: t.TempDir(), Shards: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = eng.Close() })
	t0 := time.Now().Truncate(time.Millisecond)
	bin := string([]byte{0x00, 0xff, 'b'})
	sched := func(topic string, p int32, key string, at time.Time) *kgo.Record {
		return &kgo.Record{Topic: topic, Partition: p, Key: []byte(key), Value: []byte(topic + "/" + key), Timestamp: at,
			Headers: []kgo.RecordHeader{{Key: "Delay-After", Value: []byte("1h")}, {Key: "delay-target", Value: []byte("out")}}}
	}
	cancel := func(topic string, p int32, key string, at time.Time) *kgo.Record {
		return &kgo.Record{Topic: topic, Partition: p, Key: []byte(key), Value: []byte("x"), Timestamp: at,
			Headers: []kgo.RecordHeader{{Key: "DELAY-CANCEL", Value: []byte("True")}}}
	}
	produce(t, producer(t, c),
		sched("delay-a", 0, "k", t0), sched("delay-b", 0, "k", t0),
		cancel("delay-a", 1, "k", t0.Add(time.Second)),                                // later, other partition: cancels
		sched("delay-a", 0, "r", t0), cancel("delay-a", 1, "r", t0.Add(-time.Minute)), // older cancel: ignored
		sched("delay-b", 1, "s", t0), cancel("delay-b", 1, "s", t0.Add(-time.Minute)), // same partition, later offset: cancels
		sched("delay-b", 0, bin, t0), &kgo.Record{Topic: "delay-b", Partition: 0, Key: []byte(bin), Timestamp: t0}, // tombstone
	)
	s, err := NewSource(testConfig(t, c.ListenAddrs(), "g", "delay-a", "delay-b"))
	if err != nil {
		t.Fatal(err)
	}
	stop := runSource(t, s, bridge.NewPipeline(eng, nil))
	waitFor(t, "every record stored and committed", func() bool {
		a, b := committed(c, "g", "delay-a"), committed(c, "g", "delay-b")
		return a[0] == 2 && a[1] == 2 && b[0] == 3 && b[1] == 2
	})
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		topic, id string
		pending   bool
	}{
		{"delay-a", "k", false}, {"delay-b", "k", true}, {"delay-a", "r", true}, {"delay-b", "s", false}, {"delay-b", bin, false},
	} {
		info, err := eng.Lookup(tc.topic, tc.id)
		switch {
		case tc.pending && err != nil:
			t.Errorf("%s %q: %v, want pending", tc.topic, tc.id, err)
		case !tc.pending && !errors.Is(err, shard.ErrNotFound):
			t.Errorf("%s %q: %+v (%v), want cancelled", tc.topic, tc.id, info, err)
		}
	}
	if got := eng.Stats().Pending; got != 2 {
		t.Errorf("%d pending, want 2 (delay-b's k and delay-a's r)", got)
	}
}
