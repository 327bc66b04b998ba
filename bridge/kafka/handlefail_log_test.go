package kafka

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/twmb/franz-go/pkg/kfake"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/bridge"
)

// TestHandleFailLogThrottled (hunt H151): a store that refuses writes
// fails every partition's batch at every retry. The line saying so is
// logged once per 30 s for the source, not per partition and retry (10
// lines a second with 100 partitions), and each failure still counts.
func TestHandleFailLogThrottled(t *testing.T) {
	const parts = 8
	c := newCluster(t, kfake.SeedTopics(parts, "delay"))
	produceN(t, producer(t, c), "delay", parts, 0, 4*parts)
	core, logs := observer.New(zap.InfoLevel)
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
	cfg.Logger = zap.New(core)
	s, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h := newMemHandler()
	var fails atomic.Int64
	errStore := errors.New("shard: store failed: ingest: no space left on device")
	h.setFail(func(context.Context, *bridge.Batch) error {
		fails.Add(1)
		return errStore
	})
	stop := runSource(t, s, h)
	waitFor(t, "every partition failing, retried", func() bool { return fails.Load() >= 5*parts })
	_ = stop()
	if n := logs.FilterMessage("handle failed; retrying the same batch").Len(); n != 1 {
		t.Fatalf("%d \"handle failed\" lines over %d failed attempts, want 1 (then one per 30 s)", n, fails.Load())
	}
}
