package nats

import (
	"fmt"
	"testing"
	"time"
)

// CaughtUp closes at start when the consumer has nothing pending, and
// otherwise only once the batch whose last message had nothing behind it
// is stored.
func TestSourceCaughtUp(t *testing.T) {
	t.Run("empty", func(t *testing.T) {
		_, _, _, src := createdSource(t, nil)
		runSource(t, src, newRecorder())
		eventually(t, "caught up", func() bool { return isClosed(src.CaughtUp()) })
	})
	t.Run("backlog", func(t *testing.T) {
		_, _, js, src := createdSource(t, nil)
		for i := range 5 {
			publish(t, js, "delay.x", fmt.Sprint(i), nil)
		}
		rec := newRecorder()
		rec.setFail(true)
		runSource(t, src, rec)
		eventually(t, "two failed attempts", func() bool { return rec.numCalls() >= 2 })
		if isClosed(src.CaughtUp()) {
			t.Fatal("caught up while the backlog is not stored")
		}
		rec.setFail(false)
		eventually(t, "caught up", func() bool { return isClosed(src.CaughtUp()) })
		if n := len(rec.seqs()); n != 5 {
			t.Fatalf("caught up with %d of 5 stored", n)
		}
	})
}

func isClosed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// TestSourceCaughtUpRedelivered: messages a previous run received and did
// not store (here: nak'd at a graceful stop) are ack-pending, not pending,
// in the consumer's info; the next run has not caught up before it stored
// them, though nothing is pending at its start.
func TestSourceCaughtUpRedelivered(t *testing.T) {
	cfg, nc, js, src := createdSource(t, nil)
	for i := range 5 {
		publish(t, js, "delay.x", fmt.Sprint(i), nil)
	}
	rec := newRecorder()
	rec.setFail(true)
	stop := runSource(t, src, rec)
	eventually(t, "a failed attempt", func() bool { return rec.numCalls() >= 1 })
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	info := consumerInfo(t, js, cfg.Stream, cfg.Consumer)
	if info.NumPending != 0 || info.NumAckPending == 0 {
		t.Fatalf("after the stop: %d pending, %d ack-pending; want 0 and the 5 received", info.NumPending, info.NumAckPending)
	}

	src2, err := NewSource(nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	calls := rec.numCalls()
	runSource(t, src2, rec)
	eventually(t, "two failed attempts of the next run", func() bool { return rec.numCalls() >= calls+2 })
	if isClosed(src2.CaughtUp()) {
		t.Fatal("caught up while the messages the previous run received are not stored")
	}
	rec.setFail(false)
	eventually(t, "caught up", func() bool { return isClosed(src2.CaughtUp()) })
	if n := len(rec.seqs()); n != 5 {
		t.Fatalf("caught up with %d of 5 stored", n)
	}
}

// TestSourceCaughtUpAfterAckWait: messages received by a run that crashed
// (here fetched and never acknowledged) come back (asked back at start, see
// TestUnseenNakedAtStart, or after the ack wait, 1 s here); the source
// catches up once it stored them.
func TestSourceCaughtUpAfterAckWait(t *testing.T) {
	cfg, _, js, src := createdSource(t, func(c *Config) { c.AckWait = time.Second })
	for i := range 5 {
		publish(t, js, "delay.x", fmt.Sprint(i), nil)
	}
	fetchUnacked(t, js, cfg, 5)
	rec := newRecorder()
	runSource(t, src, rec)
	eventually(t, "caught up", func() bool { return isClosed(src.CaughtUp()) })
	if n := len(rec.seqs()); n != 5 {
		t.Fatalf("caught up with %d of 5 stored", n)
	}
}
