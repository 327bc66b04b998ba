package config

import (
	"crypto/x509"
	"os"
	"path/filepath"
	"testing"

	"github.com/delaybridge/delaybridge/internal/testcert"
)

// The client certificate is read again at each handshake, so a renewed
// Secret reaches the next connection; a pair that does not load keeps the
// last good one.
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
	cfg, err := TLS{Enabled: true, CertFile: certFile, KeyFile: keyFile}.Build()
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
	steps := []struct {
		what string
		cert []byte
		key  []byte
		want string
	}{
		{"as started", nil, nil, "first"},
		{"renewed", c2, k2, "second"},
		{"half written: the key is not the certificate's", c2, k1, "second"},
		{"garbage", []byte("not pem"), []byte("not pem"), "second"},
	}
	for _, st := range steps {
		if st.cert != nil {
			write(st.cert, st.key)
		}
		if got := subject(); got != st.want {
			t.Errorf("%s: presents %q, want %q", st.what, got, st.want)
		}
	}
	if len(cfg.Certificates) != 1 {
		t.Errorf("%d certificates checked at start, want 1", len(cfg.Certificates))
	}
}
