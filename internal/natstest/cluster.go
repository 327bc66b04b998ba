// Package natstest runs a real nats-server JetStream cluster in the test
// process, for tests of what a clustered NATS does that one server does
// not: replicated streams, leader changes, a lost quorum.
package natstest

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
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
// leader. They are shut down when the test ends. The ports are picked
// free and then bound by the servers, so another process may take one in
// between (parallel test packages do): a cluster that does not come up is
// started again on new ports, up to three times.
func StartCluster(t testing.TB, n int) *Cluster {
	t.Helper()
	var err error
	for range 3 {
		c := &Cluster{t: t, servers: make([]*natsserver.Server, n)}
		c.opts = clusterOptions(t, n)
		t.Cleanup(func() {
			for i := range n {
				c.Stop(i)
			}
		})
		if err = c.startAll(); err == nil {
			if err = c.waitMeta(); err == nil {
				return c
			}
		}
		for i := range n {
			c.Stop(i)
		}
	}
	t.Fatalf("nats cluster: %v", err)
	return nil
}

func clusterOptions(t testing.TB, n int) []*natsserver.Options {
	routes := make([]string, n)
	cports := make([]int, n)
	for i := range n {
		cports[i] = FreePort(t)
		routes[i] = "nats://127.0.0.1:" + strconv.Itoa(cports[i])
	}
	opts := make([]*natsserver.Options, n)
	for i := range n {
		opts[i] = &natsserver.Options{
			ServerName: fmt.Sprintf("S%d", i+1),
			Host:       "127.0.0.1",
			Port:       FreePort(t),
			JetStream:  true,
			StoreDir:   t.TempDir(),
			NoSigs:     true,
			NoLog:      true,
			Cluster:    natsserver.ClusterOpts{Name: "C1", Host: "127.0.0.1", Port: cports[i]},
			Routes:     natsserver.RoutesFromStr(strings.Join(routes, ",")),
		}
	}
	return opts
}

func (c *Cluster) startAll() error {
	for i := range c.opts {
		if err := c.start(i); err != nil {
			return err
		}
	}
	return nil
}

// Start starts server i (again).
func (c *Cluster) Start(i int) {
	c.t.Helper()
	if err := c.start(i); err != nil {
		c.t.Fatal(err)
	}
}

func (c *Cluster) start(i int) error {
	s, err := natsserver.NewServer(c.opts[i].Clone())
	if err != nil {
		return fmt.Errorf("nats server %d: %w", i, err)
	}
	go s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		s.Shutdown()
		return fmt.Errorf("nats server %d not ready on ports %d/%d (taken meanwhile?)", i, c.opts[i].Port, c.opts[i].Cluster.Port)
	}
	c.mu.Lock()
	c.servers[i] = s
	c.mu.Unlock()
	return nil
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
	if err := c.waitMeta(); err != nil {
		c.t.Fatal(err)
	}
}

func (c *Cluster) waitMeta() error {
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if c.find(func(s *natsserver.Server) bool { return s.JetStreamIsLeader() }) >= 0 {
			return nil
		}
	}
	return errors.New("nats cluster: no JetStream meta leader within 20 s")
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

// FreePort is a TCP port on 127.0.0.1 free when picked, for a broker a test
// stops and starts again on the same port.
func FreePort(t testing.TB) int {
	t.Helper()
	// Below the kernel's ephemeral range, which every listener on port 0
	// and every outgoing connection of the tests running beside (other
	// packages' brokers and clients) draws from: a port from there, free
	// when picked, was taken by one of those while its server was stopped
	// for 17 s (TestNATSRestartedBridgeAfterQuorum, under load). A port
	// below it is only taken by a listener that asks for it.
	if lo := ephemeralLow(); lo > 2048 {
		for range 64 {
			port := 1024 + rand.IntN(lo-1024)
			if l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port)); err == nil {
				l.Close()
				return port
			}
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// ephemeralLow is the first port of the kernel's ephemeral range (Linux:
// /proc/sys/net/ipv4/ip_local_port_range), 0 if unknown.
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return 0
	}
	lo, err := strconv.Atoi(f[0])
	if err != nil {
		return 0
	}
	return lo
}

// MetaLeader is the index of the running server that is the JetStream
// meta leader, -1 if none.
func (c *Cluster) MetaLeader() int {
	return c.find(func(s *natsserver.Server) bool { return s.JetStreamIsLeader() })
}

// Wipe removes stopped server i's store directory, as a server that lost
// its disk: started again, it catches up from the others.
func (c *Cluster) Wipe(i int) {
	c.t.Helper()
	if c.server(i) != nil {
		c.t.Fatalf("nats cluster: wipe server %d while it runs", i)
	}
	if err := os.RemoveAll(c.opts[i].StoreDir); err != nil {
		c.t.Fatalf("nats cluster: wipe server %d: %v", i, err)
	}
}

// Name is server i's name (its JetStream peer name in stream and consumer
// infos).
func (c *Cluster) Name(i int) string { return c.opts[i].ServerName }

// Isolate cuts server i off the other running servers, as a network
// partition does, while its clients stay connected to it: its
// configuration is reloaded without its routes and theirs without the
// route to it, which closes the routes between them and keeps them from
// connecting again. It returns once none is left. A server started
// (again) meanwhile has every route and connects to i: Rejoin first.
func (c *Cluster) Isolate(i int) {
	c.t.Helper()
	if err := c.setRoutes(i, false); err != nil {
		c.t.Fatal(err)
	}
	for deadline := time.Now().Add(20 * time.Second); c.routesTo(i) > 0; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			c.t.Fatalf("nats cluster: server %d still routed to %d other servers 20 s after its isolation", i, c.routesTo(i))
		}
	}
}

// Rejoin gives the running servers their routes again after
// Isolate(i): they connect to i again (and i to them).
func (c *Cluster) Rejoin(i int) {
	c.t.Helper()
	if err := c.setRoutes(i, true); err != nil {
		c.t.Fatal(err)
	}
}

func (c *Cluster) setRoutes(i int, joined bool) error {
	port := strconv.Itoa(c.opts[i].Cluster.Port)
	for j := range c.opts {
		s := c.server(j)
		if s == nil {
			continue
		}
		o := c.opts[j].Clone()
		if !joined {
			o.Routes = nil
			if j != i {
				for _, r := range c.opts[j].Routes {
					if r.Port() != port {
						o.Routes = append(o.Routes, r)
					}
				}
			}
		}
		if err := s.ReloadOptions(o); err != nil {
			return fmt.Errorf("nats server %d: reload its routes: %w", j, err)
		}
	}
	return nil
}

// routesTo counts the running servers routed to server i (i itself if it
// has any route).
func (c *Cluster) routesTo(i int) int {
	n := 0
	si := c.server(i)
	if si == nil {
		return 0
	}
	if si.NumRoutes() > 0 {
		n++
	}
	id := si.ID()
	for j := range c.opts {
		s := c.server(j)
		if j == i || s == nil {
			continue
		}
		rz, err := s.Routez(&natsserver.RoutezOptions{})
		if err != nil {
			continue
		}
		for _, r := range rz.Routes {
			if r.RemoteID == id {
				n++
				break
			}
		}
	}
	return n
}

func (c *Cluster) server(i int) *natsserver.Server {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.servers[i]
}
