package service

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"
	"go.uber.org/zap/zaptest"

	"github.com/delaybridge/delaybridge/bridge/nats"
	"github.com/delaybridge/delaybridge/config"
)

func writeTestFile(t *testing.T, path string, data []byte) {
	t.Helper()
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
}

type testCA struct {
	key  *ecdsa.PrivateKey
	cert *x509.Certificate
	pool *x509.CertPool
}

func newTestCA(t *testing.T, name string) testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	c, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	p := x509.NewCertPool()
	p.AddCert(c)
	return testCA{key, c, p}
}

// leaf issues a certificate for 127.0.0.1; it returns the PEM cert and key.
func (ca testCA) leaf(t *testing.T, serial int64, usage x509.ExtKeyUsage) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "127.0.0.1"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, DNSNames: []string{"localhost"},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	kd, _ := x509.MarshalECPrivateKey(key)
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kd})
}

// TestClientCertRotationReachesTheBridge is the Helm chart's mTLS setup
// (secrets.natsTlsCert/Key, e.g. a cert-manager Secret): the kubelet
// updates the mounted files when the Secret is renewed, and the broker stops
// taking the old certificate (it expired, or the client CA was rotated).
// The bridge must reconnect with the certificate now in cert_file/key_file;
// nothing restarts it (/healthz stays 200 through a broker outage).
func TestClientCertRotationReachesTheBridge(t *testing.T) {
	serverCA, clientCA1, clientCA2 := newTestCA(t, "server CA"), newTestCA(t, "client CA 1"), newTestCA(t, "client CA 2")
	srvPEM, srvKey := serverCA.leaf(t, 2, x509.ExtKeyUsageServerAuth)
	srvCert, err := tls.X509KeyPair(srvPEM, srvKey)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	caFile, certFile, keyFile := filepath.Join(dir, "ca.crt"), filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	writeTestFile(t, caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: serverCA.cert.Raw}))
	c1, k1 := clientCA1.leaf(t, 3, x509.ExtKeyUsageClientAuth)
	writeTestFile(t, certFile, c1)
	writeTestFile(t, keyFile, k1)

	port, store := freePort(t), t.TempDir()
	start := func(clients *x509.CertPool) *natsserver.Server {
		return startNATSServer(t, &natsserver.Options{Port: port, StoreDir: store, TLS: true, TLSVerify: true,
			TLSConfig: &tls.Config{Certificates: []tls.Certificate{srvCert}, ClientAuth: tls.RequireAndVerifyClientCert,
				ClientCAs: clients, MinVersion: tls.VersionTLS12}})
	}
	ns := start(clientCA1.pool)

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
	cfg, err := config.LoadBytes([]byte(yml), nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	svc, err := New(ctx, cfg, Options{Logger: zaptest.NewLogger(t, zaptest.Level(testLogLevel())),
		NATS: func(c *nats.Config) { c.ReconnectWait = 50 * time.Millisecond }})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- svc.Run(ctx) }()
	defer func() { cancel(); <-done }()
	eventually(t, "ready with the first certificate", func() bool { return svc.Ready() == nil })

	// The Secret is renewed: new files; the server now takes only them.
	c2, k2 := clientCA2.leaf(t, 4, x509.ExtKeyUsageClientAuth)
	writeTestFile(t, certFile, c2)
	writeTestFile(t, keyFile, k2)
	ns.Shutdown()
	ns.WaitForShutdown()
	start(clientCA2.pool)
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
