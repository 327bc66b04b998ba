package nats

import (
	"slices"
	"testing"
)

// storeSim is the part of the store a floorState reads back at a restart,
// for a stream of incarnation inc.
type storeSim struct {
	floor int64
	slots heldSlotState
	inc   uint32
}

func (st *storeSim) restart() *floorState {
	f := &floorState{floor: st.floor}
	f.loadHeld(st.slots)
	f.keepIncarnation(st.inc)
	return f
}

// batch stores the deliveries seen since the last batch as the source
// does: the checkpoint, and the held slots that changed.
func (st *storeSim) batch(t *testing.T, f *floorState, high int64) {
	t.Helper()
	cp := f.checkpoint(high)
	spans := f.nextSpans(cp)
	cps, stored := f.heldCheckpoints("k", st.inc, spans)
	for _, c := range cps {
		if !c.Aside {
			t.Fatalf("held slot %s not kept aside: its batch's dead letters would be awaited under it", c.Key)
		}
		var i int
		for i = range heldSlots {
			if HeldKey("k", i) == c.Key {
				break
			}
		}
		st.slots.span[i], st.slots.inc[i] = span{lo: int64(c.Fingerprint), hi: c.Offset}, c.Incarnation
	}
	st.floor = cp
	f.handled(high, cp, spans, stored)
}

// TestFloorHeldAboveFloorAcrossCrash: a crash with unacked deliveries
// puts a barrier under which the floor stays; a message handled under it
// whose ack a second crash loses is redelivered above the stored floor,
// and must be skipped (its task may be delivered and deleted already).
func TestFloorHeldAboveFloorAcrossCrash(t *testing.T) {
	st := &storeSim{}
	// Run 1: 1 stored; 2 delivered to the buffer, never handled; crash
	// before the ack of 1.
	f := st.restart()
	f.start(0, 0, 0)
	f.see(1, 1, true)
	st.batch(t, f, 1)
	// Run 2: ack floor 0, delivered 2 (dseq 2): barrier. 3 stored, the
	// floor stays 1; crash before the ack of 3.
	f = st.restart()
	f.start(0, 2, 2)
	if f.see(3, 3, true) {
		t.Fatal("3 held before it was handled")
	}
	st.batch(t, f, 3)
	if st.floor != 1 {
		t.Fatalf("stored floor %d, want 1 (the barrier)", st.floor)
	}
	// Run 3: 1, 2, 3 come back.
	f = st.restart()
	f.start(0, 3, 3)
	for _, c := range []struct {
		dseq uint64
		seq  int64
		held bool
	}{{4, 1, true}, {5, 2, false}, {6, 3, true}} {
		if got := f.see(c.dseq, c.seq, false); got != c.held {
			t.Fatalf("redelivery of %d: held %v, want %v", c.seq, got, c.held)
		}
	}
	st.batch(t, f, 2)
	f.ackFloor(3, 3)
	if f.floor != 3 || len(f.spans) != 0 {
		t.Fatalf("after the ack floor passed: floor %d spans %v, want 3 and none", f.floor, f.spans)
	}
	// The next batch clears the stored slot.
	f.see(7, 4, true)
	st.batch(t, f, 4)
	if st.floor != 4 || st.slots.span != [heldSlots]span{} {
		t.Fatalf("stored floor %d slots %v, want 4 and empty", st.floor, st.slots.span)
	}
}

// TestFloorHeldLostAckInRun: no restart; a gap raises a barrier, the
// delivery after it is handled, its ack is lost on the way and it comes
// back after AckWait while the barrier still holds: skipped.
func TestFloorHeldLostAckInRun(t *testing.T) {
	st := &storeSim{}
	f := st.restart()
	f.start(0, 0, 0)
	f.see(1, 1, true)
	st.batch(t, f, 1)
	f.see(3, 3, true) // dseq 2 (seq 2) lost in transit
	st.batch(t, f, 3)
	if f.see(4, 2, false) {
		t.Fatal("2 held, never handled")
	}
	st.batch(t, f, 2)
	if !f.see(5, 3, false) {
		t.Fatal("3 handed over again after its ack was lost")
	}
}

// TestFloorHeldRuns: first deliveries with contiguous consumer sequences
// make one span whatever the stream sequences between them (other
// subjects); a gap starts another, leaving out what the missed delivery
// may have been.
func TestFloorHeldRuns(t *testing.T) {
	st := &storeSim{floor: 5}
	f := st.restart()
	f.start(0, 8, 8) // barrier 8
	f.see(9, 10, true)
	f.see(10, 14, true)
	f.see(11, 6, false)
	f.see(12, 20, true)
	st.batch(t, f, 20)
	f.see(14, 25, true) // dseq 13 missed: a first delivery of 21..24
	st.batch(t, f, 25)
	want := []span{{6, 6}, {10, 20}, {25, 25}}
	if !slices.Equal(f.spans, want) {
		t.Fatalf("spans %v, want %v", f.spans, want)
	}
	g := st.restart()
	for seq, held := range map[int64]bool{5: true, 6: true, 7: false, 10: true, 17: true, 20: true, 22: false, 25: true, 26: false} {
		if g.isHeld(seq) != held {
			t.Errorf("after restart, %d held %v, want %v", seq, !held, held)
		}
	}
}

// TestMergeSpansCap: more disjoint spans than slots keep the highest.
func TestMergeSpansCap(t *testing.T) {
	var in []span
	for i := int64(1); i <= heldSlots+4; i++ {
		in = append(in, span{10 * i, 10 * i})
	}
	out := mergeSpans(in, 0)
	if len(out) != heldSlots || out[0].lo != 50 || out[len(out)-1].hi != 10*(heldSlots+4) {
		t.Fatalf("got %v", out)
	}
	if got := mergeSpans([]span{{5, 7}, {1, 2}, {3, 4}, {9, 9}}, 1); !slices.Equal(got, []span{{1, 7}, {9, 9}}) {
		t.Fatalf("merge: %v", got)
	}
}

// TestFloorHeldOtherIncarnation: slots stored in another incarnation of
// the stream (left by a version that did not clear them when it found the
// stream restored from a backup) are not taken as held: their sequences
// may be new messages. The next write of such a slot replaces it.
func TestFloorHeldOtherIncarnation(t *testing.T) {
	st := &storeSim{}
	f := st.restart()
	f.start(0, 0, 0)
	f.see(1, 1, true)
	st.batch(t, f, 1)
	f = st.restart()
	f.start(0, 2, 2) // barrier: 2 delivered, not acked
	f.see(3, 3, true)
	st.batch(t, f, 3)
	if st.slots.span[0] != (span{3, 3}) || st.slots.inc[0] != 0 {
		t.Fatalf("slot 0 %v in incarnation %d, want [3, 3] in 0", st.slots.span[0], st.slots.inc[0])
	}

	st.inc = 1 // restored by an older version: floor lowered, slots kept
	f = st.restart()
	f.start(0, 3, 3)
	if f.see(4, 3, true) {
		t.Fatal("3 of the new incarnation held by a slot of the old one")
	}
	st.batch(t, f, 3)
	if st.slots.inc[0] != 1 {
		t.Fatalf("slot 0 still of incarnation %d after a write, want 1", st.slots.inc[0])
	}
}
