package shard

import (
	"testing"

	"github.com/delaybridge/delaybridge/codec"
)

func TestOldestLate(t *testing.T) {
	type op struct {
		note bool
		seq  uint64
		due  int64
	}
	for _, tc := range []struct {
		name   string
		ops    []op
		want   int64
		wantOK bool
	}{
		{"empty", nil, 0, false},
		{"one", []op{{true, 1, 50}}, 50, true},
		{"smallest", []op{{true, 1, 50}, {true, 2, 20}, {true, 3, 70}}, 20, true},
		{"smallest cleared", []op{{true, 1, 50}, {true, 2, 20}, {true, 3, 70}, {false, 2, 0}}, 50, true},
		{"other cleared", []op{{true, 1, 50}, {true, 2, 20}, {false, 1, 0}}, 20, true},
		{"all cleared", []op{{true, 1, 50}, {false, 1, 0}}, 0, false},
		{"cleared then lower", []op{{true, 1, 50}, {true, 2, 60}, {false, 1, 0}, {true, 3, 55}}, 55, true},
		{"renoted keeps its due", []op{{true, 1, 50}, {true, 1, 50}, {true, 2, 80}}, 50, true},
		{"unknown cleared", []op{{true, 1, 50}, {false, 9, 0}}, 50, true},
		{"equal dues", []op{{true, 1, 50}, {true, 2, 50}, {false, 1, 0}}, 50, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var s shard
			for _, o := range tc.ops {
				if o.note {
					s.noteLateLocked(o.seq, o.due, o.due+1000, 0)
				} else {
					s.clearLateLocked(o.seq)
				}
			}
			got, ok := s.oldestLateLocked()
			if got != tc.want || ok != tc.wantOK {
				t.Fatalf("oldest = %d, %v; want %d, %v", got, ok, tc.want, tc.wantOK)
			}
		})
	}
}

// TestLateTaskPacking: a late task's due time and target group share one
// word; each reads back as it went in, at the ends of their ranges.
func TestLateTaskPacking(t *testing.T) {
	for _, tc := range []struct {
		name       string
		due, group int64
		wantDue    int64
	}{
		{"no group", 1234, 0, 1234},
		{"kafka group", ms(t0), heldGroup(1, "orders"), ms(t0)},
		{"nats group", ms(t0), heldGroup(2, "orders.created"), ms(t0)},
		{"highest group", codec.MaxDue, heldBase + (transportSlots-1)<<(heldDueBits+heldGroupBits) + (1<<heldGroupBits-1)<<heldDueBits, codec.MaxDue},
		{"lowest group", 0, heldBase, 0},
		{"due below range", -5, heldGroup(1, "x"), 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lt := lateTask{dg: packLate(tc.due, tc.group)}
			if lt.due() != tc.wantDue || lt.group() != tc.group {
				t.Fatalf("due %d, group %x; want %d, %x", lt.due(), lt.group(), tc.wantDue, tc.group)
			}
			if lt.dg < 0 {
				t.Fatalf("dg %x negative", lt.dg)
			}
		})
	}
}
