package nats

import (
	"fmt"
	"testing"
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
