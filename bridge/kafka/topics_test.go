package kafka

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/delaybridge/delaybridge/bridge"
	"github.com/delaybridge/delaybridge/codec"
)

// addPartitions grows topic to count partitions with a raw CreatePartitions.
func addPartitions(t *testing.T, cl *kgo.Client, topic string, count int32) {
	t.Helper()
	req := kmsg.NewPtrCreatePartitionsRequest()
	rt := kmsg.NewCreatePartitionsRequestTopic()
	rt.Topic = topic
	rt.Count = count
	req.Topics = append(req.Topics, rt)
	req.TimeoutMillis = 5000
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		t.Fatalf("create partitions: %v", err)
	}
	for _, r := range resp.Topics {
		if r.ErrorCode != 0 {
			t.Fatalf("create partitions %s: code %d %v", r.Topic, r.ErrorCode, r.ErrorMessage)
		}
	}
}

// TestSourcePartitionsAddedWhileRunning: partitions added to a delay topic
// are picked up (the partition watcher ends the generation) and read from
// their start, records published before the bridge noticed included.
func TestSourcePartitionsAddedWhileRunning(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	cl := producer(t, c)
	produceN(t, cl, "delay", 1, 0, 3)
	h := newMemHandler()
	s, err := NewSource(testConfig(t, c.ListenAddrs(), "g", "delay"))
	if err != nil {
		t.Fatal(err)
	}
	stop := runSource(t, s, h)
	waitFor(t, "p0", func() bool { return h.count() == 3 })
	addPartitions(t, cl, "delay", 3)
	// Published before the bridge noticed the new partitions.
	produceN(t, producer(t, c), "delay", 3, 0, 9)
	waitFor(t, "all", func() bool { return h.count() >= 12 })
	waitFor(t, "commits", func() bool {
		cm := committed(c, "g", "delay")
		return cm[0] == 6 && cm[1] == 3 && cm[2] == 3
	})
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	got := h.offsets("delay")
	for p, want := range map[int32][]int64{0: {0, 1, 2, 3, 4, 5}, 1: {0, 1, 2}, 2: {0, 1, 2}} {
		if !slices.Equal(got[p], want) {
			t.Errorf("partition %d handled %v, want %v", p, got[p], want)
		}
	}
}

// One delay topic deleted while the bridge runs: Health must say the topic
// is missing, the member must not spin through generations, and the other
// topic is read meanwhile; once the topic is back, every topic is read
// again, the new log from its start.
func TestSourceTopicDeletedWhileRunning(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay", "other"))
	cl := producer(t, c)
	produceN(t, cl, "delay", 1, 0, 2)
	produceN(t, cl, "other", 1, 0, 2)
	h := newMemHandler()
	s, err := NewSource(testConfig(t, c.ListenAddrs(), "g", "delay", "other"))
	if err != nil {
		t.Fatal(err)
	}
	stop := runSource(t, s, h)
	waitFor(t, "both", func() bool { return h.count() == 4 })
	epoch0 := c.GroupInfo("g").Epoch
	if err := c.DeleteTopic("delay"); err != nil {
		t.Fatal(err)
	}
	// The partition watcher looks every 5 s; the source then reports the
	// missing topic.
	spins := func() int32 {
		if gi := c.GroupInfo("g"); gi != nil {
			return gi.Epoch - epoch0
		}
		return 0
	}
	waitFor(t, "health naming the missing topic, or a spinning member", func() bool {
		return errors.Is(s.Health(), ErrTopicMissing) || spins() > 100
	})
	if n := spins(); n > 100 {
		t.Fatalf("%d generations since the topic was deleted: the member spins through empty generations; Health = %v", n, s.Health())
	}
	produceN(t, cl, "other", 1, 2, 3)
	// The topic that still exists is read while the other is missing.
	waitFor(t, "other read while delay is missing", func() bool { return len(h.offsets("other")[0]) == 5 })
	if err := s.Health(); !errors.Is(err, ErrTopicMissing) {
		t.Fatalf("Health while delay is missing = %v, want ErrTopicMissing", err)
	}
	if err := c.CreateTopic("delay", 1, nil); err != nil {
		t.Fatal(err)
	}
	produceN(t, producer(t, c), "delay", 1, 10, 2)
	waitFor(t, "all", func() bool { return h.count() >= 9 })
	waitFor(t, "healthy", func() bool { return s.Health() == nil })
	_ = stop()
	if got := h.offsets("other")[0]; !slices.Equal(got, []int64{0, 1, 2, 3, 4}) {
		t.Errorf("other handled %v, want [0 1 2 3 4]", got)
	}
	if got := h.offsets("delay")[0]; !slices.Equal(got, []int64{0, 1, 0, 1}) {
		t.Errorf("delay handled %v, want [0 1 0 1] (old log, then the new one)", got)
	}
}

