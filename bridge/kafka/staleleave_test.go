package kafka

import (
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// TestRejoinAfterOutageNotHeldBySession: a broker outage shorter than the
// session timeout ends the bridge's generation, and kafka-go, failing to
// leave the group meanwhile, drops its member id and joins again as a new
// member. The coordinator then waits for the old member, the bridge's own,
// until its session (or the rebalance timeout) runs out: nothing new was
// taken in for that long after every blip (hunt H163 measured 19 s after
// the broker was back, with the default 30 s). The source removes its old
// membership itself once the broker answers, so intake resumes at once.
// The timeouts here are 90 s and the wait 30 s: without the removal the
// message after the outage is not taken in within the wait.
func TestRejoinAfterOutageNotHeldBySession(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	var down atomic.Bool
	var leaves atomic.Int32
	c.Control(func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if down.Load() {
			return nil, errors.New("broker down"), true
		}
		if _, ok := req.(*kmsg.LeaveGroupRequest); ok {
			leaves.Add(1)
		}
		return nil, nil, false
	})
	cfg := testConfig(t, c.ListenAddrs(), "g-stale", "delay")
	cfg.SessionTimeout, cfg.RebalanceTimeout = 90*time.Second, 90*time.Second
	s, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h := newMemHandler()
	runSource(t, s, h)
	cl := producer(t, c)
	produce(t, cl, &kgo.Record{Topic: "delay", Partition: 0, Value: []byte("before")})
	waitFor(t, "the message before the outage", func() bool { return h.count() == 1 })

	down.Store(true)
	waitFor(t, "the join failing while the broker is down", func() bool {
		err := s.Health()
		return err != nil && strings.Contains(err.Error(), "join group")
	})
	down.Store(false)
	produce(t, cl, &kgo.Record{Topic: "delay", Partition: 0, Value: []byte("after")})
	waitFor(t, "the message after the outage", func() bool { return h.count() == 2 })
	if leaves.Load() == 0 {
		t.Fatal("no LeaveGroup after the outage")
	}
}
