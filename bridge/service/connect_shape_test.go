package service

import (
	"net"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/internal/logthrottle"
)

// resettingListener accepts connections and resets each (SO_LINGER 0) once
// the client sent its first request: a load balancer or a port-forward
// with no broker behind it. The client's error names its own ephemeral
// port ("read tcp 127.0.0.1:51234->127.0.0.1:9092: read: connection reset
// by peer"), a new one at each attempt.
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
			go func() {
				// The reset waits for the client's first request: reset
				// at once, it came at random at the client's connect
				// ("dial tcp ...: connect: connection reset by peer", no
				// port, the same text each time) or at its first read,
				// and the test waited for two of the latter: 2 s an
				// attempt, 20 s in 1 run of 20, past the 30 s of the
				// throttle (a second Warn) in about 1 of 2 000.
				_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
				_, _ = c.Read(make([]byte, 1))
				if tc, ok := c.(*net.TCPConn); ok {
					_ = tc.SetLinger(0)
				}
				_ = c.Close()
			}()
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
	// Until two attempts failed alike but for a number (the port).
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
