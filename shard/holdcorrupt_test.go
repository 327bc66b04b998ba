package shard

import (
	"bytes"
	"slices"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// TestCorruptHeldValueAtOpen: TestCorruptValueAtFire for a held task.
// The first held task's value fails its checksum (a flipped byte in the
// blob file that holds it): the store still opens, the other held task is
// delivered, the corrupt one is reported undecodable.
func TestCorruptHeldValueAtOpen(t *testing.T) {
	h := holdHarness(t, -1)
	h.sink.setFail(func(*codec.Task) error { return errDown })
	a := sched("a", t0.Add(time.Second), 1)
	a.Value = bytes.Repeat([]byte("A"), 4096) // separated into a blob file
	h.ingest([]codec.Task{a, sched("b", t0.Add(time.Second), 2)})
	h.run()
	h.advance(time.Second)
	if st := h.e.Stats(); st.Held != 2 {
		t.Fatalf("held %d, want 2", st.Held)
	}
	h.close() // flushes: a's envelope goes to a blob file
	corruptOnlyBlob(t, h.opts.Dir)
	e, err := Open(h.opts)
	if err != nil {
		t.Fatalf("Open with a corrupt held value: %v", err)
	}
	h.e = e
	h.sink.setFail(nil)
	h.run()
	h.advance(10 * time.Second)
	if got := h.sink.acked(); !slices.Equal(got, []string{"b"}) {
		t.Fatalf("delivered %v, want b only", got)
	}
	l := stuckOf(t, h.e)
	if len(l) != 1 || l[0].State != StuckUndecodable || l[0].Seq != 1 {
		t.Fatalf("stuck entries %+v, want task a undecodable", l)
	}
	if err := h.e.DropStuck(0, l[0].Seq); err != nil {
		t.Fatalf("DropStuck: %v", err)
	}
	if st := h.e.Stats(); st.Pending != 0 || st.Held != 0 {
		t.Fatalf("after the drop: %+v", st)
	}
	h.checkPending()
}
