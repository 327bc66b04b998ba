package nats

import (
	"testing"
	"time"
)

// TestFloorState drives the checkpoint floor through delivery sequences.
// Steps: "start" a=ack floor, b=delivered stream seq, c=delivered
// consumer seq (iterator start from consumer info); "see" c=consumer seq,
// a=stream seq (a delivery; held = skipped); "batch" a=highest new stream
// seq (checkpoint, then handled); "ackfloor" a=server ack floor,
// b=delivered stream seq (consumer info). A "see" is a first delivery
// unless redelivery is set.
func TestFloorState(t *testing.T) {
	type step struct {
		op         string
		a, b       int64
		c          uint64
		redelivery bool  // for see
		wantHeld   bool  // for see
		wantCP     int64 // for batch; and the floor after every step
	}
	tests := []struct {
		name      string
		stored    int64
		steps     []step
		wantFloor int64
	}{
		{
			name: "fresh consumer, in order: floor follows",
			steps: []step{
				{op: "start", a: 0, b: 0, c: 0},
				{op: "see", c: 1, a: 1}, {op: "see", c: 2, a: 2},
				{op: "batch", a: 2, wantCP: 2},
				{op: "see", c: 3, a: 5}, // gap in stream seqs (other subjects): fine
				{op: "batch", a: 5, wantCP: 5},
			},
			wantFloor: 5,
		},
		{
			name:   "crash after store commit: redeliveries at or below the stored floor are held",
			stored: 3,
			steps: []step{
				{op: "start", a: 0, b: 5, c: 5},
				{op: "see", c: 6, a: 1, wantHeld: true},
				{op: "see", c: 7, a: 2, wantHeld: true},
				{op: "see", c: 8, a: 3, wantHeld: true},
				{op: "see", c: 9, a: 4}, {op: "see", c: 10, a: 5},
				{op: "batch", a: 5, wantCP: 3}, // barrier 5: old deliveries not all acked yet
				{op: "ackfloor", a: 4},         // not past the barrier
				{op: "ackfloor", a: 5},
				{op: "see", c: 11, a: 6},
				{op: "batch", a: 6, wantCP: 6},
			},
			wantFloor: 6,
		},
		{
			name: "crash before anything was held: newer messages first, the floor waits",
			steps: []step{
				{op: "start", a: 0, b: 3, c: 3},
				{op: "see", c: 4, a: 4}, {op: "see", c: 5, a: 5},
				{op: "batch", a: 5, wantCP: 0},
				{op: "see", c: 6, a: 1}, {op: "see", c: 7, a: 2}, {op: "see", c: 8, a: 3},
				{op: "batch", a: 3, wantCP: 0},
				{op: "ackfloor", a: 5},
			},
			wantFloor: 5,
		},
		{
			name: "a delivery lost in transit raises a barrier",
			steps: []step{
				{op: "start", a: 0, b: 0, c: 0},
				{op: "see", c: 1, a: 1},
				{op: "batch", a: 1, wantCP: 1},
				{op: "see", c: 3, a: 3}, // dseq 2 (seq 2) never arrived
				{op: "batch", a: 3, wantCP: 1},
				{op: "see", c: 4, a: 2}, // redelivered after AckWait
				{op: "batch", a: 2, wantCP: 1},
				{op: "ackfloor", a: 3},
			},
			wantFloor: 3,
		},
		{
			// Another instance sharing the consumer took the first
			// delivery of 11 (dseq 11) and died; this one sees a
			// redelivery of 9 next, then 12, then 11 come back.
			name: "a delivery missed before a redelivery: the barrier waits for what the consumer had delivered",
			steps: []step{
				{op: "start", a: 0, b: 0, c: 0},
				{op: "see", c: 1, a: 1}, {op: "see", c: 2, a: 2}, {op: "see", c: 3, a: 3},
				{op: "see", c: 4, a: 4}, {op: "see", c: 5, a: 5}, {op: "see", c: 6, a: 6},
				{op: "see", c: 7, a: 7}, {op: "see", c: 8, a: 8}, {op: "see", c: 9, a: 9},
				{op: "see", c: 10, a: 10},
				{op: "batch", a: 10, wantCP: 10},
				{op: "see", c: 12, a: 9, redelivery: true, wantHeld: true},
				{op: "see", c: 13, a: 12},
				{op: "batch", a: 12, wantCP: 10},
				{op: "ackfloor", a: 10, b: 12}, // 11 unacked: the barrier is 12 now, not 10
				{op: "see", c: 14, a: 11, redelivery: true},
				{op: "batch", a: 11, wantCP: 10},
				{op: "ackfloor", a: 12, b: 12},
				{op: "see", c: 15, a: 13},
				{op: "batch", a: 13, wantCP: 13},
			},
			wantFloor: 13,
		},
		{
			name: "a delivery missed before a redelivery, the ack floor already past what was delivered",
			steps: []step{
				{op: "start", a: 0, b: 0, c: 0},
				{op: "see", c: 1, a: 1}, {op: "see", c: 2, a: 2},
				{op: "batch", a: 2, wantCP: 2},
				{op: "see", c: 4, a: 1, redelivery: true, wantHeld: true}, // dseq 3 elsewhere
				{op: "ackfloor", a: 3, b: 3},                              // that delivery (seq 3) was acked
			},
			wantFloor: 3,
		},
		{
			// Another instance holds 2; the barrier (3) stays, but the
			// floor follows the server's ack floor meanwhile.
			name: "the floor follows the ack floor below an uncleared barrier",
			steps: []step{
				{op: "start", a: 0, b: 0, c: 0},
				{op: "see", c: 1, a: 1},
				{op: "batch", a: 1, wantCP: 1},
				{op: "see", c: 3, a: 3}, // dseq 2 (seq 2) went elsewhere
				{op: "batch", a: 3, wantCP: 1},
				{op: "ackfloor", a: 2, b: 3},
				{op: "see", c: 4, a: 4},
				{op: "batch", a: 4, wantCP: 2},
			},
			wantFloor: 2,
		},
		{
			name:   "clean restart: nothing pending, no barrier",
			stored: 10,
			steps: []step{
				{op: "start", a: 10, b: 10, c: 12},
				{op: "see", c: 13, a: 11},
				{op: "batch", a: 11, wantCP: 11},
			},
			wantFloor: 11,
		},
		{
			name:   "server ack floor above the stored checkpoint",
			stored: 2,
			steps: []step{
				{op: "start", a: 7, b: 7, c: 7},
				{op: "see", c: 8, a: 8},
				{op: "batch", a: 8, wantCP: 8},
			},
			wantFloor: 8,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := &floorState{floor: tt.stored}
			now := time.Unix(0, 0)
			for i, s := range tt.steps {
				switch s.op {
				case "start":
					f.start(s.a, s.b, s.c)
				case "see":
					if held := f.see(s.c, s.a, !s.redelivery); held != s.wantHeld {
						t.Fatalf("step %d: see(%d, %d) held = %v, want %v", i, s.c, s.a, held, s.wantHeld)
					}
				case "batch":
					cp := f.checkpoint(s.a)
					if cp != s.wantCP {
						t.Fatalf("step %d: checkpoint = %d, want %d", i, cp, s.wantCP)
					}
					spans := f.nextSpans(cp)
					_, stored := f.heldCheckpoints("k", 0, spans)
					f.handled(s.a, cp, spans, stored)
				case "ackfloor":
					now = now.Add(barrierCheckEvery)
					if f.barrier != 0 && !f.wantAckFloor(now) {
						t.Fatalf("step %d: barrier set but no ack floor check wanted", i)
					}
					f.ackFloor(s.a, s.b)
				}
			}
			if f.floor != tt.wantFloor {
				t.Errorf("floor = %d, want %d", f.floor, tt.wantFloor)
			}
		})
	}
}

