package kafka

import (
	"context"
	"errors"
	"testing"

	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/delaybridge/delaybridge/bridge"
)

// CaughtUp closes only once every assigned partition's backlog is stored
// (here one partition's batches fail until released), and at once on
// partitions that hold nothing.
func TestSourceCaughtUp(t *testing.T) {
	for _, tc := range []struct {
		name    string
		backlog int
	}{
		{"backlog", 30},
		{"empty", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, kfake.SeedTopics(3, "delay"))
			if tc.backlog > 0 {
				produceN(t, producer(t, c), "delay", 3, 0, tc.backlog)
			}
			h := newMemHandler()
			held := errors.New("not yet")
			h.setFail(func(_ context.Context, b *bridge.Batch) error {
				if b.Items[0].Msg.Partition == 2 {
					return held
				}
				return nil
			})
			s, err := NewSource(testConfig(t, c.ListenAddrs(), "g", "delay"))
			if err != nil {
				t.Fatal(err)
			}
			stop := runSource(t, s, h)
			defer stop()
			if tc.backlog == 0 {
				waitFor(t, "caught up", func() bool { return closed(s.CaughtUp()) })
				return
			}
			waitFor(t, "partitions 0 and 1", func() bool { return h.count() == 20 })
			waitFor(t, "a refused batch of partition 2", func() bool {
				h.mu.Lock()
				defer h.mu.Unlock()
				return h.attempts > 3
			})
			if closed(s.CaughtUp()) {
				t.Fatal("caught up while partition 2's backlog is not stored")
			}
			h.setFail(nil)
			waitFor(t, "caught up", func() bool { return closed(s.CaughtUp()) })
			if n := h.count(); n != tc.backlog {
				t.Fatalf("caught up with %d of %d stored", n, tc.backlog)
			}
		})
	}
}

func closed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}
