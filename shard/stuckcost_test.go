package shard

import (
	"testing"
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
	h := failingDeadLetters(t, n, 4, false)
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

	per := allocatedPerCall(5, func() {
		if _, err := h.e.StuckEntries(1); err != nil {
			t.Fatal(err)
		}
	})
	if per > 256<<10 {
		t.Fatalf("StuckEntries(1) with %d stuck allocated %d bytes a call; want it bounded by the limit (under 256 KiB)", n, per)
	}
}
