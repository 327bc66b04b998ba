package kafka

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// TestLeaderMoveSourceDropsPoolsOnce (review R212): a leader move (a
// broker restarted) fails the fetches of every partition it led at once,
// each on the stale metadata of the transport's one pool, and each
// partition's worker dropped the pools to reload it: with 4 partitions 4
// drops, each a pool of the whole cluster's metadata held until
// transportIdle and read again (F211 fixed the same in the sink only).
// The workers whose fetch began before a drop find the metadata reloaded
// by it: one drop. The fetches are held at the old leader until all 4
// are, the partitions moved meanwhile, so all 4 fail on the stale
// metadata.
func TestLeaderMoveSourceDropsPoolsOnce(t *testing.T) {
	const parts, old = 4, 0
	c := newCluster(t, kfake.NumBrokers(2), kfake.SeedTopics(parts, "delay"))
	for p := range int32(parts) {
		if err := c.MoveTopicPartition("delay", p, old); err != nil {
			t.Fatal(err)
		}
	}
	cl := producer(t, c)
	h := newMemHandler()
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
	cfg.MetadataTTL = time.Hour
	s, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	var once sync.Once
	unhold := func() { once.Do(func() { close(release) }) }
	t.Cleanup(unhold) // before the cluster closes (cleanups run last first)
	var armed atomic.Bool
	var held atomic.Int32
	c.ControlKey(int16(kmsg.Fetch), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if armed.Load() && c.CurrentNode() == old {
			if held.Add(1) == parts {
				// Every partition's fetch is here: move them all,
				// then let the fetches fail on it.
				for p := range int32(parts) {
					if err := c.MoveTopicPartition("delay", p, old+1); err != nil {
						t.Error(err)
					}
				}
				unhold()
			}
			c.SleepControl(func() { <-release })
		}
		return nil, nil, false
	})
	runSource(t, s, h)
	produceN(t, cl, "delay", parts, 0, parts)
	waitFor(t, "every partition read", func() bool { return h.count() == parts })
	armed.Store(true)
	waitFor(t, "the fetches held and let go", func() bool {
		select {
		case <-release:
			return true
		default:
			return false
		}
	})
	produceN(t, cl, "delay", parts, parts, parts)
	waitFor(t, "every partition read again from the new leader", func() bool { return h.count() == 2*parts })
	drops := s.pools.count()
	if drops != 1 {
		t.Fatalf("%d partitions failed by one leader move dropped the pools %d times, want once", parts, drops)
	}
}
