package kafka

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// TestSlowJoinLogged (hunt H153): after a kill -9 the group's coordinator
// holds every join until the dead member's session times out (30 s), and
// the restarted bridge, ready, took nothing in and logged nothing. A join
// that takes longer than joinWaitLog is logged, with the session timeout.
func TestSlowJoinLogged(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	release := make(chan struct{})
	c.ControlKey(int16(kmsg.JoinGroup), func(kmsg.Request) (kmsg.Response, error, bool) {
		<-release // the coordinator waiting for a dead member
		return nil, nil, false
	})
	var heartbeats atomic.Int64
	c.ControlKey(int16(kmsg.Heartbeat), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		heartbeats.Add(1)
		return nil, nil, false
	})
	s, logs := observedSource(t, c, "delay")
	s.joinWaitLog = 10 * time.Millisecond
	h := newMemHandler()
	stop := runSource(t, s, h)
	const msg = "waiting for the consumer group to assign partitions"
	waitFor(t, "the slow join logged", func() bool { return logs.FilterMessageSnippet(msg).Len() > 0 })
	close(release)
	produce(t, producer(t, c), &kgo.Record{Topic: "delay", Key: []byte("k"), Value: []byte("v")})
	waitFor(t, "the message taken in once joined", func() bool { return h.count() == 1 })
	// The generation lives on, far past joinWaitLog (heartbeats every
	// 100 ms): Next waiting for its end is not a join.
	hb := heartbeats.Load()
	waitFor(t, "five heartbeats of the generation", func() bool { return heartbeats.Load() >= hb+5 })
	_ = stop()
	if n := logs.FilterMessageSnippet(msg).Len(); n != 1 {
		t.Fatalf("%d %q lines, want 1 (one join waited)", n, msg)
	}
}