// A batch made durable while a rebalance ends the generation (the store
// commit was in flight): after the re-assignment the worker resumes at the
// stored checkpoint + 1, so nothing is ingested twice and nothing skipped.
func TestSourceStoredDuringRebalanceResumesAfterCheckpoint(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	cl := producer(t, c)
	produceN(t, cl, "delay", 1, 0, 5)
	h := newMemHandler()
	var first sync.Once
	blocked := make(chan struct{})
	h.setFail(func(ctx context.Context, b *bridge.Batch) error {
		block := false
		first.Do(func() { block = true })
		if block {
			close(blocked)
			<-ctx.Done() // the generation ended under the store commit
		}
		return nil // the commit was durable anyway
	})
	s, err := NewSource(testConfig(t, c.ListenAddrs(), "g", "delay"))
	if err != nil {
		t.Fatal(err)
	}
	stop := runSource(t, s, h)
	<-blocked
	addPartitions(t, cl, "delay", 2) // the partition watcher ends the generation
	waitFor(t, "first batch", func() bool { return h.count() >= 5 })
	produceN(t, producer(t, c), "delay", 1, 5, 5)
	waitFor(t, "all", func() bool { return h.count() >= 10 })
	waitFor(t, "commit", func() bool { return committed(c, "g", "delay")[0] == 10 })
	_ = stop()
	if got := h.offsets("delay")[0]; !slices.Equal(got, []int64{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}) {
		t.Errorf("handled %v, want 0..9 once each", got)
	}
}

// A committed offset out of range with no stored checkpoint: below the log
// start it resets to the start; past the end, to the start too (never the
// end, which would skip the log).
func TestSourceCommittedOutOfRange(t *testing.T) {
	for _, tc := range []struct {
		name      string
		deleteTo  int64
		commitTo  int64
		wantFirst int64
	}{
		{"below start", 5, 2, 5},
		{"past end", 0, 100, 0},
		{"at end", 0, 10, 10},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, kfake.SeedTopics(1, "delay"))
			cl := producer(t, c)
			produceN(t, cl, "delay", 1, 0, 10)
			if tc.deleteTo > 0 {
				if err := c.DeleteRecords("delay", 0, tc.deleteTo); err != nil {
					t.Fatal(err)
				}
			}
			commitOffset(t, c, "g", "delay", 0, tc.commitTo)
			h := newMemHandler()
			s, err := NewSource(testConfig(t, c.ListenAddrs(), "g", "delay"))
			if err != nil {
				t.Fatal(err)
			}
			stop := runSource(t, s, h)
			produceN(t, cl, "delay", 1, 10, 2)
			want := int(12 - tc.wantFirst)
			waitFor(t, "messages", func() bool { return h.count() >= want })
			waitFor(t, "commit 12", func() bool { return committed(c, "g", "delay")[0] == 12 })
			_ = stop()
			offs := h.offsets("delay")[0]
			if len(offs) != want || offs[0] != tc.wantFirst {
				t.Fatalf("offsets %v, want %d..11", offs, tc.wantFirst)
			}
		})
	}
}

// Each delay topic's messages carry that topic's rules: its DLQ and its
// default target.
func TestSourceRulesPerTopic(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(2, "a", "b", "c"))
	cfg := testConfig(t, c.ListenAddrs(), "g")
	cfg.Sources = []SourceConfig{
		{Topic: "a", Rules: &codec.Rules{DLQ: "a.dlq", DefaultTarget: "out-a"}},
		{Topic: "b", Rules: &codec.Rules{DLQ: "b.dlq"}},
		{Topic: "c", Rules: &codec.Rules{DLQ: "c.dlq", DefaultTarget: "out-c"}},
	}
	cl := producer(t, c)
	for _, tp := range []string{"a", "b", "c"} {
		for p := int32(0); p < 2; p++ {
			produce(t, cl, &kgo.Record{Topic: tp, Partition: p, Value: []byte(tp),
				Headers: []kgo.RecordHeader{{Key: "delay-after", Value: []byte("1m")}}})
		}
	}
	h := newMemHandler()
	s, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop := runSource(t, s, h)
	waitFor(t, "six", func() bool { return h.count() == 6 })
	_ = stop()
	h.mu.Lock()
	defer h.mu.Unlock()
	for i, m := range h.msgs {
		task := codec.Parse(&m, h.rules[i])
		switch m.Source {
		case "a", "c":
			if task.Kind != codec.KindSchedule || task.Target != "out-"+m.Source {
				t.Errorf("%s: %v target %q code %s", m.Source, task.Kind, task.Target, task.Code)
			}
		case "b":
			if task.Kind != codec.KindDeadLetter || task.Target != "b.dlq" || task.Code != codec.CodeMissingTarget {
				t.Errorf("b: %v target %q code %s", task.Kind, task.Target, task.Code)
			}
		}
	}
}

