package nats

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/bridge"
)

// TestFloorUnseen: the sequences the floor state finds delivered to the
// source and never received, to be nak'd (see Source.nakUnseen).
func TestFloorUnseen(t *testing.T) {
	type step struct {
		start    *[3]int64 // ackFloor, delivered, deliveredDseq
		see      *[3]int64 // dseq, seq, first (1) or redelivery (0)
		resumed  *[4]int64 // delivered, deliveredDseq, asideDseq, asideSeq
		floor    int64     // set before the step if not 0
		want     []span    // takeUnseen after the step
		wantNone bool
		gaps     int // gaps in consumer sequences so far
	}
	st := func(a, d, dd int64) *[3]int64 { return &[3]int64{a, d, dd} }
	see := func(dseq, seq int64, first bool) *[3]int64 {
		f := int64(0)
		if first {
			f = 1
		}
		return &[3]int64{dseq, seq, f}
	}
	res := func(d, dd, ad, as int64) *[4]int64 { return &[4]int64{d, dd, ad, as} }
	cases := []struct {
		name  string
		steps []step
	}{
		{"nothing pending at start", []step{{start: st(10, 10, 10), wantNone: true}}},
		{"delivered and not acked at start: in flight at a crash", []step{{start: st(10, 14, 20), want: []span{{11, 14}}}}},
		{"at start, also those held (stored, their ack lost)", []step{{floor: 12, start: st(10, 14, 20), want: []span{{11, 14}}}}},
		{"contiguous deliveries", []step{
			{start: st(0, 0, 0), wantNone: true},
			{see: see(1, 1, true), wantNone: true},
			{see: see(2, 2, true), wantNone: true},
		}},
		{"a gap before a first delivery: the sequences between", []step{
			{start: st(0, 0, 0), wantNone: true},
			{see: see(1, 1, true), wantNone: true},
			{see: see(4, 4, true), want: []span{{2, 3}}, gaps: 1},
			{see: see(5, 5, true), wantNone: true, gaps: 1},
		}},
		{"a gap before a redelivery: not known which", []step{
			{start: st(0, 0, 0), wantNone: true},
			{see: see(1, 7, true), wantNone: true},
			{see: see(3, 2, false), wantNone: true, gaps: 1},
		}},
		{"a gap among what a reconnect set aside: lost with the connection", []step{
			// (review R172) A pull that outlived the reconnect at the
			// server delivered 4 once its reply subject was subscribed
			// again; 2 and 3 went down the lost connection.
			{start: st(0, 0, 0), wantNone: true},
			{see: see(1, 1, true), wantNone: true},
			// Delivered by the reset: not counted as another client's.
			{resumed: res(4, 4, 4, 4), wantNone: true},
			{see: see(4, 4, true), want: []span{{2, 3}}},
			{see: see(5, 5, true), wantNone: true},
		}},
		{"reset: deliveries past the last seen and past what was set aside", []step{
			{start: st(0, 0, 0), wantNone: true},
			{see: see(1, 1, true), wantNone: true},
			{resumed: res(5, 5, 3, 3), want: []span{{4, 5}}},
			{see: see(2, 2, true), wantNone: true}, // set aside
			{see: see(3, 3, true), wantNone: true},
			// 4 and 5 nak'd, redelivered; the gap (4, 5) was delivered
			// at the reset: the source's own, not counted.
			{see: see(6, 4, false), wantNone: true},
			{see: see(7, 5, false), wantNone: true},
			{see: see(8, 6, true), wantNone: true},
		}},
		{"reset: nothing lost", []step{
			{start: st(0, 0, 0), wantNone: true},
			{see: see(1, 1, true), wantNone: true},
			{resumed: res(3, 3, 3, 3), wantNone: true},
		}},
		{"reset then the gap seen: not asked twice", []step{
			{start: st(0, 0, 0), wantNone: true},
			{see: see(1, 1, true), wantNone: true},
			// The missed deliveries went down the lost connection (the
			// consumer had delivered up to 3 at the reset): the source's
			// own, not counted for checkGaps (review R173).
			{resumed: res(3, 3, 0, 0), want: []span{{2, 3}}},
			{see: see(4, 4, true), wantNone: true},
		}},
		{"reset, then a gap past what was delivered at it: counted", []step{
			{start: st(0, 0, 0), wantNone: true},
			{see: see(1, 1, true), wantNone: true},
			{resumed: res(3, 3, 0, 0), want: []span{{2, 3}}},
			{see: see(5, 5, true), want: []span{{4, 4}}, gaps: 1},
		}},
		{"a new consume after a reset: not asked twice", []step{
			{start: st(0, 0, 0), wantNone: true},
			{see: see(1, 1, true), wantNone: true},
			{resumed: res(3, 3, 0, 0), want: []span{{2, 3}}},
			// 3 was never received, 2 neither: both asked once.
			{start: st(1, 3, 3), wantNone: true},
		}},
		{"a new consume: what was received and not acked is asked back", []step{
			{start: st(0, 0, 0), wantNone: true},
			{see: see(1, 1, true), wantNone: true},
			{see: see(2, 2, true), wantNone: true},
			// 2 was received; still pending at the new consume only if
			// its ack was lost: redelivered and skipped as held.
			{start: st(1, 2, 2), want: []span{{2, 2}}},
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var f floorState
			for i, s := range c.steps {
				if s.floor != 0 {
					f.floor = s.floor
				}
				switch {
				case s.start != nil:
					f.start(s.start[0], s.start[1], uint64(s.start[2]))
				case s.see != nil:
					f.see(uint64(s.see[0]), s.see[1], s.see[2] == 1)
				case s.resumed != nil:
					f.resumed(s.resumed[0], uint64(s.resumed[1]), uint64(s.resumed[2]), s.resumed[3])
				}
				got := f.takeUnseen()
				if s.wantNone && len(got) != 0 || !s.wantNone && !slices.Equal(got, s.want) {
					t.Fatalf("step %d: unseen %v, want %v", i, got, s.want)
				}
				if f.gaps != s.gaps {
					t.Fatalf("step %d: %d gaps, want %d", i, f.gaps, s.gaps)
				}
			}
		})
	}
}

