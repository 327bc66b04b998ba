// Package natstest runs a real nats-server JetStream cluster in the test
// process, for tests of what a clustered NATS does that one server does
// not: replicated streams, leader changes, a lost quorum.
package natstest

import (
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"
)

// Cluster is n nats-servers with JetStream, routed to each other, each on
// fixed ports (so a server stopped and started again keeps its URL) and
// its own store directory (kept across a restart).
type Cluster struct {
	t       testing.TB
	opts    []*natsserver.Options
	mu      sync.Mutex
	servers []*natsserver.Server
}

// StartCluster starts n servers and waits until JetStream has a meta
// leader. They are shut down when the test ends.
func StartCluster(t testing.TB, n int) *Cluster {
	t.Helper()
	c := &Cluster{t: t, servers: make([]*natsserver.Server, n)}
	routes := make([]string, n)
	cports := make([]int, n)
	for i := range n {
		cports[i] = freePort(t)
		routes[i] = "nats://127.0.0.1:" + strconv.Itoa(cports[i])
	}
	for i := range n {
		c.opts = append(c.opts, &natsserver.Options{
			ServerName: fmt.Sprintf("S%d", i+1),
			Host:       "127.0.0.1",
			Port:       freePort(t),
			JetStream:  true,
			StoreDir:   t.TempDir(),
			NoSigs:     true,
			NoLog:      true,
			Cluster:    natsserver.ClusterOpts{Name: "C1", Host: "127.0.0.1", Port: cports[i]},
			Routes:     natsserver.RoutesFromStr(strings.Join(routes, ",")),
		})
	}
	t.Cleanup(func() {
		for i := range n {
			c.Stop(i)
		}
	})
	for i := range n {
		c.Start(i)
	}
	c.WaitMeta()
	return c
}

// Start starts server i (again).
func (c *Cluster) Start(i int) {
	c.t.Helper()
	s, err := natsserver.NewServer(c.opts[i].Clone())
	if err != nil {
		c.t.Fatalf("nats server %d: %v", i, err)
	}
	go s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		c.t.Fatalf("nats server %d not ready", i)
	}
	c.mu.Lock()
	c.servers[i] = s
	c.mu.Unlock()
}

// Stop shuts server i down and waits until it is.
func (c *Cluster) Stop(i int) {
	c.mu.Lock()
	s := c.servers[i]
	c.servers[i] = nil
	c.mu.Unlock()
	if s != nil {
		s.Shutdown()
		s.WaitForShutdown()
	}
}

// URL is server i's client URL.
func (c *Cluster) URL(i int) string { return "nats://127.0.0.1:" + strconv.Itoa(c.opts[i].Port) }

// URLs is every server's client URL, comma-separated.
func (c *Cluster) URLs() string {
	u := make([]string, len(c.opts))
	for i := range c.opts {
		u[i] = c.URL(i)
	}
	return strings.Join(u, ",")
}

// WaitMeta waits (up to 20 s) until a running server is the JetStream
// meta leader.
func (c *Cluster) WaitMeta() {
	c.t.Helper()
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		c.mu.Lock()
		ok := false
		for _, s := range c.servers {
			if s != nil && s.JetStreamIsLeader() {
				ok = true
			}
		}
		c.mu.Unlock()
		if ok {
			return
		}
	}
	c.t.Fatal("nats cluster: no JetStream meta leader within 20 s")
}

// StreamLeader is the index of the server leading stream (account $G),
// -1 if none.
func (c *Cluster) StreamLeader(stream string) int {
	return c.find(func(s *natsserver.Server) bool {
		return s.JetStreamIsStreamLeader(natsserver.DEFAULT_GLOBAL_ACCOUNT, stream)
	})
}

// ConsumerLeader is the index of the server leading the consumer, -1 if
// none.
func (c *Cluster) ConsumerLeader(stream, consumer string) int {
	return c.find(func(s *natsserver.Server) bool {
		return s.JetStreamIsConsumerLeader(natsserver.DEFAULT_GLOBAL_ACCOUNT, stream, consumer)
	})
}

// ServerOf is the index of the server that has a client connection named
// name, -1 if none.
func (c *Cluster) ServerOf(name string) int {
	return c.find(func(s *natsserver.Server) bool {
		cz, err := s.Connz(&natsserver.ConnzOptions{})
		if err != nil {
			return false
		}
		for _, ci := range cz.Conns {
			if ci.Name == name {
				return true
			}
		}
		return false
	})
}

func (c *Cluster) find(pred func(*natsserver.Server) bool) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, s := range c.servers {
		if s != nil && pred(s) {
			return i
		}
	}
	return -1
}

func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}
