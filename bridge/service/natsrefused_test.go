package service

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/internal/clock"
	"github.com/delaybridge/delaybridge/internal/testcert"
)

// h160NATS runs a NATS-only bridge against ns (users given by
// the caller), a test connection opened by testConn, and gives helpers.
type h160NATS struct {
	t     *testing.T
	clk   *clock.Fake
	svc   *Service
	done  <-chan error
	logs  *observer.ObservedLogs
	js    jetstream.JetStream
	got   map[string]int
	msgCh chan string
}

func startH160NATS(t *testing.T, url string, authYAML string, testOpts ...natsgo.Option) *h160NATS {
	h := &h160NATS{t: t, clk: clock.NewFake(time.Now()), got: map[string]int{}, msgCh: make(chan string, 100)}
	nc, err := natsgo.Connect(url, append(testOpts, natsgo.MaxReconnects(-1), natsgo.ReconnectWait(50*time.Millisecond))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	h.js, err = jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := h.js.CreateStream(ctx, jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.>"}}); err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.DebugLevel)
	h.logs = logs
	yml := fmt.Sprintf(`
data_dir: %q
nats:
  url: %q
  stream: DELAY
  consumer: bridge
  create: true
%s
  sources:
    - {subject: "delay.>", dlq: dlq.delay}
targets:
  allow: ["*"]
retry: {initial: 1s, max: 4s, multiplier: 2, jitter: 0.1, max_attempts: 3}
admin:
  listen: "127.0.0.1:0"
`, t.TempDir(), url, authYAML)
	h.svc, _, h.done = runYAML(t, yml, Options{Logger: zap.New(core), Clock: h.clk})
	eventually(t, "ready", func() bool { return h.svc.Ready() == nil })
	cons, err := h.js.OrderedConsumer(ctx, "ORDERS", jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	cc, err := cons.Consume(func(m jetstream.Msg) { h.msgCh <- string(m.Data()) })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cc.Stop)
	return h
}

func (h *h160NATS) publish(subject, value, after string) {
	h.t.Helper()
	m := natsgo.NewMsg(subject)
	m.Data = []byte(value)
	m.Header.Set("delay-after", after)
	m.Header.Set("delay-target", "orders."+value)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := h.js.PublishMsg(ctx, m); err != nil {
		h.t.Fatalf("publish: %v", err)
	}
}

func (h *h160NATS) dumpLogs(since time.Time, minLevel zap.AtomicLevel) {
	for _, e := range h.logs.All() {
		if e.Time.After(since) && minLevel.Enabled(e.Level) {
			h.t.Logf("LOG %s %s %s %v", e.Time.Format("15:04:05.000"), e.Level, e.Message, e.ContextMap())
		}
	}
}

// awaitDelivered advances the clock until every value is delivered, then
// checks none twice.
func (h *h160NATS) awaitDelivered(values ...string) {
	h.t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	missing := func() bool {
		for _, v := range values {
			if h.got[v] == 0 {
				return true
			}
		}
		return false
	}
	for missing() {
		if time.Now().After(deadline) {
			h.t.Fatalf("not delivered: got %v; readiness %v", h.got, h.svc.Ready())
		}
		h.clk.Advance(time.Second)
		select {
		case v := <-h.msgCh:
			h.got[v]++
		case <-time.After(200 * time.Millisecond):
		}
	}
	time.Sleep(300 * time.Millisecond)
	for len(h.msgCh) > 0 {
		h.got[<-h.msgCh]++
	}
	for v, n := range h.got {
		if n != 1 {
			h.t.Errorf("%s delivered %d times", v, n)
		}
	}
}

// TestNATSPasswordChangedOnServerFirst: the server's password for the
// bridge changes (reload) before the mounted file does.
func TestNATSPasswordChangedOnServerFirst(t *testing.T) {
	users := func(pw string) []*natsserver.User {
		return []*natsserver.User{{Username: "bridge", Password: pw}, {Username: "test", Password: "test-pw"}}
	}
	opts := &natsserver.Options{Users: users("pw-1")}
	ns := startNATSServer(t, opts)
	passFile := filepath.Join(t.TempDir(), "pw")
	testcert.ReplaceFile(t, passFile, []byte("pw-1\n"))
	h := startH160NATS(t, ns.ClientURL(), fmt.Sprintf("  user: bridge\n  password_file: %q", passFile), natsgo.UserInfo("test", "test-pw"))

	h.publish("delay.a", "before", "1m")
	eventually(t, "ingest", func() bool { return h.svc.Engine().Stats().Pending >= 1 })

	next := *opts
	next.Users = users("pw-2")
	if err := ns.ReloadOptions(&next); err != nil {
		t.Fatal(err)
	}
	eventually(t, "not ready", func() bool { return h.svc.Ready() != nil })
	h.publish("delay.b", "during", "1m")
	h.clk.Advance(2 * time.Minute)
	eventually(t, "readiness naming the refusal", func() bool {
		err := h.svc.Ready()
		return err != nil && strings.Contains(err.Error(), "last attempt: nats: Authorization Violation") && strings.Contains(err.Error(), "nats target unavailable")
	})

	testcert.ReplaceFile(t, passFile, []byte("pw-2\n"))
	fixedAt := time.Now()
	h.awaitDelivered("before", "during")
	t.Logf("delivered %v %v after the file changed", h.got, time.Since(fixedAt))
	eventually(t, "ready", func() bool { return h.svc.Ready() == nil })
	t.Logf("ready %v after the file changed", time.Since(fixedAt))
	h.dumpLogs(fixedAt, zap.NewAtomicLevelAt(zap.InfoLevel))
}

// TestNATSClientCertRefusedThenRenewed: the server stops taking the bridge's
// client certificate (its CA rotated, as when a certificate expired and
// the issuer changed) before the mounted files are renewed.
func TestNATSClientCertRefusedThenRenewed(t *testing.T) {
	m := newMTLSNATS(t)
	testCert := m.clientCA2.Issue(t, "test", x509.ExtKeyUsageClientAuth)
	both := x509.NewCertPool()
	both.AppendCertsFromPEM(m.clientCA1.CertPEM())
	both.AppendCertsFromPEM(m.clientCA2.CertPEM())
	ns := m.start(t, both)
	tlsYAML := fmt.Sprintf("  tls: {enabled: true, ca_file: %q, cert_file: %q, key_file: %q}", m.caFile, m.certFile, m.keyFile)
	h := startH160NATS(t, fmt.Sprintf("tls://127.0.0.1:%d", m.port), tlsYAML,
		natsgo.Secure(&tls.Config{RootCAs: m.serverCA.Pool, Certificates: []tls.Certificate{testCert.TLS()}, MinVersion: tls.VersionTLS12}))
	h.publish("delay.a", "before", "1m")
	eventually(t, "ingest", func() bool { return h.svc.Engine().Stats().Pending >= 1 })

	// The server restarts taking only the new CA's certificates... and
	// the test's own (issued by CA 1) through a pool with both.
	ns.Shutdown()
	ns.WaitForShutdown()
	m.start(t, m.clientCA2.Pool)
	eventually(t, "not ready", func() bool { return h.svc.Ready() != nil })
	h.clk.Advance(2 * time.Minute)
	eventually(t, "readiness naming the refusal", func() bool {
		err := h.svc.Ready()
		return err != nil && strings.Contains(err.Error(), "last attempt: nats: tls error") && strings.Contains(err.Error(), "nats target unavailable")
	})

	m.renew(t)
	fixedAt := time.Now()
	defer func() {
		if t.Failed() {
			t.Logf("readiness: %v", h.svc.Ready())
			h.dumpLogs(fixedAt, zap.NewAtomicLevelAt(zap.DebugLevel))
		}
	}()
	h.awaitDelivered("before")
	eventually(t, "ready", func() bool { return h.svc.Ready() == nil })
	t.Logf("ready %v after the files changed", time.Since(fixedAt))
	h.dumpLogs(fixedAt, zap.NewAtomicLevelAt(zap.InfoLevel))
}
