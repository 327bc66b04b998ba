package kafka

import (
	"net"
	"sync/atomic"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/internal/logthrottle"
)

// TestNotReadyLogThrottledAcrossPorts (review R210): "kafka source not
// ready; retrying" was throttled by its error's text, and a broker behind
// a balancer that resets the connection (or a read timeout) names the
// client's ephemeral port, new at each retry: every retry logged its own
// Warn. It is keyed by logthrottle.Shape, as the service's connector, the
// group join's and the offset commit's lines are.
func TestNotReadyLogThrottledAcrossPorts(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	var accepted atomic.Int64
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted.Add(1)
			if tc, ok := c.(*net.TCPConn); ok {
				_ = tc.SetLinger(0) // a reset, not a FIN
			}
			_ = c.Close()
		}
	}()
	core, logs := observer.New(zap.InfoLevel)
	cfg := testConfig(t, []string{ln.Addr().String()}, "g", "delay")
	cfg.Logger = zap.New(core)
	s, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop := runSource(t, s, newMemHandler())
	defer func() { _ = stop() }()
	waitFor(t, "ten connections reset", func() bool { return accepted.Load() >= 10 })
	// Within one interval (30 s), no two lines of one kind.
	seen := map[string]int{}
	var errs []string
	for _, l := range logs.FilterMessage("kafka source not ready; retrying").All() {
		e := l.ContextMap()["error"].(string)
		errs = append(errs, e)
		seen[logthrottle.Shape(e)]++
	}
	for shape, n := range seen {
		if n > 1 {
			t.Fatalf("%d Warn lines of one kind (%q) within 30 s over %d resets, want 1 (errors %q)", n, shape, accepted.Load(), errs)
		}
	}
}
