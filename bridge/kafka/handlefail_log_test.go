package kafka

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

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
	s, logs := observedSource(t, c, "delay")
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

// TestHandleFailLogThrottledAcrossBatchSizes (hunt H204): the pipeline's
// error names the batch's size ("bridge: ingest batch of 7: ..."), so a
// throttle keyed by the error's text logged each distinct size of the
// partitions' held batches (up to 64 lines per 30 s, then the overflow
// line). The key is the error's shape now: one line for the source. Once
// the store takes the batches again, that is said once.
func TestHandleFailLogThrottledAcrossBatchSizes(t *testing.T) {
	const parts = 8
	c := newCluster(t, kfake.SeedTopics(parts, "delay"))
	pr := producer(t, c)
	var rs []*kgo.Record
	for p := range parts { // partition p holds p+1 records: a batch size each
		for i := range p + 1 {
			rs = append(rs, &kgo.Record{Topic: "delay", Partition: int32(p), Value: fmt.Appendf(nil, "v%d", i)})
		}
	}
	produce(t, pr, rs...)
	s, logs := observedSource(t, c, "delay")
	h := newMemHandler()
	var fails atomic.Int64
	var failing atomic.Bool
	failing.Store(true)
	errStore := errors.New("shard: store failed: ingest: no space left on device")
	sizes := map[int]bool{}
	var mu sync.Mutex
	h.setFail(func(_ context.Context, b *bridge.Batch) error {
		if !failing.Load() {
			return nil
		}
		fails.Add(1)
		mu.Lock()
		sizes[len(b.Items)] = true
		mu.Unlock()
		return fmt.Errorf("bridge: ingest batch of %d: %w", len(b.Items), errStore)
	})
	stop := runSource(t, s, h)
	defer func() { _ = stop() }()
	waitFor(t, "every partition failing, retried", func() bool { return fails.Load() >= 5*parts })
	mu.Lock()
	nSizes := len(sizes)
	mu.Unlock()
	if n := logs.FilterMessage("handle failed; retrying the same batch").Len(); n != 1 {
		t.Fatalf("%d \"handle failed\" lines over %d failed attempts with %d batch sizes, want 1 (then one per 30 s)", n, fails.Load(), nSizes)
	}
	failing.Store(false)
	waitFor(t, "the end logged", func() bool { return logs.FilterMessageSnippet("batches stored again").Len() > 0 })
	if n := logs.FilterMessageSnippet("batches stored again").Len(); n != 1 {
		t.Fatalf("the end of the failures logged %d times, want once", n)
	}
}
