package kafka

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/delaybridge/delaybridge/shard"
)

// failingLoader fails LoadCheckpoint while fail is set.
type failingLoader struct {
	*memHandler
	fail atomic.Bool
}

func (f *failingLoader) LoadCheckpoint(key string) (shard.Checkpoint, bool, error) {
	if f.fail.Load() {
		return shard.Checkpoint{}, false, errors.New("test: store read failed")
	}
	return f.memHandler.LoadCheckpoint(key)
}

// A partition worker that leaves while its start position is failing
// (generation over, or the group left because a missing topic appeared)
// must not leave its per-partition Health error behind: the partition is
// another member's now, and nothing of this member clears the key.
func TestSourceHealthClearedWhenPartitionMoves(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(2, "delay"))
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
	hA := &failingLoader{memHandler: newMemHandler()}
	hA.fail.Store(true)
	sA, _ := NewSource(cfg)
	runSource(t, sA, hA)
	waitFor(t, "A unhealthy on both partitions", func() bool {
		err := sA.Health()
		return err != nil && len(sA.healthKeys()) == 2
	})
	sB, _ := NewSource(cfg)
	runSource(t, sB, newMemHandler())
	waitFor(t, "both members assigned", func() bool {
		gi := c.GroupInfo("g")
		if gi == nil || gi.State != "Stable" || len(gi.Members) != 2 {
			return false
		}
		return gi.Members[0].NumAssigned() > 0 && gi.Members[1].NumAssigned() > 0
	})
	hA.fail.Store(false) // the store recovers
	deadline := time.Now().Add(10 * time.Second)
	for sA.Health() != nil {
		if time.Now().After(deadline) {
			t.Fatalf("A's Health 10 s after its store recovered: %v (keys %v)", sA.Health(), sA.healthKeys())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (s *Source) healthKeys() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var ks []string
	for k := range s.health {
		ks = append(ks, k)
	}
	return ks
}
