package kafka

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/delaybridge/delaybridge/codec"
)

// TestLeaderMoveDropsPoolsOnce (review F211): a leader move fails the
// publishes of every shard's lane at once, each on the stale metadata of
// the transport's one pool, and each lane dropped the pools to reload it:
// with 4 lanes 4 drops, each a pool whose metadata is held until
// transportIdle and read again (640 KB on 2 000 partitions when the sink
// read the whole cluster's, before scopedTransport). The
// lanes whose publish began before a drop find the metadata reloaded by
// it: one drop. Each lane publishes to a topic of its own (one produce
// request each), all led by the broker that loses them; the produce
// requests are held there until all 4 are, so all 4 fail on the stale
// metadata.
func TestLeaderMoveDropsPoolsOnce(t *testing.T) {
	const lanes, old = 4, 0
	topics := make([]string, lanes)
	for i := range topics {
		topics[i] = fmt.Sprint("out-", i)
	}
	c := newCluster(t, kfake.NumBrokers(2), kfake.SeedTopics(1, topics...))
	for _, tp := range topics {
		if err := c.MoveTopicPartition(tp, 0, old); err != nil {
			t.Fatal(err)
		}
	}
	cfg := testConfig(t, c.ListenAddrs(), "")
	cfg.MetadataTTL = time.Hour
	cfg.WriteAttempts = 1 // the stale failure comes back to Deliver at once
	sink, err := NewSink(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer sink.Close()
	var warm []*codec.Task
	for _, tp := range topics {
		warm = append(warm, task(tp, "k", "before"))
	}
	if errs := sink.Deliver(context.Background(), warm); errs != nil {
		t.Fatal(errs)
	}
	release := make(chan struct{})
	var once sync.Once
	unhold := func() { once.Do(func() { close(release) }) }
	t.Cleanup(unhold) // before the cluster closes (cleanups run last first)
	var held atomic.Int32
	c.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if c.CurrentNode() == old {
			if held.Add(1) == lanes {
				unhold()
			}
			c.SleepControl(func() { <-release })
		}
		return nil, nil, false
	})
	for _, tp := range topics {
		if err := c.MoveTopicPartition(tp, 0, old+1); err != nil {
			t.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	errc := make(chan error, lanes)
	for _, tp := range topics {
		wg.Go(func() {
			if errs := sink.Deliver(context.Background(), []*codec.Task{task(tp, "k", "after")}); errs != nil {
				errc <- errors.Join(errs...)
			}
		})
	}
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Errorf("a Deliver after the move: %v", err)
	}
	if n := held.Load(); n != lanes {
		t.Fatalf("%d produce requests at the old leader, want %d (each lane's, on the stale metadata)", n, lanes)
	}
	drops := sink.pools.count()
	if drops != 1 {
		t.Fatalf("%d lanes failed by one leader move dropped the pools %d times, want once", lanes, drops)
	}
}
