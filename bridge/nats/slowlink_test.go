package nats

import (
	"context"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
)

// slowProxy forwards TCP to target, server->client at about rate bytes a
// second (a slow or distant link to the bridge), client->server at once.
func slowProxy(t *testing.T, target string, rate int) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			// Small socket buffers, so the kernel does not absorb what the
			// slow link has not carried yet.
			s.(*net.TCPConn).SetReadBuffer(64 << 10)
			c.(*net.TCPConn).SetWriteBuffer(64 << 10)
			mu.Lock()
			conns = append(conns, c, s)
			mu.Unlock()
			wg.Add(2)
			go func() { defer wg.Done(); io.Copy(s, c); s.Close() }()
			go func() {
				defer wg.Done()
				defer c.Close()
				buf := make([]byte, 16<<10)
				for {
					n, err := s.Read(buf)
					if n > 0 {
						if _, werr := c.Write(buf[:n]); werr != nil {
							return
						}
						time.Sleep(time.Duration(n) * time.Second / time.Duration(rate))
					}
					if err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}

// TestPullOverSlowLinkNoSlowConsumer (long form: it runs a 4 MB/s link):
// the source's connection goes through a throttling proxy. The server
// closes a client as a slow consumer when its socket write of what it has
// queued for it does not finish within its write deadline (10 s by
// default; 2 s here, with the sizes scaled down by 5). A pull request of
// 64 MiB (a default tried on 2026-11-27) had the server queue the whole
// backlog at once, miss the deadline and close the connection, again and
// again (review R123); the default pull limit (4 MiB) writes in 1 s here.
func TestPullOverSlowLinkNoSlowConsumer(t *testing.T) {
	if os.Getenv("DELAYBRIDGE_LONG") == "" {
		t.Skip("long form: DELAYBRIDGE_LONG=1")
	}
	const (
		n    = 24
		size = 900 << 10
	)
	opts := jsOptions(t)
	opts.WriteDeadline = 2 * time.Second
	srv := startServer(t, opts)
	proxy := slowProxy(t, srv.Addr().String(), 4<<20)
	cfg := testConfig(t, "nats://"+proxy)
	cfg.Create = true
	cfg.AckWait = 30 * time.Second
	nc := connect(t, cfg)
	src, err := NewSource(nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	stop := runSource(t, src, rec)
	defer stop()
	pjs := publisherJS(t, srv)
	h := delayHeader()
	publish(t, pjs, "delay.a", "first", h)
	eventually(t, "first message", func() bool { return rec.itemCount() == 1 })
	body := strings.Repeat("x", size)
	for i := range n {
		if _, err := pjs.PublishMsg(context.Background(), &natsgo.Msg{Subject: "delay.a", Data: []byte(body), Header: h}); err != nil {
			t.Fatalf("publish %d: %v", i, err)
		}
	}
	deadline := time.Now().Add(20 * time.Second)
	for rec.itemCount() < n+1 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if sc := srv.NumSlowConsumers(); sc != 0 || rec.itemCount() < n+1 {
		t.Fatalf("the server closed the bridge's connection as a slow consumer %d times (reconnects %d); %d of %d messages handed over in 20 s",
			sc, nc.Stats().Reconnects, rec.itemCount(), n+1)
	}
}
