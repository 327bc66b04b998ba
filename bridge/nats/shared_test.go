package nats

import (
	"fmt"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestSharedConsumerWarned (review R171): two bridges on one consumer (two
// releases keeping the default nats.consumer), unsupported. Each sees gaps
// in the delivery sequences, the other's deliveries, long after its last
// reset: the operator is told. (Each also asks those back as lost, so some
// are taken in by both: README, "One bridge instance per consumer group".)
func TestSharedConsumerWarned(t *testing.T) {
	core, logs := observer.New(zap.WarnLevel)
	setForTest(t, &sharedGapAfter, 0) // gaps right after the start count too
	cfg, _, js, srcA := createdSource(t, func(c *Config) {
		c.AckWait = 2 * time.Minute
		c.BatchSize = 1
		c.Logger = zap.New(zapcore.NewTee(c.Logger.Core(), core))
	})
	srcB, err := NewSource(connect(t, cfg), cfg)
	if err != nil {
		t.Fatal(err)
	}
	a := &holdEach{recorder: newRecorder(), hold: 50 * time.Millisecond}
	b := &holdEach{recorder: newRecorder(), hold: 50 * time.Millisecond}
	runSource(t, srcA, a)
	runSource(t, srcB, b)
	const n = 60
	for i := range n {
		publish(t, js, "delay.x", fmt.Sprint(i), nil)
		time.Sleep(5 * time.Millisecond) // pacing: both sources pulling
	}
	seen := func() (taken map[int64]int, both int) {
		taken = map[int64]int{}
		for _, q := range a.seqs() {
			taken[q] |= 1
		}
		for _, q := range b.seqs() {
			taken[q] |= 2
		}
		for _, v := range taken {
			if v == 3 {
				both++
			}
		}
		return taken, both
	}
	eventually(t, fmt.Sprintf("all %d taken in", n), func() bool { m, _ := seen(); return len(m) >= n })
	eventually(t, "all acked", func() bool {
		ci := consumerInfo(t, js, cfg.Stream, cfg.Consumer)
		return ci.NumAckPending == 0 && ci.NumPending == 0
	})
	_, both := seen()
	t.Logf("A took %d, B %d, both %d", a.itemCount(), b.itemCount(), both)
	if a.itemCount() == 0 || b.itemCount() == 0 {
		t.Skip("one source took every message: no sharing to observe this run")
	}
	if logs.FilterMessageSnippet("went to another client").Len() == 0 {
		t.Error("no warning about another client taking the consumer's deliveries")
	}
}

// TestSharedGapNotWarnedRedeliveryLostAtReconnect (review R173): one bridge. A batch is held in
// the handler past AckWait; the server's redelivery of it goes into a
// connection that is then lost. The gap it leaves in consumer sequences
// is seen only at the next delivery: on a quiet stream, more than
// sharedGapAfter after the reset (here 0, so any gap would count). One
// bridge: no warning about another client is expected.
func TestSharedGapNotWarnedRedeliveryLostAtReconnect(t *testing.T) {
	setForTest(t, &sharedGapAfter, 0) // any gap seen after the reset would count
	h := &blocker{recorder: newRecorder(), entered: make(chan struct{}), release: make(chan struct{})}
	cfg, nc, proxy, pub, logs := proxiedSource(t, false, func(c *Config) {
		c.AckWait = 2 * time.Second
		c.BatchSize = 1
	}, h)
	publish(t, pub, "delay.a", "held", delayHeader())
	<-h.entered
	eventually(t, "a pull waiting", func() bool {
		return consumerInfo(t, pub, cfg.Stream, cfg.Consumer).NumWaiting > 0
	})
	proxy.freeze()
	eventually(t, "redelivered into the frozen connection", func() bool {
		return consumerInfo(t, pub, cfg.Stream, cfg.Consumer).Delivered.Consumer >= 2
	})
	reconnects := nc.Stats().Reconnects
	proxy.cut()
	eventually(t, "reconnected", func() bool { return nc.Stats().Reconnects > reconnects && nc.IsConnected() })
	close(h.release)
	eventually(t, "acked", func() bool {
		ci := consumerInfo(t, pub, cfg.Stream, cfg.Consumer)
		return ci.NumAckPending == 0
	})
	publish(t, pub, "delay.a", "after", delayHeader())
	if !waitUntil(20*time.Second, func() bool { return h.itemCount() >= 2 }) {
		t.Fatalf("%d of 2 taken in: %v", h.itemCount(), h.seqs())
	}
	if n := logs.FilterMessageSnippet("another client").Len(); n > 0 {
		t.Errorf("%d warnings about another client, with one bridge", n)
	}
}
