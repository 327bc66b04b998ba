package shard

import (
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// TestIngestWriteOrderDurable: what one Ingest batch leaves on disk,
// whatever order it writes its keys in (shard by shard, or sorted, as was
// tried): a task the batch stores and then replaces or cancels again is
// gone after a reopen, the last entry of an id wins, and tasks given in
// falling due order fire in due order. Checked after a reopen, so the
// store itself is read, not the wheels of the process that wrote it.
func TestIngestWriteOrderDurable(t *testing.T) {
	due := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	cases := []struct {
		name    string
		batches [][]codec.Task
		pending []string // ids pending after the reopen, with their due second
		dues    []int
		fires   []string // values delivered, in order
	}{
		{
			name:    "stored-then-replaced-same-due",
			batches: [][]codec.Task{{sched("x", due(5), 1), sched("x", due(5), 2)}},
			pending: []string{"x"}, dues: []int{5},
			fires: []string{"x#2"},
		},
		{
			name:    "stored-then-replaced-earlier-due",
			batches: [][]codec.Task{{sched("x", due(9), 1), sched("x", due(3), 2), sched("x", due(6), 3)}},
			pending: []string{"x"}, dues: []int{6},
			fires: []string{"x#3"},
		},
		{
			name:    "stored-then-cancelled",
			batches: [][]codec.Task{{sched("x", due(4), 1), sched("y", due(2), 2), cancelTask("x", 3)}},
			pending: []string{"y"}, dues: []int{2},
			fires: []string{"y#2"},
		},
		{
			name: "replaces-earlier-batch-across-shards",
			batches: [][]codec.Task{
				{sched("a", due(1), 1), sched("b", due(2), 2), sched("c", due(3), 3), sched("d", due(4), 4)},
				{sched("d", due(1), 5), sched("c", due(8), 6), cancelTask("b", 7), sched("a", due(7), 8), sched("a", due(2), 9)},
			},
			pending: []string{"a", "c", "d"}, dues: []int{2, 8, 1},
			fires: []string{"d#5", "a#9", "c#6"},
		},
		{
			name: "falling-due-order",
			batches: [][]codec.Task{{
				sched("t9", due(9), 1), sched("t8", due(8), 2), sched("t7", due(7), 3), sched("t6", due(6), 4),
				sched("t5", due(5), 5), sched("t4", due(4), 6), sched("t3", due(3), 7), sched("t2", due(2), 8),
			}},
			pending: []string{"t2", "t3", "t4", "t5", "t6", "t7", "t8", "t9"}, dues: []int{2, 3, 4, 5, 6, 7, 8, 9},
			fires: []string{"t2#8", "t3#7", "t4#6", "t5#5", "t6#4", "t7#3", "t8#2", "t9#1"},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			for _, b := range tc.batches {
				h.ingest(b)
			}
			h.reopen()
			if got := h.e.Stats().Pending; got != int64(len(tc.pending)) {
				t.Errorf("pending after reopen %d, want %d", got, len(tc.pending))
			}
			for i, id := range tc.pending {
				ti, err := h.e.Lookup("src", id)
				if err != nil {
					t.Fatalf("Lookup %s after reopen: %v", id, err)
				}
				if want := ms(due(tc.dues[i])); ti.Due.UnixMilli() != want {
					t.Errorf("%s due %v, want %v", id, ti.Due, due(tc.dues[i]))
				}
			}
			for _, id := range []string{"x", "y", "a", "b", "c", "d"} {
				if _, err := h.e.Lookup("src", id); err == nil && !slices.Contains(tc.pending, id) {
					t.Errorf("%s still pending after reopen", id)
				} else if err != nil && !errors.Is(err, ErrNotFound) {
					t.Fatalf("Lookup %s: %v", id, err)
				}
			}
			h.run()
			// Second by second: each delivery at its due second.
			var got []string
			for sec := 1; sec <= 10; sec++ {
				h.advance(time.Second)
				var now []string
				for _, d := range h.sink.all() {
					now = append(now, d.Value)
				}
				h.sink.reset()
				slices.Sort(now)
				got = append(got, now...)
			}
			if fmt.Sprint(got) != fmt.Sprint(tc.fires) {
				t.Errorf("delivered %v, want %v (by due second, names sorted within one)", got, tc.fires)
			}
		})
	}
}
