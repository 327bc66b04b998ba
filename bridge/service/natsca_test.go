package service

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"
	natsgo "github.com/nats-io/nats.go"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/internal/testcert"
)

// TestNATSServerCARotated is TestKafkaServerCARotated for NATS: the
// server's certificate moves to a new CA (a restart on the same port and
// store), first the safe way (ca_file holds the old and the new CA, then
// the new one alone), then the wrong way (the server moves to a CA not yet
// in ca_file).
func TestNATSServerCARotated(t *testing.T) {
	ca1, ca2, ca3 := testcert.NewCA(t, "CA 1"), testcert.NewCA(t, "CA 2"), testcert.NewCA(t, "CA 3")
	port, store := freePort(t), t.TempDir()
	start := func(ca *testcert.CA) *natsserver.Server {
		cert := ca.Issue(t, "nats", x509.ExtKeyUsageServerAuth, "127.0.0.1").TLS()
		return startNATSServer(t, &natsserver.Options{Port: port, StoreDir: store, TLS: true,
			TLSConfig: &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}})
	}
	ns := start(ca1)
	restart := func(ca *testcert.CA) {
		ns.Shutdown()
		ns.WaitForShutdown()
		ns = start(ca)
	}
	caFile := filepath.Join(t.TempDir(), "ca.crt")
	testcert.ReplaceFile(t, caFile, ca1.CertPEM())
	h := startH160NATS(t, fmt.Sprintf("tls://127.0.0.1:%d", port), fmt.Sprintf("  tls: {enabled: true, ca_file: %q}", caFile),
		natsgo.Secure(&tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS12})) //nolint:gosec // the test's own client
	h.publish("delay.a", "before", "1m")
	eventually(t, "ingest", func() bool { return h.svc.Engine().Stats().Pending >= 1 })

	warns := func(since time.Time) (n int, msgs map[string]int) {
		msgs = map[string]int{}
		for _, e := range h.logs.All() {
			if e.Time.After(since) && e.Level >= zap.WarnLevel {
				n++
				msgs[e.Message]++
			}
		}
		return n, msgs
	}

	// 1. ca_file: old + new; the server restarts with the new CA's certificate.
	testcert.ReplaceFile(t, caFile, append(ca1.CertPEM(), ca2.CertPEM()...))
	stop := watchReady(h.svc)
	t0 := time.Now()
	restart(ca2)
	h.publish("delay.b", "bundle", "1m")
	h.awaitDelivered("before", "bundle")
	reasons, down := stop()
	n, msgs := warns(t0)
	t.Logf("phase 1 (old+new CA in the file, server on the new one): delivered %v in %v; not ready for %v: %q; warn lines %d %v",
		h.got, time.Since(t0), down, reasons, n, msgs)

	// 2. ca_file: the new CA alone; the server restarts again.
	testcert.ReplaceFile(t, caFile, ca2.CertPEM())
	stop = watchReady(h.svc)
	t0 = time.Now()
	restart(ca2)
	h.publish("delay.c", "new-only", "1m")
	h.awaitDelivered("before", "bundle", "new-only")
	reasons, down = stop()
	n, msgs = warns(t0)
	t.Logf("phase 2 (new CA alone in the file): delivered in %v; not ready for %v: %q; warn lines %d %v",
		time.Since(t0), down, reasons, n, msgs)

	// 3. The wrong order: the server moves to CA 3 before the file does.
	h.publish("delay.d", "pending", "1m")
	eventually(t, "ingest", func() bool { return h.svc.Engine().Stats().Pending >= 1 })
	stop = watchReady(h.svc)
	brokenAt := time.Now()
	restart(ca3)
	eventually(t, "not ready with an unknown CA", func() bool { return h.svc.Ready() != nil })
	t.Logf("phase 3: not ready %v after the restart: %v", time.Since(brokenAt), h.svc.Ready())
	h.publish("delay.e", "during", "1m")
	h.clk.Advance(2 * time.Minute)
	eventually(t, "readiness naming the TLS failure", func() bool {
		err := h.svc.Ready()
		return err != nil && strings.Contains(err.Error(), "nats target unavailable") && strings.Contains(err.Error(), "tls")
	})
	t.Logf("phase 3: readiness %v after the restart: %v", time.Since(brokenAt), h.svc.Ready())
	warnBroken, msgs := warns(brokenAt)
	t.Logf("phase 3: while broken %v: %d warn+ lines %v", time.Since(brokenAt), warnBroken, msgs)
	testcert.ReplaceFile(t, caFile, append(ca2.CertPEM(), ca3.CertPEM()...))
	fixedAt := time.Now()
	h.awaitDelivered("before", "bundle", "new-only", "pending", "during")
	eventually(t, "ready after ca_file caught up", func() bool { return h.svc.Ready() == nil })
	reasons, down = stop()
	t.Logf("phase 3: delivered and ready %v after ca_file caught up; not ready for %v in all: %q", time.Since(fixedAt), down, reasons)
	h.dumpLogs(brokenAt, zap.NewAtomicLevelAt(zap.InfoLevel))
	if warnBroken > 40 {
		t.Errorf("%d warn+ lines in %v while refused: a log storm", warnBroken, fixedAt.Sub(brokenAt))
	}
	select {
	case err := <-h.done:
		t.Fatalf("bridge exited: %v", err)
	default:
	}
}
