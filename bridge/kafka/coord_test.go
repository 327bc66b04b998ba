package kafka

import (
	"testing"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// TestCommitCoordinatorNotAvailableKeepsIngesting: the offsets topic under
// its min.insync.replicas makes the coordinator answer OffsetCommit (and
// SyncGroup, which stores the assignment) COORDINATOR_NOT_AVAILABLE, while
// heartbeats go on and the generation stands. A failed commit loses
// nothing (the store checkpoint is where a restart resumes), so the
// source retries the commit and goes on taking messages in; before, it
// left the generation, could not join again and ingestion stopped (found
// by a Kafka fault hunt).
func TestCommitCoordinatorNotAvailableKeepsIngesting(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	cl := producer(t, c)
	h := newMemHandler()
	s, err := NewSource(testConfig(t, c.ListenAddrs(), "g", "delay"))
	if err != nil {
		t.Fatal(err)
	}
	stop := runSource(t, s, h)
	produceN(t, cl, "delay", 1, 0, 3)
	waitFor(t, "commit 3", func() bool { return committed(c, "g", "delay")[0] == 3 })

	commitF := c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.OffsetCommit}, Group: "g", Err: kerr.CoordinatorNotAvailable, Count: -1})
	syncF := c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.SyncGroup}, Group: "g", Err: kerr.CoordinatorNotAvailable, Count: -1})
	produceN(t, cl, "delay", 1, 3, 3)
	// A second commit attempt in the same generation: the first failure
	// did not end it (a member that left could not commit again, its
	// rejoin failing at SyncGroup).
	waitFor(t, "the commit retried", func() bool { return commitF.Hits() >= 2 })
	produceN(t, cl, "delay", 1, 6, 3)
	waitFor(t, "9 handled while commits fail", func() bool { return h.count() == 9 })
	if n := syncF.Hits(); n != 0 {
		t.Errorf("%d SyncGroup calls: the member rejoined", n)
	}
	commitF.Remove()
	syncF.Remove()
	waitFor(t, "commit 9 once commits work", func() bool { return committed(c, "g", "delay")[0] == 9 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}
