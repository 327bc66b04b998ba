package kafka

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"

	"github.com/delaybridge/delaybridge/bridge"
	"github.com/delaybridge/delaybridge/internal/testlog"
)

// produceBacklog writes perPart records of size bytes to each of parts
// partitions, in producer batches of at most 16 KiB.
func produceBacklog(t testing.TB, c *kfake.Cluster, topic string, parts int32, perPart, size int) {
	t.Helper()
	cl := producer(t, c, kgo.ProducerBatchMaxBytes(16<<10))
	value := make([]byte, size)
	for i := range value {
		value[i] = byte('a' + i%26)
	}
	rs := make([]*kgo.Record, 0, int(parts)*perPart)
	for i := range perPart {
		for p := range parts {
			rs = append(rs, &kgo.Record{Topic: topic, Partition: p, Key: fmt.Appendf(nil, "k%d-%d", p, i), Value: value})
		}
	}
	produce(t, cl, rs...)
}

// budgetIdle reports whether s's budget holds nothing and nobody waits.
// budgetSource is a Source of group "g" over topic "delay" of c that
// fetches fetch decoded bytes at most, within a fetch memory budget of
// budget bytes, in batches of at most maxBatch, logging from level up.
func budgetSource(t *testing.T, c *kfake.Cluster, level zapcore.Level, fetch int, budget int64, maxBatch int) *Source {
	t.Helper()
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
	cfg.Logger = testlog.New(t, zaptest.Level(level))
	cfg.FetchMaxBytes, cfg.FetchMemory, cfg.MaxBatch = fetch, budget, maxBatch
	s, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// partsStored reports whether h took n records of each partition from up to
// (not including) to of topic "delay".
func partsStored(h *memHandler, from, to int32, n int) bool {
	offs := h.offsets("delay")
	for p := from; p < to; p++ {
		if len(offs[p]) != n {
			return false
		}
	}
	return true
}

func budgetIdle(s *Source) bool {
	held, stuck, _ := s.mem.state()
	s.mem.mu.Lock()
	defer s.mem.mu.Unlock()
	return held == 0 && stuck == 0 && len(s.mem.waiters) == 0
}

// TestFetchMemoryBoundsManyPartitions: a backlog over 64 partitions taken
// in by a slow store, with a fetch memory budget of a few fetches. Every
// record is stored once, every partition committed to its end, and what
// the source held never passed the budget by more than one fetch (without
// the budget each partition holds up to three fetches: 64 x 3 x ~80 KiB).
func TestFetchMemoryBoundsManyPartitions(t *testing.T) {
	const (
		parts   = 64
		perPart = 100
		budget  = 256 << 10
		fetch   = 64 << 10 // decoded bytes a fetch aims at
	)
	c := newCluster(t, kfake.SeedTopics(parts, "delay"))
	produceBacklog(t, c, "delay", parts, perPart, 1000)
	h := newMemHandler()
	h.setFail(func(ctx context.Context, b *bridge.Batch) error {
		time.Sleep(time.Millisecond) // a store commit: the backlog piles up in the source
		return nil
	})
	s := budgetSource(t, c, zapcore.WarnLevel, fetch, budget, 32)
	stop := runSource(t, s, h)
	waitFor(t, "the backlog stored", func() bool { return h.count() >= parts*perPart })
	waitFor(t, "commits", func() bool {
		cm := committed(c, "g", "delay")
		for p := range int32(parts) {
			if cm[p] != perPart {
				return false
			}
		}
		return true
	})
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	want := map[int32]int64{}
	for p := range int32(parts) {
		want[p] = perPart
	}
	checkAllOnce(t, h, c, "delay", parts, want)
	_, _, peak := s.mem.state()
	// One fetch: 64 KiB decoded, with its Items, and a first batch (16 KiB)
	// past its limit.
	const oneFetch = 128 << 10
	t.Logf("peak held %d KiB (budget %d KiB), %v waits", peak>>10, budget>>10, waitsOf(s))
	if peak > budget+oneFetch {
		t.Errorf("the source held %d bytes at its peak, over the budget %d plus one fetch (%d)", peak, budget, oneFetch)
	}
	if waitsOf(s) == 0 {
		t.Error("no fetch waited for the budget: the test did not exercise it")
	}
	if !budgetIdle(s) {
		held, stuck, _ := s.mem.state()
		t.Errorf("after the source stopped: held %d stuck %d, want nothing", held, stuck)
	}
}

func waitsOf(s *Source) float64 {
	return testutil.ToFloat64(s.cfg.Metrics.SourceFetchMemoryWaits)
}

// TestFetchMemoryNoLeakOnRevokeAndStop: partitions that hold records and
// wait for the budget, some retrying a batch the store refuses, are revoked
// (a second member joins) and then stopped. Every record is stored by one
// member or the other, and both budgets end with nothing held, stuck or
// waiting: a leak would stall the source for good.
func TestFetchMemoryNoLeakOnRevokeAndStop(t *testing.T) {
	const (
		parts   = 32
		perPart = 60
	)
	c := newCluster(t, kfake.SeedTopics(parts, "delay"))
	produceBacklog(t, c, "delay", parts, perPart, 1000)
	var refusing atomic.Bool
	refusing.Store(true)
	slow := func(ctx context.Context, b *bridge.Batch) error {
		if refusing.Load() && b.Items[0].Msg.Partition%4 == 0 {
			return errors.New("store refuses") // retried: its partition stalls
		}
		time.Sleep(time.Millisecond)
		return nil
	}
	hA, hB := newMemHandler(), newMemHandler()
	hA.setFail(slow)
	hB.setFail(slow)
	mk := func() *Source {
		s := budgetSource(t, c, zapcore.ErrorLevel, 32<<10, 128<<10, 16)
		return s
	}
	a, b := mk(), mk()
	stopA := runSource(t, a, hA)
	waitFor(t, "A holding records, stalled partitions and waiters", func() bool {
		held, stuck, _ := a.mem.state()
		a.mem.mu.Lock()
		defer a.mem.mu.Unlock()
		return held > 0 && stuck > 0 && len(a.mem.waiters) > 0
	})
	stopB := runSource(t, b, hB) // a rebalance revokes A's partitions under it
	// B handles a batch: one of the refused partitions A held, whose
	// records A never stored (A may have stored all of the others by
	// now, so B may have nothing else to handle).
	waitFor(t, "both members hold partitions", func() bool {
		hB.mu.Lock()
		defer hB.mu.Unlock()
		return hB.attempts > 0
	})
	refusing.Store(false)
	stored := func() int {
		seen := map[string]bool{}
		for _, h := range []*memHandler{hA, hB} {
			for p, offs := range h.offsets("delay") {
				for _, o := range offs {
					seen[fmt.Sprint(p, "@", o)] = true
				}
			}
		}
		return len(seen)
	}
	waitFor(t, "every record stored", func() bool { return stored() == parts*perPart })
	// Stop A while B still runs (its partitions move again), then B.
	if err := stopA(); err != nil {
		t.Fatal(err)
	}
	if err := stopB(); err != nil {
		t.Fatal(err)
	}
	for name, s := range map[string]*Source{"A": a, "B": b} {
		if !budgetIdle(s) {
			held, stuck, _ := s.mem.state()
			t.Errorf("%s after it stopped: held %d stuck %d (or waiters left), want nothing", name, held, stuck)
		}
	}
}

// TestFetchMemoryStuckPartitionDoesNotStopOthers: a partition whose batch
// the store refuses (a dead-letter topic that cannot be written, CONTRACT
// §3) holds what it fetched for as long, here a record larger than the
// whole budget; the other partitions still take their records in (review
// R195: they stopped), and the stuck one, large record and all, once the
// store takes its batch.
func TestFetchMemoryStuckPartitionDoesNotStopOthers(t *testing.T) {
	const (
		parts   = 16
		perPart = 60
		budget  = 128 << 10
	)
	c := newCluster(t, kfake.SeedTopics(parts, "delay"))
	big := make([]byte, 2*budget)
	produce(t, producer(t, c), &kgo.Record{Topic: "delay", Partition: 0, Key: []byte("big"), Value: big})
	produceBacklog(t, c, "delay", parts, perPart, 1000)
	var refusing atomic.Bool
	refusing.Store(true)
	h := newMemHandler()
	h.setFail(func(ctx context.Context, b *bridge.Batch) error {
		if refusing.Load() && b.Items[0].Msg.Partition == 0 {
			return errors.New("dead-letter topic unwritable")
		}
		return nil
	})
	s := budgetSource(t, c, zapcore.ErrorLevel, 32<<10, budget, 64)
	stop := runSource(t, s, h)
	waitFor(t, "every other partition stored while partition 0 is stuck", func() bool { return partsStored(h, 1, parts, perPart) })
	refusing.Store(false)
	waitFor(t, "partition 0 stored", func() bool { return len(h.offsets("delay")[0]) == perPart+1 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	want := map[int32]int64{0: perPart + 1}
	for p := int32(1); p < parts; p++ {
		want[p] = perPart
	}
	checkAllOnce(t, h, c, "delay", parts, want)
	if !budgetIdle(s) {
		held, stuck, _ := s.mem.state()
		t.Errorf("after the source stopped: held %d stuck %d, want nothing", held, stuck)
	}
}

// A DLQ that cannot be written holds Handle in its wait for the batch's
// dead letters (bridge.Pipeline), with no error: the source moves the
// partition's records out of the budget when Handle says it waits
// (Batch.DeadLetterWait), so the other partitions go on however many wait
// so, here six holding a budget's worth each. Without the hook they stayed
// counted and every other partition waited for the DLQ (checked: times
// out), and so they did while what the waiting partitions fetched ahead
// after it stayed counted (checked: times out).
func TestFetchMemoryDeadLetterWaitDoesNotStopOthers(t *testing.T) {
	const (
		parts   = 16
		stuck   = 6
		perPart = 60
		budget  = 128 << 10
	)
	c := newCluster(t, kfake.SeedTopics(parts, "delay"))
	big := make([]byte, budget)
	for p := range int32(stuck) {
		produce(t, producer(t, c), &kgo.Record{Topic: "delay", Partition: p, Key: []byte("big"), Value: big})
	}
	produceBacklog(t, c, "delay", parts, perPart, 1000)
	dlqDown := make(chan struct{})
	h := newMemHandler()
	h.setFail(func(ctx context.Context, b *bridge.Batch) error {
		if b.Items[0].Msg.Partition >= stuck {
			return nil
		}
		if b.DeadLetterWait != nil {
			b.DeadLetterWait()
		}
		select { // as dls.Wait: until the DLQ takes the dead letters
		case <-dlqDown:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	})
	s := budgetSource(t, c, zapcore.ErrorLevel, 32<<10, budget, 64)
	stop := runSource(t, s, h)
	waitFor(t, "every other partition stored while six wait for their DLQ", func() bool { return partsStored(h, stuck, parts, perPart) })
	close(dlqDown)
	waitFor(t, "the waiting partitions stored", func() bool { return partsStored(h, 0, stuck, perPart+1) })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	want := map[int32]int64{}
	for p := range int32(parts) {
		want[p] = perPart
		if p < stuck {
			want[p] = perPart + 1
		}
	}
	checkAllOnce(t, h, c, "delay", parts, want)
	if !budgetIdle(s) {
		held, st, _ := s.mem.state()
		t.Errorf("after the source stopped: held %d stuck %d, want nothing", held, st)
	}
}