// TestAdoptLegacy: a floor stored without the stream's identity (by an
// older version) is kept only if the consumer has delivered that far on
// the stream it reads now; otherwise it may be from a stream since created
// again, and is dropped (the server's ack floor still applies).
func TestAdoptLegacy(t *testing.T) {
	for _, c := range []struct {
		name                string
		legacy, delivered   int64
		wantKept            bool
		wantFloor           int64
		ackFloor, wantAfter int64 // start(ackFloor, delivered) afterwards
	}{
		{name: "upgrade: the consumer delivered past it", legacy: 5, delivered: 7, wantKept: true, wantFloor: 5, ackFloor: 4, wantAfter: 5},
		{name: "upgrade: the consumer delivered exactly up to it", legacy: 5, delivered: 5, wantKept: true, wantFloor: 5, ackFloor: 5, wantAfter: 5},
		{name: "a new stream (or consumer) not that far yet", legacy: 5, delivered: 2, wantFloor: 0, ackFloor: 2, wantAfter: 2},
		{name: "a new stream, nothing delivered", legacy: 5, delivered: 0, wantFloor: 0, ackFloor: 0, wantAfter: 0},
		{name: "no legacy floor", legacy: 0, delivered: 9, wantFloor: 0, ackFloor: 9, wantAfter: 9},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := &floorState{legacy: c.legacy}
			if kept := f.adoptLegacy(c.delivered); kept != c.wantKept || f.floor != c.wantFloor || f.legacy != 0 {
				t.Fatalf("adoptLegacy(%d) = %v, floor %d, legacy %d; want %v, floor %d, legacy 0",
					c.delivered, kept, f.floor, f.legacy, c.wantKept, c.wantFloor)
			}
			f.start(c.ackFloor, c.delivered, uint64(c.delivered))
			if f.floor != c.wantAfter {
				t.Fatalf("floor after start = %d, want %d", f.floor, c.wantAfter)
			}
			if again := f.adoptLegacy(0); again {
				t.Fatal("decided twice")
			}
		})
	}
}
