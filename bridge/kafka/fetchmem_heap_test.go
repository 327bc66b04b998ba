package kafka

import (
	"context"
	"os"
	"runtime"
	"runtime/metrics"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"

	"github.com/delaybridge/delaybridge/bridge"
	"github.com/delaybridge/delaybridge/internal/testlog"
)

// TestFetchMemoryHeapBacklog measures the Go heap while the source takes
// in a backlog over many partitions (hunt H193's test: 1 000 records of
// 1 KB on each of 256 partitions, a handler serialised at 3 ms a call),
// with the default budget or DELAYBRIDGE_FETCH_MEMORY_MB. It asserts
// nothing: it logs the peak heap in use and the peak live heap (as of the
// last GC) over the base with the backlog in the broker. Long form only.
//
//	DELAYBRIDGE_LONG=1 go test -run TestFetchMemoryHeapBacklog -v ./bridge/kafka
//
// DELAYBRIDGE_HEAP_PARTS sets the partitions (default 256).
func TestFetchMemoryHeapBacklog(t *testing.T) {
	if os.Getenv("DELAYBRIDGE_LONG") != "1" {
		t.Skip("long form only (DELAYBRIDGE_LONG=1): a backlog of 256 MB")
	}
	parts := int32(256)
	if v, err := strconv.Atoi(os.Getenv("DELAYBRIDGE_HEAP_PARTS")); err == nil && v > 0 {
		parts = int32(v)
	}
	const perPart = 1000
	c := newCluster(t, kfake.SeedTopics(parts, "delay"))
	produceBacklog(t, c, "delay", parts, perPart, 1000)
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
	cfg.Logger = testlog.New(t, zaptest.Level(zapcore.WarnLevel))
	if v, err := strconv.Atoi(os.Getenv("DELAYBRIDGE_FETCH_MEMORY_MB")); err == nil && v > 0 {
		cfg.FetchMemory = int64(v) << 20
	}
	h := &countingStore{commit: 3 * time.Millisecond}
	runtime.GC()
	runtime.GC()
	base := heapNow()
	s, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	var peak heapSample
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
				peak = peak.max(heapNow())
			}
		}
	})
	start := time.Now()
	stop := runSource(t, s, h)
	waitForLong(t, "the backlog stored", 10*time.Minute, func() bool { return h.stored.Load() >= int64(parts)*perPart })
	took := time.Since(start)
	close(done)
	wg.Wait()
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	_, _, held := s.mem.state()
	t.Logf("%d partitions, budget %d MiB: heap in use peak %d MB over base, live heap peak %d MB over base, budget peak %d MB, %v",
		parts, s.mem.limit>>20, (peak.inuse-base.inuse)/1e6, (peak.live-base.live)/1e6, held/1e6, took.Round(100*time.Millisecond))
}

// countingStore takes batches one at a time, commit long each, and keeps
// nothing but their count.
type countingStore struct {
	mu     sync.Mutex
	commit time.Duration
	stored atomic.Int64
}

func (c *countingStore) Handle(ctx context.Context, b *bridge.Batch) error {
	c.mu.Lock()
	time.Sleep(c.commit)
	c.mu.Unlock()
	c.stored.Add(int64(len(b.Items)))
	return nil
}

func (c *countingStore) Checkpoint(string) (int64, bool, error) { return 0, false, nil }

type heapSample struct{ inuse, live int64 }

func (a heapSample) max(b heapSample) heapSample {
	return heapSample{max(a.inuse, b.inuse), max(a.live, b.live)}
}

func heapNow() heapSample {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	sm := []metrics.Sample{{Name: "/gc/heap/live:bytes"}}
	metrics.Read(sm)
	return heapSample{int64(ms.HeapInuse), int64(sm[0].Value.Uint64())}
}

// waitForLong is waitFor with a deadline of its own.
func waitForLong(t testing.TB, what string, d time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
