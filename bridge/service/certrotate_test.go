package service

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	natsserver "github.com/nats-io/nats-server/v2/server"
	"go.uber.org/zap/zaptest"

	"github.com/delaybridge/delaybridge/internal/testcert"
	"github.com/delaybridge/delaybridge/internal/testlog"
)

func writeTestFile(t *testing.T, path string, data []byte) {
	t.Helper()
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
}

// TestClientCertRotationReachesTheBridge is the Helm chart's mTLS setup
// (secrets.natsTlsCert/Key, e.g. a cert-manager Secret): the kubelet
// updates the mounted files when the Secret is renewed, and the broker stops
// taking the old certificate (it expired, or the client CA was rotated).
// The bridge must reconnect with the certificate now in cert_file/key_file;
// nothing restarts it (/healthz stays 200 through a broker outage).
func TestClientCertRotationReachesTheBridge(t *testing.T) {
	m := newMTLSNATS(t)
	ns := m.start(t, m.clientCA1.Pool)

	yml := fmt.Sprintf(`
data_dir: %q
nats:
  url: tls://127.0.0.1:%d
  create: true
  tls: {enabled: true, ca_file: %q, cert_file: %q, key_file: %q}
  sources:
    - {subject: "delay.>", dlq: dlq.delay}
targets:
  allow: ["*"]
admin:
  listen: "127.0.0.1:0"
`, t.TempDir(), m.port, m.caFile, m.certFile, m.keyFile)
	svc, _, _ := runYAML(t, yml, Options{Logger: testlog.New(t, zaptest.Level(testLogLevel())), NATS: fastNATS})
	eventually(t, "ready with the first certificate", func() bool { return svc.Ready() == nil })

	// The Secret is renewed: new files; the server now takes only them.
	m.renew(t)
	ns.Shutdown()
	ns.WaitForShutdown()
	m.start(t, m.clientCA2.Pool)
	defer func() {
		if t.Failed() {
			t.Logf("readiness: %v", svc.Ready())
		}
	}()

	eventually(t, "ready again with the renewed certificate", func() bool { return svc.Ready() == nil })
	if err := svc.Live(); err != nil {
		t.Fatalf("live: %v", err)
	}
}

// mtlsNATS is a NATS server set up for mutual TLS on a fixed port and
// store (so it can be restarted with other client CAs), and the bridge's
// TLS files: the server CA, and a client certificate of clientCA1.
type mtlsNATS struct {
	serverCA, clientCA1, clientCA2 *testcert.CA
	srvCert                        tls.Certificate
	caFile, certFile, keyFile      string
	port                           int
	store                          string
}

func newMTLSNATS(t *testing.T) *mtlsNATS {
	t.Helper()
	m := &mtlsNATS{serverCA: testcert.NewCA(t, "server CA"), clientCA1: testcert.NewCA(t, "client CA 1"), clientCA2: testcert.NewCA(t, "client CA 2")}
	m.srvCert = m.serverCA.Issue(t, "nats", x509.ExtKeyUsageServerAuth, "127.0.0.1").TLS()
	dir := t.TempDir()
	m.caFile, m.certFile, m.keyFile = filepath.Join(dir, "ca.crt"), filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	writeTestFile(t, m.caFile, m.serverCA.CertPEM())
	c1 := m.clientCA1.Issue(t, "bridge", x509.ExtKeyUsageClientAuth)
	writeTestFile(t, m.certFile, c1.CertPEM())
	writeTestFile(t, m.keyFile, c1.KeyPEM(t))
	m.port, m.store = freePort(t), t.TempDir()
	return m
}

// start starts the server, taking the client certificates clients issued.
func (m *mtlsNATS) start(t *testing.T, clients *x509.CertPool) *natsserver.Server {
	t.Helper()
	return startNATSServer(t, &natsserver.Options{Port: m.port, StoreDir: m.store, TLS: true, TLSVerify: true,
		TLSConfig: &tls.Config{Certificates: []tls.Certificate{m.srvCert}, ClientAuth: tls.RequireAndVerifyClientCert,
			ClientCAs: clients, MinVersion: tls.VersionTLS12}})
}

// renew writes a client certificate of clientCA2 to the bridge's files.
func (m *mtlsNATS) renew(t *testing.T) {
	t.Helper()
	c2 := m.clientCA2.Issue(t, "bridge", x509.ExtKeyUsageClientAuth)
	writeTestFile(t, m.certFile, c2.CertPEM())
	writeTestFile(t, m.keyFile, c2.KeyPEM(t))
}
