package config

import (
	"crypto/x509"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/internal/testcert"
)

// The client certificate is read again at each handshake, so a renewed
// Secret reaches the next connection; a pair that does not load keeps the
// last good one, and the log says so.
func TestTLSClientCertificateReloaded(t *testing.T) {
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	write := func(c, k []byte) {
		t.Helper()
		if err := os.WriteFile(certFile, c, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(keyFile, k, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	ca := testcert.NewCA(t, "ca")
	first, second := ca.Issue(t, "first", x509.ExtKeyUsageClientAuth), ca.Issue(t, "second", x509.ExtKeyUsageClientAuth)
	c1, k1 := first.CertPEM(), first.KeyPEM(t)
	c2, k2 := second.CertPEM(), second.KeyPEM(t)
	write(c1, k1)
	core, logs := observer.New(zap.InfoLevel)
	cfg, err := TLS{Enabled: true, CertFile: certFile, KeyFile: keyFile}.BuildLogged(zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.GetClientCertificate == nil {
		t.Fatal("no GetClientCertificate: the pair of the start is presented for good")
	}
	subject := func() string {
		t.Helper()
		c, err := cfg.GetClientCertificate(nil)
		if err != nil {
			t.Fatal(err)
		}
		leaf, err := x509.ParseCertificate(c.Certificate[0])
		if err != nil {
			t.Fatal(err)
		}
		return leaf.Subject.CommonName
	}
	// logged: the log lines a step adds (a failing read is logged once
	// per distinct error, and its end once).
	steps := []struct {
		what   string
		cert   []byte
		key    []byte
		want   string
		logged []string
	}{
		{"as started", nil, nil, "first", nil},
		{"renewed", c2, k2, "second", nil},
		{"half written: the key is not the certificate's", c2, k1, "second", []string{"tls client certificate could not be read again; presenting the last one that loaded"}},
		{"the same again", nil, nil, "second", nil},
		{"garbage", []byte("not pem"), []byte("not pem"), "second", []string{"tls client certificate could not be read again; presenting the last one that loaded"}},
		{"renewed again", c1, k1, "first", []string{"tls client certificate readable again"}},
		{"the same", nil, nil, "first", nil},
	}
	for _, st := range steps {
		if st.cert != nil {
			write(st.cert, st.key)
		}
		if got := subject(); got != st.want {
			t.Errorf("%s: presents %q, want %q", st.what, got, st.want)
		}
		var msgs []string
		for _, e := range logs.TakeAll() {
			msgs = append(msgs, e.Message)
		}
		if !slices.Equal(msgs, st.logged) {
			t.Errorf("%s: logged %q, want %q", st.what, msgs, st.logged)
		}
	}
	if len(cfg.Certificates) != 1 {
		t.Errorf("%d certificates checked at start, want 1", len(cfg.Certificates))
	}
}
