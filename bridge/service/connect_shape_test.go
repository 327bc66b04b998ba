package service

import (
	"net"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/internal/logthrottle"
)

// resettingListener accepts connections and resets each at once (SO_LINGER
// 0): a load balancer or a port-forward with no broker behind it. The
// client's error names its own ephemeral port ("read tcp
// 127.0.0.1:51234->127.0.0.1:9092: read: connection reset by peer"), a
// new one at each attempt.
func resettingListener(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			if tc, ok := c.(*net.TCPConn); ok {
				_ = tc.SetLinger(0)
			}
			_ = c.Close()
		}
	}()
	return ln.Addr().String()
}

// TestConnectWarnThrottledAcrossPorts: the connector's "brokers
// unreachable; retrying" Warn was throttled by the error's text, and a
// connection reset (or a read timeout) names the client's ephemeral port,
// new at each attempt: every attempt made its own key and its own Warn,
// one every 2 s while firing is paused at start, as before the throttle
// (hunt H198). The key is the error's shape (numbers aside), as the
// sources' retry lines are keyed.
func TestConnectWarnThrottledAcrossPorts(t *testing.T) {
	e := newEnv(t, "catch_up_wait: 10m\n")
	e.kafkaAddr = resettingListener(t)
	core, logs := observer.New(zap.DebugLevel)
	e.runWith(Options{Logger: zap.New(core)})
	// Until two attempts failed alike but for a number (the port): the
	// reset comes at the dial or at the first read, two kinds of error.
	var errs []string
	warns := 0
	eventually(t, "two connect attempts to the resetting Kafka failing alike", func() bool {
		errs, warns = errs[:0], 0
		for _, l := range logs.FilterMessage("brokers unreachable; retrying").FilterField(zap.String("transport", "kafka")).All() {
			errs = append(errs, l.ContextMap()["error"].(string))
			if l.Level == zap.WarnLevel {
				warns++
			}
		}
		texts, shapes := map[string]bool{}, map[string]bool{}
		for _, s := range errs {
			texts[s], shapes[logthrottle.Shape(s)] = true, true
		}
		return len(shapes) < len(texts)
	})
	shapes := map[string]bool{}
	for _, s := range errs {
		shapes[logthrottle.Shape(s)] = true
	}
	if warns != len(shapes) {
		t.Fatalf("%d Warn lines for %d failed attempts of %d kinds (errors %q); want one a kind (then one per %v)",
			warns, len(errs), len(shapes), errs, logthrottle.DefaultEvery)
	}
}
