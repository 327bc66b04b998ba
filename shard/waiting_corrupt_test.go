package shard

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"

	"github.com/delaybridge/delaybridge/codec"
)

// TestWaitingRecordOfUndecodableTask (review R179): a task waiting for an
// outage whose stored envelope cannot be decoded leaves shard.late when
// its claim finds it so, with no commit to delete its waiting record in:
// the record stays while the entry does (an Open takes it for a task
// waiting again, harmlessly: its claim finds it undecodable again), and
// the operator's drop of the entry (DELETE /v1/stuck) deletes it too.
func TestWaitingRecordOfUndecodableTask(t *testing.T) {
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.Retry = RetryPolicy{Initial: 500 * time.Millisecond, Max: 5 * time.Minute, Multiplier: 2, Jitter: -1, MaxAttempts: 3}
	})
	down := fmt.Errorf("broker down: %w", ErrUnavailable)
	h.sink.setFail(func(*codec.Task) error { return down })
	h.run()
	h.ingest([]codec.Task{sched("a", t0, 1)})
	h.advance(time.Second)
	h.close()
	db, err := openPebble(t.Context(), h.opts.Dir, nil, h.e0Logger(), 0, 0, nil, 0, false)
	if err != nil {
		t.Fatal(err)
	}
	v, closer, err := db.Get(waitingKey(0, 1))
	if err != nil {
		t.Fatalf("waiting record of a: %v", err)
	}
	_, seq, fire, _, ok := parseWaiting(waitingKey(0, 1), v)
	closer.Close()
	if !ok {
		t.Fatal("corrupt waiting record")
	}
	if err := errors.Join(db.Set(appendTaskKey(nil, 0, fire, seq), []byte{0xff, 0xfe}, pebble.Sync), db.Close()); err != nil {
		t.Fatal(err)
	}
	h.open()
	h.run()
	h.advance(10 * time.Minute) // its retry comes: found undecodable
	l := stuckOf(t, h.e)
	if len(l) != 1 || l[0].State != StuckUndecodable {
		t.Fatalf("stuck %+v, want a undecodable", l)
	}
	if err := h.e.DropStuck(l[0].Shard, l[0].Seq); err != nil {
		t.Fatal(err)
	}
	if n := waitingRecords(t, h.e); n != 0 {
		t.Fatalf("%d waiting records after the undecodable task was dropped, want 0", n)
	}
	h.reopen()
	s := h.e.shards[0]
	s.mu.Lock()
	n := len(s.late)
	s.mu.Unlock()
	h.e.outages.mu.Lock()
	groups := len(h.e.outages.m)
	h.e.outages.mu.Unlock()
	if n != 0 || groups != 0 {
		t.Fatalf("after a restart: %d tasks known to wait, %d groups down; the only task waiting was dropped", n, groups)
	}
}