// TestUnseenNakedAtStart: messages a previous run received and never
// acknowledged (in flight at a crash) come back at once when the source
// starts, not after AckWait (2 min here).
func TestUnseenNakedAtStart(t *testing.T) {
	cfg, _, js, src := createdSource(t, func(c *Config) { c.AckWait = 2 * time.Minute })
	for i := range 5 {
		publish(t, js, "delay.x", fmt.Sprint(i), nil)
	}
	fetchUnacked(t, js, cfg, 5) // the crashed run's, never acked
	for i := range 3 {
		publish(t, js, "delay.x", fmt.Sprint("new", i), nil)
	}
	rec := newRecorder()
	runSource(t, src, rec)
	start := time.Now()
	if !waitUntil(20*time.Second, func() bool { return rec.itemCount() >= 8 }) {
		t.Fatalf("%d of 8 taken in within 20 s (AckWait 2 min)", rec.itemCount())
	}
	t.Logf("8 taken in %v after start", time.Since(start))
	handedOnce(t, rec, 8)
}

// TestUnseenNakedAfterReconnect: a delivery swallowed by a connection
// that is then lost (the server sent it, the client never read it) is
// asked back when the source's pulls are reset by the reconnect, without
// waiting for a later message or for AckWait (2 min here).
func TestUnseenNakedAfterReconnect(t *testing.T) {
	cfg, _, proxy, pub, rec, _ := reconnectSource(t, false, 1)
	swallowThenCut(t, cfg, proxy, pub)
	cutAt := time.Now()
	if !waitUntil(20*time.Second, func() bool { return rec.itemCount() >= 2 }) {
		t.Fatalf("the swallowed delivery not taken in within 20 s of the reconnect (AckWait 2 min)")
	}
	t.Logf("taken in %v after the connection was cut", time.Since(cutAt))
	handedOnce(t, rec, 2)
}

// TestUnseenNakedOldPullAfterReconnect (review R172): a delivery is
// swallowed by a connection that is then lost while a batch is held; the
// pull that was live survives the reconnect at the server and, once
// nats.go has subscribed its reply subject again, delivers the next
// message, which the source found before it noticed the reconnect. The
// gap is this source's own (one bridge), not another client's: asked
// back at once, not after AckWait (2 min here), and no warning about
// another client.
func TestUnseenNakedOldPullAfterReconnect(t *testing.T) {
	h := &blocker{recorder: newRecorder(), entered: make(chan struct{}), release: make(chan struct{})}
	cfg, nc, proxy, pub, logs := proxiedSource(t, false, nil, h) // the pull outlives the reconnect
	publish(t, pub, "delay.a", "held", delayHeader())
	<-h.entered
	eventually(t, "a pull waiting", func() bool {
		return consumerInfo(t, pub, cfg.Stream, cfg.Consumer).NumWaiting > 0
	})
	proxy.freeze()
	publish(t, pub, "delay.a", "swallowed", delayHeader())
	eventually(t, "delivered into the frozen connection", func() bool {
		return consumerInfo(t, pub, cfg.Stream, cfg.Consumer).NumAckPending == 2
	})
	reconnects := nc.Stats().Reconnects
	proxy.cut()
	eventually(t, "reconnected", func() bool { return nc.Stats().Reconnects > reconnects && nc.IsConnected() })
	if err := nc.Flush(); err != nil { // the pull's reply subject is subscribed again
		t.Fatal(err)
	}
	publish(t, pub, "delay.a", "after", delayHeader())
	eventually(t, "the next message delivered to the old pull", func() bool {
		return consumerInfo(t, pub, cfg.Stream, cfg.Consumer).Delivered.Consumer >= 3
	})
	close(h.release)
	if !waitUntil(20*time.Second, func() bool { return h.itemCount() >= 3 }) {
		t.Fatalf("%d of 3 taken in within 20 s of the release (AckWait 2 min): %v", h.itemCount(), h.seqs())
	}
	handedOnce(t, h.recorder, 3)
	if n := logs.FilterMessageSnippet("another client").Len(); n > 0 {
		t.Errorf("%d warnings about another client, with one bridge", n)
	}
}

