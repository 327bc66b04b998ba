package service

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"testing"

	natsserver "github.com/nats-io/nats-server/v2/server"
	"go.uber.org/zap/zaptest"

	"github.com/delaybridge/delaybridge/internal/testcert"
	"github.com/delaybridge/delaybridge/internal/testlog"
)

// TestSecretFilesRotate: the files a Kubernetes Secret mounts change under
// the running bridge, the usual way (a new file renamed over the old):
// the admin token, the NATS password and the CA bundle (the new CA added
// beside the old). The admin API takes the new token at once and refuses
// the old one; then the NATS server moves to a certificate of the new CA
// and the new password, and the bridge reconnects with the files as they
// are now, with no restart.
func TestSecretFilesRotate(t *testing.T) {
	ca1, ca2 := testcert.NewCA(t, "server CA 1"), testcert.NewCA(t, "server CA 2")
	dir := t.TempDir()
	swap := func(name string, data []byte) string {
		path := filepath.Join(dir, name)
		testcert.ReplaceFile(t, path, data)
		return path
	}
	caFile := swap("ca.crt", ca1.CertPEM())
	passFile := swap("nats-password", []byte("pw-1\n"))
	tokenFile := swap("admin-token", []byte("adm-1\n"))

	port, store := freePort(t), t.TempDir()
	start := func(ca *testcert.CA, pass string) *natsserver.Server {
		cert := ca.Issue(t, "nats", x509.ExtKeyUsageServerAuth, "127.0.0.1").TLS()
		return startNATSServer(t, &natsserver.Options{Port: port, StoreDir: store, TLS: true,
			TLSConfig: &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12},
			Username:  "bridge", Password: pass})
	}
	ns := start(ca1, "pw-1")

	yml := fmt.Sprintf(`
data_dir: %q
nats:
  url: tls://127.0.0.1:%d
  create: true
  user: bridge
  password_file: %q
  tls: {enabled: true, ca_file: %q}
  sources:
    - {subject: "delay.>", dlq: dlq.delay}
targets:
  allow: ["*"]
admin:
  listen: "127.0.0.1:0"
  token_file: %q
`, t.TempDir(), port, passFile, caFile, tokenFile)
	svc, _, _ := runYAML(t, yml, Options{Logger: testlog.New(t, zaptest.Level(testLogLevel())), NATS: fastNATS})
	eventually(t, "ready with the first CA and password", func() bool { return svc.Ready() == nil })
	stats := func(token string) int {
		req := httptest.NewRequest(http.MethodGet, "/v1/stats", nil)
		req.Header.Set("Authorization", "Bearer "+token)
		rec := httptest.NewRecorder()
		svc.AdminHandler().ServeHTTP(rec, req)
		return rec.Code
	}
	if code := stats("adm-1"); code != http.StatusOK {
		t.Fatalf("/v1/stats with the first token: %d", code)
	}

	swap("admin-token", []byte("adm-2\n"))
	swap("ca.crt", append(ca1.CertPEM(), ca2.CertPEM()...))
	swap("nats-password", []byte("pw-2\n"))
	if code := stats("adm-1"); code != http.StatusUnauthorized {
		t.Errorf("/v1/stats with the rotated-out token: %d, want 401", code)
	}
	if code := stats("adm-2"); code != http.StatusOK {
		t.Errorf("/v1/stats with the new token: %d, want 200", code)
	}

	ns.Shutdown()
	ns.WaitForShutdown()
	start(ca2, "pw-2")
	defer func() {
		if t.Failed() {
			t.Logf("readiness: %v", svc.Ready())
		}
	}()
	eventually(t, "ready again with the new CA and password", func() bool { return svc.Ready() == nil })
	if err := svc.Live(); err != nil {
		t.Fatalf("live: %v", err)
	}
}
