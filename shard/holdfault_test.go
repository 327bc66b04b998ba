package shard

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"

	"github.com/delaybridge/delaybridge/codec"
)

// toggleSink turns the disk fault on when its Deliver call number at
// begins, then delegates to the recSink.
type toggleSink struct {
	*recSink
	calls  atomic.Int32
	at     int32
	toggle *errorfs.Toggle
}

func (s *toggleSink) Deliver(ctx context.Context, batch []*codec.Task) []error {
	if s.calls.Add(1) == s.at {
		s.toggle.On()
	}
	return s.recSink.Deliver(ctx, batch)
}

func walFault(kinds ...errorfs.OpKind) *errorfs.Toggle {
	return &errorfs.Toggle{Injector: errorfs.InjectorFunc(func(op errorfs.Op) error {
		if !strings.HasSuffix(op.Path, ".log") {
			return nil
		}
		for _, k := range kinds {
			if op.Kind == k {
				return errorfs.ErrInjected
			}
		}
		return nil
	})}
}

// TestHeldStoreFault: a WAL write or sync fault during a hold move or a
// release makes the store sticky-failed; after a reopen with a good disk
// the counts match the store, nothing is lost, and everything is
// delivered.
func TestHeldStoreFault(t *testing.T) {
	for _, kind := range []struct {
		name  string
		kinds []errorfs.OpKind
	}{
		{"wal-write", []errorfs.OpKind{errorfs.OpFileWrite, errorfs.OpFileWriteAt}},
		{"wal-sync", []errorfs.OpKind{errorfs.OpFileSync, errorfs.OpFileSyncData, errorfs.OpFileSyncTo}},
	} {
		for _, phase := range []string{"move", "release"} {
			for _, outage := range []int{-1, 10} {
				for _, at := range []int32{1, 2, 3} {
					t.Run(fmt.Sprintf("%s/%s/outage%d/call%d", kind.name, phase, outage, at), func(t *testing.T) {
						heldStoreFault(t, kind.kinds, phase, outage, at)
					})
				}
			}
		}
	}
}

func heldStoreFault(t *testing.T, kinds []errorfs.OpKind, phase string, outage int, at int32) {
	toggle := walFault(kinds...)
	h := holdHarness(t, outage, func(o *Options) { o.FS = errorfs.Wrap(vfs.Default, toggle) })
	const n = 40
	h.sink.setFail(func(*codec.Task) error { return errDown })
	var batch []codec.Task
	for i := range n {
		task := sched(fmt.Sprintf("t%03d", i), t0.Add(time.Second), int64(i+1))
		if i%3 == 0 {
			task.Target = "other"
		}
		batch = append(batch, task)
	}
	h.ingest(batch)
	sink := &toggleSink{recSink: h.sink, toggle: toggle, at: 1 << 30}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.e.Run(ctx, sink) }()
	if phase == "move" {
		sink.at = at
	} else {
		h.settle()
		h.advance(time.Second) // all come due and fail: held (beyond OutageMemory)
		if st := h.e.Stats(); st.Held == 0 {
			t.Fatalf("nothing held: %+v", st)
		}
		h.sink.setFail(nil)
		sink.at = sink.calls.Load() + at
	}
	for i := 0; !errors.Is(h.e.Err(), ErrStoreFailed); i++ {
		if i == 100 {
			t.Fatalf("store not failed: %v", h.e.Err())
		}
		h.clk.Advance(time.Second)
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	<-done
	h.e.Close()
	h.e = nil
	ackedBefore := map[string]bool{}
	for _, id := range h.sink.acked() {
		ackedBefore[id] = true
	}

	h.opts.FS = nil
	h.clk.Set(t0)
	h.open()
	held, all := heldKeys(t, h.e)
	st := h.e.Stats()
	if st.Held != held || st.Pending != all {
		t.Fatalf("after reopen: Stats held %d pending %d; store holds %d held keys, %d t keys", st.Held, st.Pending, held, all)
	}
	for i := range n {
		id := fmt.Sprintf("t%03d", i)
		if _, err := h.e.Lookup("src", id); err != nil && !ackedBefore[id] {
			t.Fatalf("%s neither delivered nor stored: %v", id, err)
		}
	}
	h.sink.reset()
	h.sink.setFail(nil)
	h.run()
	for range 20 {
		h.advance(time.Second)
	}
	got := map[string]bool{}
	for _, id := range h.sink.acked() {
		got[id] = true
	}
	for i := range n {
		id := fmt.Sprintf("t%03d", i)
		if !got[id] && !ackedBefore[id] {
			t.Fatalf("%s never delivered", id)
		}
	}
	if st := h.e.Stats(); st.Pending != 0 || st.Held != 0 {
		t.Fatalf("after delivery: %+v", st)
	}
	h.checkPending()
	t.Logf("held at reopen %d of %d pending; %d acked before the fault", held, all, len(ackedBefore))
}
