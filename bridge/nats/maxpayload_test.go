package nats

import (
	"context"
	"strings"
	"testing"

	"github.com/nats-io/nats-server/v2/server"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// A pending message larger than a pull request's byte limit is never
// delivered: the server answers each pull 409 Message Size Exceeds
// MaxBytes, which nats.go retries without an error, and the consumer
// stalls on it, ready and silent (review R121, of a byte-limited pull
// tried on 2026-11-27). The source's pulls have no byte limit; these
// tests keep it so.

// TestPullFitsMessageAfterMaxPayloadRaised: the bridge started against a
// server with max_payload 1 MiB; the operator raises it to 8 MiB and
// restarts the server (same store and address); the bridge reconnects on
// its own, its pull iterator with it. A 6 MiB delayed message published
// then is delivered.
func TestPullFitsMessageAfterMaxPayloadRaised(t *testing.T) {
	opts := jsOptions(t)
	srv := startServer(t, opts)
	cfg := testConfig(t, serverURL(srv))
	cfg.Create = true
	nc := connect(t, cfg)
	rec := runRecorded(t, nc, cfg)
	h := delayHeader()
	publish(t, newJS(t, nc), "delay.a", "small", h)
	count := rec.itemCount
	eventually(t, "first message", func() bool { return count() == 1 })

	srv2 := restartServer(t, srv, opts, 8<<20)
	eventually(t, "reconnect", func() bool { return nc.IsConnected() && nc.MaxPayload() == 8<<20 })
	pjs := publisherJS(t, srv2)
	if _, err := pjs.PublishMsg(context.Background(), &natsgo.Msg{Subject: "delay.a", Data: []byte(strings.Repeat("x", 6<<20)), Header: h}); err != nil {
		t.Fatalf("publish 6 MiB: %v", err)
	}
	publish(t, pjs, "delay.a", "after", h)
	eventually(t, "the 6 MiB message and the one after it", func() bool { return count() == 3 })
}

// TestPullFitsMessageStoredBeforeMaxPayloadLowered: a 6 MiB message
// stored while max_payload was 8 MiB, then the server restarted with
// 1 MiB, and the bridge started against it: the message is delivered.
func TestPullFitsMessageStoredBeforeMaxPayloadLowered(t *testing.T) {
	opts := jsOptions(t)
	opts.MaxPayload, opts.MaxPending = 8<<20, 64<<20
	srv := startServer(t, opts)
	cfg := testConfig(t, serverURL(srv))
	cfg.Create = true
	// The stream and consumer exist before the message (a source that
	// ensures them and stops).
	ensured, err := NewSource(connect(t, cfg), cfg)
	if err != nil {
		t.Fatal(err)
	}
	stopEnsured := runSource(t, ensured, newRecorder())
	pjs := publisherJS(t, srv)
	h := delayHeader()
	eventually(t, "the delay stream", func() bool {
		_, err := pjs.Stream(context.Background(), "DELAY")
		return err == nil
	})
	if err := stopEnsured(); err != nil {
		t.Fatal(err)
	}
	if _, err := pjs.PublishMsg(context.Background(), &natsgo.Msg{Subject: "delay.a", Data: []byte(strings.Repeat("x", 6<<20)), Header: h}); err != nil {
		t.Fatalf("publish 6 MiB: %v", err)
	}
	publish(t, pjs, "delay.a", "after", h)

	srv2 := restartServer(t, srv, opts, 1<<20)
	nc := connect(t, cfg)
	if got := nc.MaxPayload(); got != 1<<20 {
		t.Fatalf("max_payload %d after the restart, want 1 MiB", got)
	}
	_ = srv2
	rec := runRecorded(t, nc, cfg)
	eventually(t, "the 6 MiB message and the one after it", func() bool { return rec.itemCount() == 2 })
}

// runRecorded runs a source on nc with cfg into a recorder until the
// test ends.
func runRecorded(t *testing.T, nc *natsgo.Conn, cfg Config) *recorder {
	t.Helper()
	src, err := NewSource(nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	stop := runSource(t, src, rec)
	t.Cleanup(func() { _ = stop() })
	return rec
}

func delayHeader() natsgo.Header {
	h := natsgo.Header{}
	h.Set("delay-after", "1h")
	h.Set("delay-target", "out")
	return h
}

func (r *recorder) itemCount() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.items)
}

// restartServer shuts srv down and starts it again on the same port and
// store with max_payload maxPayload.
func restartServer(t *testing.T, srv *server.Server, opts *server.Options, maxPayload int32) *server.Server {
	t.Helper()
	port := srv.Addr().(interface{ String() string }).String()
	srv.Shutdown()
	srv.WaitForShutdown()
	o := *opts
	_, p, _ := strings.Cut(port, "127.0.0.1:")
	o.Port = 0
	for _, c := range p {
		o.Port = o.Port*10 + int(c-'0')
	}
	o.MaxPayload, o.MaxPending = maxPayload, 64<<20
	return startServer(t, &o)
}

// publisherJS is a JetStream client of its own for srv.
func publisherJS(t *testing.T, srv *server.Server) jetstream.JetStream {
	t.Helper()
	pub, err := natsgo.Connect(serverURL(srv))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pub.Close)
	js, err := jetstream.New(pub)
	if err != nil {
		t.Fatal(err)
	}
	return js
}
