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
	serverCA, clientCA1, clientCA2 := testcert.NewCA(t, "server CA"), testcert.NewCA(t, "client CA 1"), testcert.NewCA(t, "client CA 2")
	srvCert := serverCA.Issue(t, "nats", x509.ExtKeyUsageServerAuth, "127.0.0.1").TLS()
	dir := t.TempDir()
	caFile, certFile, keyFile := filepath.Join(dir, "ca.crt"), filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	writeTestFile(t, caFile, serverCA.CertPEM())
	c1 := clientCA1.Issue(t, "bridge", x509.ExtKeyUsageClientAuth)
	writeTestFile(t, certFile, c1.CertPEM())
	writeTestFile(t, keyFile, c1.KeyPEM(t))

	port, store := freePort(t), t.TempDir()
	start := func(clients *x509.CertPool) *natsserver.Server {
		return startNATSServer(t, &natsserver.Options{Port: port, StoreDir: store, TLS: true, TLSVerify: true,
			TLSConfig: &tls.Config{Certificates: []tls.Certificate{srvCert}, ClientAuth: tls.RequireAndVerifyClientCert,
				ClientCAs: clients, MinVersion: tls.VersionTLS12}})
	}
	ns := start(clientCA1.Pool)

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
`, t.TempDir(), port, caFile, certFile, keyFile)
	svc, _, _ := runYAML(t, yml, Options{Logger: testlog.New(t, zaptest.Level(testLogLevel())), NATS: fastNATS})
	eventually(t, "ready with the first certificate", func() bool { return svc.Ready() == nil })

	// The Secret is renewed: new files; the server now takes only them.
	c2 := clientCA2.Issue(t, "bridge", x509.ExtKeyUsageClientAuth)
	writeTestFile(t, certFile, c2.CertPEM())
	writeTestFile(t, keyFile, c2.KeyPEM(t))
	ns.Shutdown()
	ns.WaitForShutdown()
	start(clientCA2.Pool)
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