// On a broker with auto.create.topics.enable (Apache Kafka's default), the
// source must not create a missing delay topic by reading its metadata: it
// must report it missing and wait, as it does elsewhere.
func TestCheckDoesNotAutoCreateTopics(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"), kfake.AllowAutoTopicCreation())
	src, err := NewSource(testConfig(t, c.ListenAddrs(), "g", "delay", "typo"))
	if err != nil {
		t.Fatal(err)
	}
	err = src.Check(context.Background())
	if ti := c.TopicInfo("typo"); ti != nil {
		t.Errorf("Check created the missing source topic %q (%d partitions); Check = %v", "typo", len(c.PartitionInfos("typo")), err)
	}
	if !errors.Is(err, ErrTopicMissing) {
		t.Errorf("Check = %v, want ErrTopicMissing", err)
	}
}

// A source topic the user may not describe: Check says ErrAuth, as before.
func TestCheckTopicNotAuthorized(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay", "secret"), kfake.EnableSASL(), kfake.EnableACLs(),
		kfake.Superuser("PLAIN", "admin", "admin"),
		kfake.User("PLAIN", "reader", "pw",
			kfake.ACL{Resource: kmsg.ACLResourceTypeTopic, Name: "delay", Pattern: kmsg.ACLResourcePatternTypeLiteral, Operation: kmsg.ACLOperationAll, Allow: true},
			kfake.ACL{Resource: kmsg.ACLResourceTypeGroup, Name: "g", Pattern: kmsg.ACLResourcePatternTypeLiteral, Operation: kmsg.ACLOperationAll, Allow: true},
		))
	mech, err := SASLMechanism("PLAIN", "reader", "pw")
	if err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay", "secret")
	cfg.SASL = mech
	src, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	err = src.Check(context.Background())
	t.Logf("Check = %v", err)
	if !errors.Is(err, ErrAuth) {
		t.Errorf("Check = %v, want ErrAuth", err)
	}
}

// Topics led by other brokers than the one Check asks still exist.
func TestCheckMultiBroker(t *testing.T) {
	c := newCluster(t, kfake.NumBrokers(3), kfake.SeedTopics(1, "t0", "t1", "t2", "t3", "t4", "t5"))
	leaders := map[int32]bool{}
	for _, tp := range []string{"t0", "t1", "t2", "t3", "t4", "t5"} {
		leaders[c.LeaderFor(tp, 0)] = true
	}
	src, err := NewSource(testConfig(t, c.ListenAddrs(), "g", "t0", "t1", "t2", "t3", "t4", "t5"))
	if err != nil {
		t.Fatal(err)
	}
	if err := src.Check(context.Background()); err != nil {
		t.Fatalf("Check = %v (leaders %v)", err, leaders)
	}
	t.Logf("leaders %v", leaders)
}

// New partitions with a transport metadata cache that outlives the
// rebalance: the worker of a new partition must still read it.
func TestSourcePartitionsAddedLongMetadataTTL(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	cl := producer(t, c)
	produceN(t, cl, "delay", 1, 0, 3)
	h := newMemHandler()
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
	cfg.MetadataTTL = time.Hour
	s, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop := runSource(t, s, h)
	waitFor(t, "p0", func() bool { return h.count() == 3 })
	addPartitions(t, cl, "delay", 2)
	produceN(t, producer(t, c), "delay", 2, 1, 1) // partition 1
	waitFor(t, "p1", func() bool { return h.count() >= 4 })
	_ = stop()
}

// TestCheckConnectionLostIsUnreachable: a broker that answers the metadata
// read but drops the connection while the check asks about a topic is an
// unreachable broker (retried), not an error that ends the process.
func TestCheckConnectionLostIsUnreachable(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	c.ControlKey(int16(kmsg.ListOffsets), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		return nil, errors.New("test: connection dropped"), true
	})
	src, err := NewSource(testConfig(t, c.ListenAddrs(), "g", "delay"))
	if err != nil {
		t.Fatal(err)
	}
	if err := src.Check(context.Background()); !errors.Is(err, ErrUnreachable) {
		t.Fatalf("Check = %v, want ErrUnreachable", err)
	}
}

// TestCheckNextBrokerAfterConnectionLost: the first broker drops the
// connection while the check asks about a topic; the next one answers, so
// the check passes (it gave up at the first broker before).
func TestCheckNextBrokerAfterConnectionLost(t *testing.T) {
	c := newCluster(t, kfake.NumBrokers(2), kfake.SeedTopics(1, "delay"))
	c.ControlKey(int16(kmsg.ListOffsets), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if c.CurrentNode() == 0 {
			return nil, errors.New("test: connection dropped"), true
		}
		return nil, nil, false
	})
	src, err := NewSource(testConfig(t, c.ListenAddrs(), "g", "delay"))
	if err != nil {
		t.Fatal(err)
	}
	if err := src.Check(context.Background()); err != nil {
		t.Fatalf("Check = %v, want nil (the second broker answers)", err)
	}
}
