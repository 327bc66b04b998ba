package kafka

import (
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap/zapcore"
)

// TestFetchMemoryIdlePollsDoNotHoldBackABusyPartition (review R220): 128
// caught-up partitions long-poll while one takes in a burst of 3 000
// records, on a budget of 1 MiB (the least kafka.fetch_memory_mb allows).
// Each idle poll reserved 16 KiB of the budget for up to MaxWait, 128 of
// them all of it beside the half they may take for full fetches, and the
// busy partition's every fetch waited behind them: 3 917 waits, 12 s for
// the burst (20-30 ms with a budget of 64 MiB). Idle polls beyond half the
// budget now run outside it (fetchMem.poll): they never wait, and only
// the busy partition may, at most once a fetch.
func TestFetchMemoryIdlePollsDoNotHoldBackABusyPartition(t *testing.T) {
	const (
		idle  = 128
		burst = 3000
	)
	c := newCluster(t, kfake.SeedTopics(idle+1, "delay"))
	h := newMemHandler()
	s := budgetSource(t, c, zapcore.WarnLevel, 64<<10, 1<<20, 64)
	var busyFetches atomic.Int64 // fetches that decoded records: the busy partition's
	s.testHookFetched = func(_, decoded int) {
		if decoded > 0 {
			busyFetches.Add(1)
		}
	}
	stop := runSource(t, s, h)
	select {
	case <-s.CaughtUp():
	case <-time.After(30 * time.Second):
		t.Fatal("the partitions did not all catch up")
	}
	waits0 := waitsOf(s)
	cl := producer(t, c, kgo.ProducerBatchMaxBytes(16<<10))
	value := make([]byte, 1000)
	rs := make([]*kgo.Record, 0, burst)
	for i := range burst {
		rs = append(rs, &kgo.Record{Topic: "delay", Partition: 0, Key: fmt.Appendf(nil, "k%d", i), Value: value})
	}
	began := time.Now()
	produce(t, cl, rs...)
	waitFor(t, "the burst stored", func() bool { return h.count() >= burst })
	waits, fetches := waitsOf(s)-waits0, busyFetches.Load()
	t.Logf("burst stored in %v: %v waits, %d fetches with records", time.Since(began), waits, fetches)
	if waits > float64(fetches) {
		t.Errorf("%v fetches waited for the budget during the burst, more than the busy partition's %d fetches: idle long polls waited, or held it back", waits, fetches)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if !budgetIdle(s) {
		held, stuck, _ := s.mem.state()
		t.Errorf("after the source stopped: held %d (polls included) stuck %d, want nothing", held, stuck)
	}
}
