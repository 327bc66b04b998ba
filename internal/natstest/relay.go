package natstest

import (
	"bufio"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// Relay is a TCP relay in front of a nats-server that can drop the
// client's publishes to some subjects: requests a server receives and
// never answers (a JetStream request sent while a cluster has no leader
// for it, which no server answers even once one is elected), which a real
// server cannot be made to do on demand.
type Relay struct {
	addr string

	mu      sync.Mutex
	prefix  string // subjects dropped
	left    int    // how many more
	dropped int
}

// NewRelay relays connections to upstream (host:port) until the test
// ends.
func NewRelay(t testing.TB, upstream string) *Relay {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &Relay{addr: l.Addr().String()}
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		_ = l.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", upstream)
			if err != nil {
				_ = c.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, c, s)
			mu.Unlock()
			go func() { _, _ = io.Copy(c, s); _ = c.Close() }()
			go func() { r.relay(c, s); _ = s.Close() }()
		}
	}()
	return r
}

// URL is the relay's client URL.
func (r *Relay) URL() string { return "nats://" + r.addr }

// Drop drops the next n publishes (of every connection) to a subject that
// begins with prefix.
func (r *Relay) Drop(prefix string, n int) {
	r.mu.Lock()
	r.prefix, r.left = prefix, n
	r.mu.Unlock()
}

// Dropped is how many publishes were dropped.
func (r *Relay) Dropped() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.dropped
}

// drop reports whether to drop a publish to subject, counting it.
func (r *Relay) drop(subject string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.left == 0 || !strings.HasPrefix(subject, r.prefix) {
		return false
	}
	r.left--
	r.dropped++
	return true
}

// relay copies the client's protocol lines, and the payloads of PUB and
// HPUB, to the server, but for the publishes dropped.
func (r *Relay) relay(c, s net.Conn) {
	br := bufio.NewReader(c)
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			return
		}
		f := strings.Fields(line)
		var payload []byte
		if len(f) >= 3 && (strings.EqualFold(f[0], "PUB") || strings.EqualFold(f[0], "HPUB")) {
			n, err := strconv.Atoi(f[len(f)-1])
			if err != nil {
				return
			}
			payload = make([]byte, n+2) // and its CRLF
			if _, err := io.ReadFull(br, payload); err != nil {
				return
			}
			if r.drop(f[1]) {
				continue
			}
		}
		if _, err := s.Write(append([]byte(line), payload...)); err != nil {
			return
		}
	}
}
