package kafka

import (
	"context"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/delaybridge/delaybridge/codec"
)

// A partition leader moving to another broker interrupts neither the
// source nor the sink. The metadata TTL is an hour: kafka-go alone would
// keep asking the old leader until it expires.
func TestLeaderMove(t *testing.T) {
	c := newCluster(t, kfake.NumBrokers(3), kfake.SeedTopics(1, "delay", "out"))
	cl := producer(t, c)
	h := newMemHandler()
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
	cfg.MetadataTTL = time.Hour
	s, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop := runSource(t, s, h)
	sink, err := NewSink(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer sink.Close()
	produceN(t, cl, "delay", 1, 0, 5)
	waitFor(t, "5", func() bool { return h.count() == 5 })
	if errs := sink.Deliver(context.Background(), []*codec.Task{task("out", "k", "before")}); errs != nil {
		t.Fatal(errs)
	}

	for _, topic := range []string{"delay", "out"} {
		leader := c.LeaderFor(topic, 0)
		if err := c.MoveTopicPartition(topic, 0, (leader+1)%3); err != nil {
			t.Fatal(err)
		}
	}
	produceN(t, cl, "delay", 1, 5, 5)
	waitFor(t, "the records written after the move", func() bool { return h.count() == 10 })
	// One Deliver: the sink refreshes its metadata and retries by itself.
	if errs := sink.Deliver(context.Background(), []*codec.Task{task("out", "k", "after")}); errs != nil {
		t.Fatalf("first Deliver after the move: %v", errs)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}

// The group coordinator moving to another broker ends the generation; the
// source rejoins and goes on without losing or re-storing a message.
func TestCoordinatorMove(t *testing.T) {
	c := newCluster(t, kfake.NumBrokers(3), kfake.SeedTopics(2, "delay"))
	cl := producer(t, c)
	h := newMemHandler()
	s, err := NewSource(testConfig(t, c.ListenAddrs(), "g", "delay"))
	if err != nil {
		t.Fatal(err)
	}
	stop := runSource(t, s, h)
	produceN(t, cl, "delay", 2, 0, 10)
	waitFor(t, "commit 5+5", func() bool {
		cm := committed(c, "g", "delay")
		return cm[0] == 5 && cm[1] == 5
	})
	before := c.CoordinatorFor("g")
	for c.CoordinatorFor("g") == before {
		c.RehashCoordinators()
	}
	produceN(t, cl, "delay", 2, 10, 10)
	waitFor(t, "commit 10+10", func() bool {
		cm := committed(c, "g", "delay")
		return cm[0] == 10 && cm[1] == 10
	})
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	for p, offs := range h.offsets("delay") {
		for i, o := range offs {
			if o != int64(i) {
				t.Fatalf("partition %d: offsets %v: want 0..9 once each", p, offs)
			}
		}
	}
}
