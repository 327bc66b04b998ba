package nats

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	natsgo "github.com/nats-io/nats.go"

	"github.com/delaybridge/delaybridge/bridge"
)

// crashAfterStore is a Handler that stores through the recorder (the
// bridge's store, kept across "restarts") and, for the batch holding
// crashSeq, closes the source's connection right after the store commit:
// the source's acks of that batch never reach the server, as with a kill -9
// between the store commit and the ack.
type crashAfterStore struct {
	*recorder
	nc       *natsgo.Conn
	crashSeq int64
	before   func(nc *natsgo.Conn) // run before storing the crash batch, if set
	once     sync.Once
	crashed  chan struct{}
}

func (c *crashAfterStore) Handle(ctx context.Context, b *bridge.Batch) error {
	select {
	case <-c.crashed:
		return errHandle // dead: nothing more is stored
	default:
	}
	crash := slices.ContainsFunc(b.Items, func(it bridge.Item) bool { return it.Msg.Offset == c.crashSeq })
	if crash && c.before != nil {
		c.before(c.nc)
	}
	if err := c.recorder.Handle(ctx, b); err != nil {
		return err
	}
	if crash {
		c.once.Do(func() { c.nc.Close(); close(c.crashed) })
	}
	return nil
}

// TestSourceCrashInBarrierWindowNoReingest: a message handled while the
// floor is held back by a barrier (after a restart with unacked
// deliveries) must not be handed over again when a second crash loses its
// ack: its task may have been delivered and deleted meanwhile, and taken in
// again it is delivered a second time.
//
//  1. run 1 stores 1 (floor 1) and crashes before acking; 2 was delivered
//     to its prefetch buffer, never handled;
//  2. run 2 starts with ack floor 0, delivered 2: barrier 2. Its nak of 2
//     is lost (noNaks). It stores 3 (first delivery) with the floor still
//     1 and crashes before acking;
//  3. run 3 gets 1, 2, 3 back after AckWait: 1 is below the floor, 2 was
//     never handled, 3 was stored in run 2 and must be skipped.
func TestSourceCrashInBarrierWindowNoReingest(t *testing.T) {
	s := startServer(t, jsOptions(t))
	cfg := testConfig(t, serverURL(s))
	cfg.Create = true
	// AckWait: run 2 must be over before 2 (delivered to run 1, never
	// acked) comes back; run 3 waits for the redeliveries.
	cfg.AckWait, cfg.BatchSize, cfg.Linger = 4*time.Second, 1, time.Millisecond
	pub := connect(t, cfg)
	js := newJS(t, pub)
	store := newRecorder()

	newRun := func(crashSeq int64, before func(*natsgo.Conn)) (*Source, *crashAfterStore) {
		nc := connect(t, cfg)
		src, err := NewSource(nc, cfg)
		if err != nil {
			t.Fatal(err)
		}
		return src, &crashAfterStore{recorder: store, nc: nc, crashSeq: crashSeq, before: before, crashed: make(chan struct{})}
	}
	runUntilCrash := func(src *Source, h *crashAfterStore, during func()) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		done := make(chan error, 1)
		go func() { done <- src.Run(ctx, h) }()
		if during != nil {
			during()
		}
		select {
		case <-h.crashed:
		case <-time.After(20 * time.Second):
			t.Fatal("the run did not crash")
		}
		cancel()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			t.Fatal("Run did not return")
		}
	}

	// Run 1.
	// The consumer counts 2 as delivered when it hands it to the server's
	// send queue; the send to run 1's pull inbox comes after, and a send
	// that finds run 1 gone (closed below) is redelivered at once, not
	// after AckWait. So wait until the server wrote both to run 1's
	// connection.
	src1, h1 := newRun(1, func(nc *natsgo.Conn) {
		eventually(t, "2 delivered to run 1's buffer", func() bool {
			return consumerInfo(t, js, "DELAY", "bridge").Delivered.Stream >= 2 && pulledBy(t, s, nc) >= 2
		})
	})
	publish(t, js, "delay.a", "1", nil)
	publish(t, js, "delay.a", "2", nil)
	runUntilCrash(src1, h1, nil)

	ci := consumerInfo(t, js, "DELAY", "bridge")
	t.Logf("after run 1: ack floor %d delivered %d/%d pending %d redelivered %d ackwait %v", ci.AckFloor.Stream, ci.Delivered.Stream, ci.Delivered.Consumer, ci.NumAckPending, ci.NumRedelivered, ci.Config.AckWait)
	// Run 2: a barrier (2 delivered, not acked); 3 is handled under it.
	// Its nak of 2 at start is lost, so 2 comes back only after AckWait.
	src2, h2 := newRun(3, nil)
	src2.noNaks = true
	runUntilCrash(src2, h2, func() {
		eventually(t, "run 2 consuming", func() bool {
			return consumerInfo(t, js, "DELAY", "bridge").NumWaiting > 0
		})
		publish(t, js, "delay.a", "3", nil)
	})
	for _, b := range store.batches {
		t.Logf("batch %d cps %v", b.Items[0].Msg.Offset, b.Checkpoints)
	}
	if got := store.seqs(); !slices.Equal(got, []int64{1, 3}) {
		t.Fatalf("after run 2 the store took %v, want [1 3] (2 redelivered too early? raise AckWait)", got)
	}

	// Run 3: no crash.
	nc3 := connect(t, cfg)
	src3, err := NewSource(nc3, cfg)
	if err != nil {
		t.Fatal(err)
	}
	runSource(t, src3, store)
	eventually(t, "everything acked", func() bool {
		return consumerInfo(t, js, "DELAY", "bridge").AckFloor.Stream >= 3
	})
	if got := slices.Sorted(slices.Values(store.seqs())); !slices.Equal(got, []int64{1, 2, 3}) {
		t.Fatalf("the store took %v, want 1, 2, 3 once each: a message stored under a barrier was taken in again after its ack was lost", got)
	}
}

// pulledBy returns how many messages the server wrote to nc's pull inboxes
// (plain inboxes, not the request mux's wildcard): the messages a source on
// nc received from its consumer, as far as the server knows.
func pulledBy(t testing.TB, s *server.Server, nc *natsgo.Conn) int64 {
	t.Helper()
	cid, err := nc.GetClientID()
	if err != nil {
		t.Fatal(err)
	}
	cz, err := s.Connz(&server.ConnzOptions{CID: cid, SubscriptionsDetail: true})
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, c := range cz.Conns {
		for _, sub := range c.SubsDetail {
			if strings.HasPrefix(sub.Subject, natsgo.InboxPrefix) && !strings.ContainsAny(sub.Subject, "*>") {
				n += sub.Msgs
			}
		}
	}
	return n
}
