package shard

import (
	"errors"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// TestStuckEntriesBoundedByLimit: with 20 000 failing dead letters, a
// listing of one entry must not copy and sort all 20 000 under the shard
// locks: what it allocates is bounded by the limit, not by how many are
// stuck (publish-failed dead letters pile up by the million while a
// target and its DLQ both refuse the bridge, and /v1/stuck is polled in a
// loop during such an incident). Before, each call allocated about 5 MB
// here (53 MB and 13 ms of each shard's lock with 200 000; hunt H195).
func TestStuckEntriesBoundedByLimit(t *testing.T) {
	const n = 20_000
	h := newHarness(t, func(o *Options) {
		o.Retry = RetryPolicy{Initial: time.Hour, Max: time.Hour, Multiplier: 2, Jitter: -1, MaxAttempts: 3}
	})
	h.sink.setFail(func(*codec.Task) error { return errors.New("kafka: publish to \"dlq\": TOPIC_AUTHORIZATION_FAILED") })
	h.run()
	for i := 0; i < n; i += 1000 {
		var dls []codec.Task
		for j := i; j < i+1000; j++ {
			dls = append(dls, deadLetter(fmt.Sprintf("dl%d", j), int64(j+1)))
		}
		h.ingest(dls)
	}
	h.advanceUntil("every dead letter failing", func() bool {
		l, err := h.e.StuckEntries(1)
		return err == nil && l.Total == n
	})
	h.sink.reset()

	// The listing is still right: the first entries in (shard, fire,
	// seq) order, the total of all.
	all, err := h.e.StuckEntries(MaxStuckLimit)
	if err != nil {
		t.Fatal(err)
	}
	if all.Total != n || len(all.Entries) != MaxStuckLimit {
		t.Fatalf("total %d, %d listed; want %d, %d", all.Total, len(all.Entries), n, MaxStuckLimit)
	}
	for i := 1; i < len(all.Entries); i++ {
		a, b := all.Entries[i-1], all.Entries[i]
		if a.Shard > b.Shard || a.Shard == b.Shard && (a.NextFire.After(b.NextFire.Time) || a.NextFire.Equal(b.NextFire.Time) && a.Seq >= b.Seq) {
			t.Fatalf("entries %d and %d out of order: %+v, %+v", i-1, i, a, b)
		}
	}
	one, err := h.e.StuckEntries(1)
	if err != nil {
		t.Fatal(err)
	}
	if one.Total != n || len(one.Entries) != 1 || one.Entries[0].Seq != all.Entries[0].Seq {
		t.Fatalf("limit 1: %+v (total %d), want the first of the full listing, %d", one.Entries, one.Total, all.Entries[0].Seq)
	}

	const calls = 5
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for range calls {
		if _, err := h.e.StuckEntries(1); err != nil {
			t.Fatal(err)
		}
	}
	runtime.ReadMemStats(&after)
	if per := (after.TotalAlloc - before.TotalAlloc) / calls; per > 256<<10 {
		t.Fatalf("StuckEntries(1) with %d stuck allocated %d bytes a call; want it bounded by the limit (under 256 KiB)", n, per)
	}
}
