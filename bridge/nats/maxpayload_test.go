package nats

import (
	"context"
	"strings"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// TestPullFitsMessageAfterMaxPayloadRaised: the bridge started against a
// server with the default max_payload (1 MiB); the operator raises
// max_payload to 8 MiB and restarts the server (same store, same
// address); the bridge reconnects on its own. A publisher then sends a
// 6 MiB delayed message, which the server accepts. The source's pull
// requests still ask for at most pullBytes(4 MiB, 1 MiB) = 4 MiB, so the
// server answers each with 409 Message Size Exceeds MaxBytes (which
// nats.go swallows) and the message is never handed over: the consumer
// stalls on it, and on everything behind it.
func TestPullFitsMessageAfterMaxPayloadRaised(t *testing.T) {
	opts := jsOptions(t)
	srv := startServer(t, opts)
	cfg := testConfig(t, serverURL(srv))
	cfg.Create = true
	nc := connect(t, cfg)
	src, err := NewSource(nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	stop := runSource(t, src, rec)
	defer stop()
	js := newJS(t, nc)
	h := natsgo.Header{}
	h.Set("delay-after", "1h")
	h.Set("delay-target", "out")
	publish(t, js, "delay.a", "small", h)
	count := func() int { rec.mu.Lock(); defer rec.mu.Unlock(); return len(rec.items) }
	eventually(t, "first message", func() bool { return count() == 1 })
	t.Logf("max_payload seen by the bridge: %d", nc.MaxPayload())

	// Restart the server with max_payload 8 MiB on the same port and store.
	tcp := srv.Addr().String()
	srv.Shutdown()
	srv.WaitForShutdown()
	opts2 := *opts
	_, p, _ := strings.Cut(tcp, "127.0.0.1:")
	var portN int
	for _, c := range p {
		portN = portN*10 + int(c-'0')
	}
	opts2.Port = portN
	opts2.MaxPayload = 8 << 20
	opts2.MaxPending = 64 << 20
	srv2 := startServer(t, &opts2)
	eventually(t, "reconnect", func() bool { return nc.IsConnected() && nc.MaxPayload() == 8<<20 })
	t.Logf("after reconnect: max_payload %d", nc.MaxPayload())

	pub, err := natsgo.Connect(serverURL(srv2))
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	pjs, _ := jetstream.New(pub)
	big := strings.Repeat("x", 6<<20)
	if _, err := pjs.PublishMsg(context.Background(), &natsgo.Msg{Subject: "delay.a", Data: []byte(big), Header: h}); err != nil {
		t.Fatalf("publish 6 MiB: %v", err)
	}
	publish(t, pjs, "delay.a", "after", h)
	deadline := time.Now().Add(15 * time.Second)
	for count() < 3 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("source health during the stall: %v", src.Health())
	if got := count(); got != 3 {
		t.Fatalf("%d of 3 messages handed over 15 s after a 6 MiB message (server max_payload now %d): the consumer is stalled",
			got, nc.MaxPayload())
	}
}
