package shard

import (
	"slices"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"

	"github.com/delaybridge/delaybridge/codec"
)

// TestClaimReadSettle drives one fire round by hand: entries are claimed
// under the shard lock, their envelopes read without it, and what will not
// be delivered is settled. A key deleted between claim and read (a replace
// or cancel applied meanwhile) and a corrupt envelope are dropped and leave
// the in-flight set; nothing else is touched.
func TestClaimReadSettle(t *testing.T) {
	cases := []struct {
		name      string
		damage    func(t *testing.T, h *harness, key []byte) // applied to b's t key after the claim
		wantItems []string
		wantDrop  int
	}{
		{"all-readable", func(*testing.T, *harness, []byte) {}, []string{"a", "b", "c"}, 0},
		{"deleted-after-claim", func(t *testing.T, h *harness, key []byte) {
			if err := h.e.db.Delete(key, pebble.Sync); err != nil {
				t.Fatal(err)
			}
		}, []string{"a", "c"}, 1},
		{"corrupt-envelope", func(t *testing.T, h *harness, key []byte) {
			if err := h.e.db.Set(key, []byte("not an envelope"), pebble.Sync); err != nil {
				t.Fatal(err)
			}
		}, []string{"a", "c"}, 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, func(o *Options) { o.Shards = 1 })
			due := t0.Add(time.Second)
			h.ingest([]codec.Task{sched("a", due, 1), sched("b", due, 2), sched("c", due, 3)})
			h.clk.Set(due)
			s := h.e.shards[0]
			claimed := claimDue(t, s, due, 3)
			tc.damage(t, h, appendTaskKey(nil, 0, claimed[1].fire, claimed[1].seq))

			items, dropped, retry, err := s.readClaimed(claimed, len(claimed))
			if err != nil || len(retry) != 0 {
				t.Fatalf("readClaimed: err %v, %d to retry", err, len(retry))
			}
			var ids []string
			for _, it := range items {
				ids = append(ids, it.task.ID)
			}
			if !slices.Equal(ids, tc.wantItems) || len(dropped) != tc.wantDrop {
				t.Fatalf("read %v and dropped %d, want %v and %d", ids, len(dropped), tc.wantItems, tc.wantDrop)
			}
			s.settleClaimed(dropped, retry)
			s.mu.Lock()
			defer s.mu.Unlock()
			if len(s.inflight) != len(items) {
				t.Fatalf("%d in flight after settling, want the %d to deliver", len(s.inflight), len(items))
			}
			for _, it := range items {
				if _, ok := s.inflight[it.seq]; !ok {
					t.Fatalf("%s not in flight", it.task.ID)
				}
			}
			if s.w.Len() != 0 {
				t.Fatalf("wheel holds %d entries, want 0", s.w.Len())
			}
		})
	}
}

// TestSettleRetryReturnsToWheel: an entry whose read failed leaves the
// in-flight set and is back in the wheel, due as before.
func TestSettleRetryReturnsToWheel(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.Shards = 1 })
	due := t0.Add(time.Second)
	h.ingest([]codec.Task{sched("a", due, 1)})
	s := h.e.shards[0]
	claimed := claimDue(t, s, due, 1)
	s.settleClaimed(nil, claimed)
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.inflight) != 0 {
		t.Fatalf("%d in flight after a failed read, want 0", len(s.inflight))
	}
	if next, ok := s.w.Next(); !ok || next != ms(due) {
		t.Fatalf("wheel next = %d, %v; want %d", next, ok, ms(due))
	}
}

// claimDue drains s and claims what is due at due, as the fire loop does;
// it fails the test unless want entries were claimed.
func claimDue(t *testing.T, s *shard, due time.Time, want int) []fireItem {
	t.Helper()
	s.mu.Lock()
	s.drainLocked()
	claimed := s.claimLocked(ms(due))
	s.mu.Unlock()
	if len(claimed) != want {
		t.Fatalf("claimed %d entries, want %d", len(claimed), want)
	}
	return claimed
}
