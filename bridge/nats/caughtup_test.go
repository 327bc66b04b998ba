package nats

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/delaybridge/delaybridge/bridge"
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

// caughtUpWatch records how many items had been handed over when the
// source's CaughtUp was first seen closed (at the start of a Handle).
type caughtUpWatch struct {
	*recorder
	src  *Source
	mu   sync.Mutex
	seen int // -1: not yet
}

func (h *caughtUpWatch) Handle(ctx context.Context, b *bridge.Batch) error {
	select {
	case <-h.src.CaughtUp():
		h.mu.Lock()
		if h.seen < 0 {
			h.seen = h.itemCount()
		}
		h.mu.Unlock()
	default:
	}
	return h.recorder.Handle(ctx, b)
}

// TestSourceCaughtUpManyInFlight (review R171): 30 messages in flight at
// a crash, asked back at start, come back in batches of 5. JetStream's
// pending count leaves out what is queued for redelivery, so the first
// batch of them reported nothing pending and CaughtUp closed with 25
// still to read (a cancel among them came after the pause). It closes
// only once the ack floor has passed them all.
func TestSourceCaughtUpManyInFlight(t *testing.T) {
	const n = 30
	_, _, src := crashedWithInFlight(t, n)
	h := &caughtUpWatch{recorder: newRecorder(), src: src, seen: -1}
	runSource(t, src, h)
	eventually(t, "caught up", func() bool { return isClosed(src.CaughtUp()) })
	if got := h.itemCount(); got != n {
		t.Fatalf("caught up with %d of the %d messages in flight at the crash read", got, n)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.seen >= 0 {
		t.Fatalf("CaughtUp closed after %d of the %d messages in flight at the crash were read", h.seen, n)
	}
}

// TestSourceCaughtUpStreamCreatedAgain (review R172): 30 messages in
// flight at a crash are asked back at start (the source is caught up once
// the ack floor passes 30); while the first batch of them is held, the
// stream is deleted and created again with 2 new messages. The ack floor
// of the new stream never reaches 30: CaughtUp stayed open once the
// source had read them, and firing paused until catch_up_wait.
func TestSourceCaughtUpStreamCreatedAgain(t *testing.T) {
	const n = 30
	cfg, js, src := crashedWithInFlight(t, n)
	h := &blocker{recorder: newRecorder(), entered: make(chan struct{}), release: make(chan struct{})}
	runSource(t, src, h)
	<-h.entered
	ctx := ctxT(t)
	if err := js.DeleteStream(ctx, cfg.Stream); err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: cfg.Stream, Subjects: []string{"delay.>"}}); err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		publish(t, js, "delay.x", fmt.Sprint("new", i), nil)
	}
	close(h.release)
	eventually(t, "the new stream's messages read and acked", func() bool {
		c, err := js.Consumer(ctx, cfg.Stream, cfg.Consumer)
		if err != nil {
			return false
		}
		info, err := c.Info(ctx)
		return err == nil && info.Delivered.Stream == 2 && info.NumAckPending == 0 && info.NumPending == 0
	})
	// The source closes CaughtUp right after the batch (the ack floor
	// poll comes every 50 ms); 5 s is a bound, not a timing.
	if !waitUntil(5*time.Second, func() bool { return isClosed(src.CaughtUp()) }) {
		t.Fatalf("CaughtUp still open with the new stream read to its end (the old stream's %d in flight waited for)", n)
	}
}

// TestSourceCaughtUpStoredAckLost: a run stored a batch and was killed
// before its acks reached the server. At the next start those messages are
// held (at or below the stored floor) and still pending, so the ack floor
// CaughtUp waits for stays below them until they come back: asked back at
// start, they are redelivered, skipped as held and acked at once, not after
// AckWait (2 min here; the binary's crash loop paused 28-29 s, its ack
// wait, when they were not asked back).
func TestSourceCaughtUpStoredAckLost(t *testing.T) {
	s := startServer(t, jsOptions(t))
	cfg := testConfig(t, serverURL(s))
	cfg.Create = true
	cfg.AckWait, cfg.BatchSize, cfg.Linger = 2*time.Minute, 5, 50*time.Millisecond
	js := newJS(t, connect(t, cfg))
	store := newRecorder()
	nc1 := connect(t, cfg)
	src1, err := NewSource(nc1, cfg) // creates the stream
	if err != nil {
		t.Fatal(err)
	}
	const n = 5
	for i := range n {
		publish(t, js, "delay.a", fmt.Sprint(i), nil)
	}
	h1 := &crashAfterStore{recorder: store, nc: nc1, crashSeq: n, crashed: make(chan struct{})}
	stop1 := runSource(t, src1, h1)
	select {
	case <-h1.crashed:
	case <-time.After(15 * time.Second):
		t.Fatal("the first run did not store the last message")
	}
	_ = stop1()
	ci := consumerInfo(t, js, cfg.Stream, cfg.Consumer)
	if ci.NumAckPending == 0 {
		t.Fatal("every ack of the first run reached the server: nothing to test")
	}
	t.Logf("after the crash: ack floor %d, delivered %d, ack pending %d", ci.AckFloor.Stream, ci.Delivered.Stream, ci.NumAckPending)

	src2, err := NewSource(connect(t, cfg), cfg)
	if err != nil {
		t.Fatal(err)
	}
	runSource(t, src2, store)
	eventually(t, "caught up (AckWait 2 min)", func() bool { return isClosed(src2.CaughtUp()) })
	handedOnce(t, store, n)
}

// crashedWithInFlight is a source (AckWait 2 min, batches of 5) whose
// consumer has n messages that a crashed run received and never
// acknowledged.
func crashedWithInFlight(t *testing.T, n int) (Config, jetstream.JetStream, *Source) {
	t.Helper()
	cfg, _, js, src := createdSource(t, func(c *Config) {
		c.AckWait = 2 * time.Minute
		c.BatchSize = 5
	})
	for i := range n {
		publish(t, js, "delay.x", fmt.Sprint(i), nil)
	}
	fetchUnacked(t, js, cfg, n)
	return cfg, js, src
}