// reconnectSource is a running source (BatchSize batch, AckWait 2 min,
// pulls of a minute: heartbeats 30 s apart, no missed-heartbeat path)
// reading through a proxy that can freeze and cut its connection, after
// it took in a first message. With leaf, the server has leaf nodes
// enabled: for 2 s after it received a pull, nats-server counts it as
// waiting and delivers to it though its subscriber is gone (review R172).
// It returns the source's config and connection, the proxy, a publisher,
// the recorder and the warnings logged.
func reconnectSource(t *testing.T, leaf bool, batch int) (Config, *natsgo.Conn, *freezeProxy, jetstream.JetStream, *recorder, *observer.ObservedLogs) {
	t.Helper()
	rec := newRecorder()
	cfg, nc, proxy, pub, logs := proxiedSource(t, leaf, func(c *Config) { c.BatchSize = batch }, rec)
	publish(t, pub, "delay.a", "before", delayHeader())
	eventually(t, "the first message", func() bool { return rec.itemCount() >= 1 })
	return cfg, nc, proxy, pub, rec, logs
}

// proxiedSource runs a source handled by h, reading through a proxy that
// can freeze and cut its connection, from a server (with leaf nodes
// enabled if leaf) where it creates its stream: AckWait 2 min and pulls
// of a minute (heartbeats 30 s apart, no missed-heartbeat path) unless mod
// changes them. It returns the source's config and connection, the
// proxy, a publisher and the warnings logged.
func proxiedSource(t *testing.T, leaf bool, mod func(*Config), h bridge.Handler) (Config, *natsgo.Conn, *freezeProxy, jetstream.JetStream, *observer.ObservedLogs) {
	t.Helper()
	core, logs := observer.New(zap.WarnLevel)
	opts := jsOptions(t)
	if leaf {
		opts.LeafNode.Host, opts.LeafNode.Port = "127.0.0.1", -1
	}
	s := startServer(t, opts)
	proxy := newFreezeProxy(t, s.Addr().String())
	cfg := testConfig(t, proxy.url())
	cfg.Create = true
	cfg.AckWait = 2 * time.Minute
	cfg.PullExpiry = time.Minute
	if mod != nil {
		mod(&cfg)
	}
	cfg.Logger = zap.New(zapcore.NewTee(cfg.Logger.Core(), core))
	nc := connect(t, cfg)
	src, err := NewSource(nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	pub := newJS(t, connect(t, testConfig(t, serverURL(s))))
	stop := runSource(t, src, h)
	t.Cleanup(func() { _ = stop() })
	return cfg, nc, proxy, pub, logs
}

// TestUnseenNakedAfterReconnectLeafEnabled: on a server with leaf nodes
// enabled the source's own drained pulls still count as waiting for 2 s
// after a reconnect; that must not stop it from asking back what the lost
// connection swallowed, nor make it warn about another client.
func TestUnseenNakedAfterReconnectLeafEnabled(t *testing.T) {
	cfg, _, proxy, pub, rec, logs := reconnectSource(t, true, 1)
	swallowThenCut(t, cfg, proxy, pub)
	if !waitUntil(20*time.Second, func() bool { return rec.itemCount() >= 2 }) {
		t.Fatal("the swallowed delivery not taken in within 20 s of the reconnect (AckWait 2 min)")
	}
	handedOnce(t, rec, 2)
	if n := logs.FilterMessageSnippet("another client").Len(); n > 0 {
		t.Fatalf("warned %d times about another client, with one bridge", n)
	}
}

// TestUnseenNakedBurstAfterReconnectLeafEnabled: messages published right
// after a reconnect on such a server: the drained pulls take deliveries
// into the void for up to 2 s; every one is asked back, none waits for
// AckWait, and no other client is warned of.
func TestUnseenNakedBurstAfterReconnectLeafEnabled(t *testing.T) {
	_, nc, proxy, pub, rec, logs := reconnectSource(t, true, 2)
	reconnects := nc.Stats().Reconnects
	proxy.cut()
	eventually(t, "reconnected", func() bool { return nc.Stats().Reconnects > reconnects && nc.IsConnected() })
	const n = 20
	for i := range n {
		publish(t, pub, "delay.a", fmt.Sprint(i), delayHeader())
		time.Sleep(20 * time.Millisecond) // pacing: across the reset
	}
	if !waitUntil(20*time.Second, func() bool { return rec.itemCount() >= n+1 }) {
		t.Fatalf("%d of %d taken in within 20 s (AckWait 2 min)", rec.itemCount(), n+1)
	}
	handedOnce(t, rec, n+1)
	if k := logs.FilterMessageSnippet("another client").Len(); k > 0 {
		t.Fatalf("warned %d times about another client, with one bridge", k)
	}
}

// swallowThenCut has the server deliver a message into the source's
// frozen connection (its pull waiting, everything before acked), then
// cuts the connection: the delivery is lost with it.
func swallowThenCut(t *testing.T, cfg Config, proxy *freezeProxy, pub jetstream.JetStream) {
	t.Helper()
	eventually(t, "acked, a pull waiting", func() bool {
		ci := consumerInfo(t, pub, cfg.Stream, cfg.Consumer)
		return ci.NumAckPending == 0 && ci.NumWaiting > 0
	})
	proxy.freeze()
	publish(t, pub, "delay.a", "swallowed", delayHeader())
	eventually(t, "delivered into the frozen connection", func() bool {
		return consumerInfo(t, pub, cfg.Stream, cfg.Consumer).NumAckPending == 1
	})
	proxy.cut()
}

// TestUnseenRedeliveredFirst: messages a previous run received and never
// acknowledged (in flight at a crash), asked back at start, are
// redelivered before the messages the stream holds after them (README:
// "The server redelivers them before new messages"). The server applies
// acks and naks on a queue of its own, apart from the pull requests, so a
// pull sent right after the naks could be served new messages first: 1 of
// 320 starts under CPU load ("handled [3 4 5 1 2]"). The source now waits
// for the server's answer to its last nak before it pulls. Several
// streams, each a start.
func TestUnseenRedeliveredFirst(t *testing.T) {
	s := startServer(t, jsOptions(t))
	for r := range 8 {
		cfg := testConfig(t, serverURL(s))
		cfg.Create, cfg.AckWait = true, time.Hour
		cfg.Stream, cfg.Sources = fmt.Sprint("DELAY", r), []SourceConfig{{Subject: fmt.Sprintf("d%d.>", r)}}
		nc := connect(t, cfg)
		js := newJS(t, nc)
		src, err := NewSource(nc, cfg)
		if err != nil {
			t.Fatal(err)
		}
		for i := range 5 {
			publish(t, js, fmt.Sprintf("d%d.x", r), fmt.Sprint(i), nil)
		}
		fetchUnacked(t, js, cfg, 2) // the crashed run's, never acked
		rec := newRecorder()
		stop := runSource(t, src, rec)
		eventually(t, "every message handled", func() bool { return rec.itemCount() >= 5 })
		if got := rec.seqs(); !slices.Equal(got, []int64{1, 2, 3, 4, 5}) {
			t.Errorf("start %d: handled %v, want the two asked back first (1..5)", r, got)
		}
		if err := stop(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestNakFenceStopping: the last nak of nakUnseen is a request whose
// answer the source waits for (nakFenceWait at most) before it pulls, but
// a stop does not wait for it, and a source already stopping still sends
// the nak (a request with a done context would not even be sent).
func TestNakFenceStopping(t *testing.T) {
	_, nc, _, src := createdSource(t, nil)
	got := make(chan string, 4)
	sub, err := nc.Subscribe("fence.test", func(m *natsgo.Msg) { got <- string(m.Data) }) // never answers
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	old := nakFenceWait
	nakFenceWait = time.Hour
	t.Cleanup(func() { nakFenceWait = old })

	stopped, cancel := context.WithCancel(context.Background())
	cancel()
	if err := src.nakFence(stopped, "fence.test", []byte("-NAK")); err != nil {
		t.Fatalf("nak while stopping: %v", err)
	}
	if m := <-got; m != "-NAK" {
		t.Fatalf("sent %q, want -NAK", m)
	}

	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- src.nakFence(ctx, "fence.test", []byte("-NAK")) }()
	<-got // sent, and no answer comes
	stop()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("nak fence after a stop: %v, want context.Canceled (an hour's wait otherwise)", err)
	}
}
