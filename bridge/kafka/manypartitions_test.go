package kafka

import (
	"context"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"github.com/twmb/franz-go/pkg/kversion"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"

	"github.com/delaybridge/delaybridge/internal/testlog"
)

// checkAllOnce fails unless h stored each offset of every partition of
// topic once, perPart[p] of them, and committed each partition to its end.
func checkAllOnce(t *testing.T, h *memHandler, c *kfake.Cluster, topic string, parts int32, perPart map[int32]int64) {
	t.Helper()
	offs := h.offsets(topic)
	for p := range parts {
		seen := map[int64]bool{}
		for _, o := range offs[p] {
			if seen[o] {
				t.Errorf("%s/%d offset %d twice", topic, p, o)
			}
			seen[o] = true
		}
		if int64(len(seen)) != perPart[p] {
			t.Errorf("%s/%d: stored %d want %d", topic, p, len(seen), perPart[p])
		}
	}
}

// TestManyPartitionsAddedAndTopicsChanged: 128 partitions grown to 256 while
// running, then restarts with other kafka.topics lists: every record stored
// once, offsets committed for every partition.
func TestManyPartitionsAddedAndTopicsChanged(t *testing.T) {
	c := newCluster(t, kfake.NumBrokers(3), kfake.SeedTopics(128, "delay"), kfake.SeedTopics(64, "delay2"), kfake.SeedTopics(32, "delay3"))
	cl := producer(t, c)
	h := newMemHandler()
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay", "delay2")
	cfg.Logger = testlog.New(t, zaptest.Level(zapcore.WarnLevel))
	s, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop := runSource(t, s, h)
	produceN(t, cl, "delay", 128, 0, 1280)
	produceN(t, cl, "delay2", 64, 0, 640)
	waitFor(t, "first", func() bool { return h.count() == 1920 })
	addPartitions(t, cl, "delay", 256)
	t0 := time.Now()
	// publish to the new partitions too, right away (before the watcher noticed)
	cl = producer(t, c)
	produceN(t, cl, "delay", 256, 1280, 2560)
	waitFor(t, "after growth", func() bool { return h.count() == 1920+2560 })
	t.Logf("growth handled in %v", time.Since(t0))
	waitFor(t, "commits", func() bool {
		cm := committed(c, "g", "delay")
		for p := range int32(256) {
			want := int64(10)
			if p < 128 {
				want = 20
			}
			if cm[p] != want {
				return false
			}
		}
		return true
	})
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	// restart with another topic list
	cfg2 := testConfig(t, c.ListenAddrs(), "g", "delay2", "delay3")
	cfg2.Logger = cfg.Logger
	s2, err := NewSource(cfg2)
	if err != nil {
		t.Fatal(err)
	}
	produceN(t, cl, "delay", 256, 0, 256)
	produceN(t, cl, "delay3", 32, 0, 320)
	t1 := time.Now()
	stop2 := runSource(t, s2, h)
	waitFor(t, "second run", func() bool { return h.count() == 1920+2560+320 })
	t.Logf("second run caught up in %v", time.Since(t1))
	if err := stop2(); err != nil {
		t.Fatal(err)
	}
	cfg3 := testConfig(t, c.ListenAddrs(), "g", "delay", "delay2", "delay3")
	cfg3.Logger = cfg.Logger
	s3, err := NewSource(cfg3)
	if err != nil {
		t.Fatal(err)
	}
	t2 := time.Now()
	stop3 := runSource(t, s3, h)
	waitFor(t, "third run", func() bool { return h.count() == 1920+2560+320+256 })
	<-s3.CaughtUp()
	t.Logf("third run caught up in %v", time.Since(t2))
	time.Sleep(500 * time.Millisecond)
	if err := stop3(); err != nil {
		t.Fatal(err)
	}
	pp := map[int32]int64{}
	for p := range int32(256) {
		pp[p] = 11
		if p < 128 {
			pp[p] = 21
		}
	}
	checkAllOnce(t, h, c, "delay", 256, pp)
	p2 := map[int32]int64{}
	for p := range int32(64) {
		p2[p] = 10
	}
	checkAllOnce(t, h, c, "delay2", 64, p2)
	p3 := map[int32]int64{}
	for p := range int32(32) {
		p3[p] = 10
	}
	checkAllOnce(t, h, c, "delay3", 32, p3)
	for _, tp := range []string{"delay", "delay2", "delay3"} {
		cm := committed(c, "g", tp)
		t.Logf("%s commits: %d partitions", tp, len(cm))
	}
}

// TestManyPartitionsStoreAheadOfGroup: the group's offsets of 128 partitions
// behind the store (a crash between store and offset commit): nothing is
// stored twice, and every partition's offset is caught up.
func TestManyPartitionsStoreAheadOfGroup(t *testing.T) {
	const parts = 128
	c := newCluster(t, kfake.NumBrokers(3), kfake.SeedTopics(parts, "delay"))
	cl := producer(t, c)
	h := newMemHandler()
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
	cfg.Logger = testlog.New(t, zaptest.Level(zapcore.WarnLevel))
	s, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop := runSource(t, s, h)
	produceN(t, cl, "delay", parts, 0, 10*parts)
	waitFor(t, "all", func() bool { return h.count() == 10*parts })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	// A crash between store commit and offset commit: the group is behind
	// (offset 3 everywhere, group empty now).
	req := kmsg.NewPtrOffsetCommitRequest()
	req.Group = "g"
	req.Generation = -1
	rt := kmsg.NewOffsetCommitRequestTopic()
	rt.Topic = "delay"
	for p := range int32(parts) {
		rp := kmsg.NewOffsetCommitRequestTopicPartition()
		rp.Partition, rp.Offset = p, 3
		rt.Partitions = append(rt.Partitions, rp)
	}
	req.Topics = append(req.Topics, rt)
	old := producer(t, c, kgo.MaxVersions(kversion.V3_0_0()))
	resp, err := req.RequestWith(context.Background(), old)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range resp.Topics[0].Partitions {
		if p.ErrorCode != 0 {
			t.Fatalf("commit %d: %d", p.Partition, p.ErrorCode)
		}
	}
	if cm := committed(c, "g", "delay"); cm[5] != 3 || cm[127] != 3 {
		t.Fatalf("reset did not take: %v", cm)
	}
	produceN(t, cl, "delay", parts, 10*parts, parts)
	s2, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop2 := runSource(t, s2, h)
	waitFor(t, "caught up commits", func() bool {
		cm := committed(c, "g", "delay")
		for p := range int32(parts) {
			if cm[p] != 11 {
				return false
			}
		}
		return true
	})
	if err := stop2(); err != nil {
		t.Fatal(err)
	}
	pp := map[int32]int64{}
	for p := range int32(parts) {
		pp[p] = 11
	}
	checkAllOnce(t, h, c, "delay", parts, pp)
}
