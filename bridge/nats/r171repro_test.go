package nats

// Review R171 reproductions, run with DELAYBRIDGE_R171_REPRO=1. The first
// two fail on the current code (reported, not fixed); the third passes.

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/delaybridge/delaybridge/bridge"
)

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

func TestProbeCaughtUpManyInFlight(t *testing.T) {
	r171Repro(t)
	noNaks := os.Getenv("R171_NONAKS") != ""
	cfg, _, js, src := createdSource(t, func(c *Config) {
		c.AckWait = 2 * time.Minute
		if noNaks {
			c.AckWait = time.Second // as before the naks: back after AckWait
		}
		c.BatchSize = 5
	})
	src.noNaks = noNaks
	const n = 30
	for i := range n {
		publish(t, js, "delay.x", fmt.Sprint(i), nil)
	}
	cons, err := js.Consumer(ctxT(t), cfg.Stream, cfg.Consumer)
	if err != nil {
		t.Fatal(err)
	}
	got, err := cons.Fetch(n, jetstream.FetchMaxWait(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	k := 0
	for range got.Messages() {
		k++
	}
	if k != n {
		t.Fatalf("fetched %d", k)
	}
	h := &caughtUpWatch{recorder: newRecorder(), src: src, seen: -1}
	runSource(t, src, h)
	if !waitUntil(20*time.Second, func() bool { return h.itemCount() >= n }) {
		t.Fatalf("%d of %d", h.itemCount(), n)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	t.Logf("caught up seen closed with %d of %d in-flight messages read", h.seen, n)
	if h.seen >= 0 && h.seen < n {
		t.Errorf("CaughtUp closed after %d of the %d messages in flight at the crash were read", h.seen, n)
	}
}

// TestProbeSharedConsumerOverlap: two bridges (each its own store) on one
// consumer, as when two releases keep the default consumer name.
func TestProbeSharedConsumerOverlap(t *testing.T) {
	r171Repro(t)
	cfg, _, js, srcA := createdSource(t, func(c *Config) { c.AckWait = 2 * time.Minute; c.BatchSize = 1 })
	cfgB := cfg
	ncB := connect(t, cfgB)
	srcB, err := NewSource(ncB, cfgB)
	if err != nil {
		t.Fatal(err)
	}
	a := &holdEach{recorder: newRecorder(), hold: 50 * time.Millisecond}
	b := &holdEach{recorder: newRecorder(), hold: 50 * time.Millisecond}
	runSource(t, srcA, a)
	runSource(t, srcB, b)
	const n = 60
	for i := range n {
		publish(t, js, "delay.x", fmt.Sprint(i), nil)
		time.Sleep(5 * time.Millisecond) // pacing: both instances pulling
	}
	seen := func() (map[int64]int, int) {
		m := map[int64]int{}
		for _, q := range a.seqs() {
			m[q] |= 1
		}
		for _, q := range b.seqs() {
			m[q] |= 2
		}
		both := 0
		for _, v := range m {
			if v == 3 {
				both++
			}
		}
		return m, both
	}
	waitUntil(20*time.Second, func() bool { m, _ := seen(); return len(m) >= n })
	m, both := seen()
	t.Logf("distinct %d of %d; A %d, B %d; taken in by both stores: %d", len(m), n, a.itemCount(), b.itemCount(), both)
	if both > 0 {
		t.Errorf("%d messages taken in by both instances", both)
	}
}

// TestProbeHeldBatchReconnect: a batch held (store down), the pulls'
// messages set aside behind it, the connection cut meanwhile (nothing in
// flight lost), then released: nothing may be nak'd that was received.
func TestProbeHeldBatchReconnect(t *testing.T) {
	r171Repro(t)
	s := startServer(t, jsOptions(t))
	proxy := newFreezeProxy(t, s.Addr().String())
	cfg := testConfig(t, proxy.url())
	cfg.Create = true
	cfg.AckWait = 3 * time.Second // keepAside's marks every second
	cfg.BatchSize = 4             // pulls of 8
	cfg.PullExpiry = time.Minute
	nc := connect(t, cfg)
	src, err := NewSource(nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	pub := newJS(t, connect(t, testConfig(t, serverURL(s))))
	const n = 20
	h, stop := holdFirstBatch(t, src, pub, n)
	defer func() { _ = stop() }()
	eventually(t, "pulls delivered behind the held batch", func() bool {
		return consumerInfo(t, pub, cfg.Stream, cfg.Consumer).NumAckPending >= 8
	})
	time.Sleep(1500 * time.Millisecond) // a keep-alive mark: the pulls' messages set aside
	proxy.cut()
	eventually(t, "reconnected", func() bool { return nc.IsConnected() })
	close(h.release)
	if !waitUntil(20*time.Second, func() bool { return h.itemCount() >= n }) {
		t.Fatalf("%d of %d", h.itemCount(), n)
	}
	ci := consumerInfo(t, pub, cfg.Stream, cfg.Consumer)
	t.Logf("redelivered %d, ack pending %d", ci.NumRedelivered, ci.NumAckPending)
	handedOnce(t, h.recorder, n)
}

func r171Repro(t *testing.T) {
	if os.Getenv("DELAYBRIDGE_R171_REPRO") == "" {
		t.Skip("review R171 reproduction: set DELAYBRIDGE_R171_REPRO=1")
	}
}
