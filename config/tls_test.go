package config

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// selfSigned returns a PEM certificate and key for name.
func selfSigned(t *testing.T, name string) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kd, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kd})
}

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
	c1, k1 := selfSigned(t, "first")
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
		{"renewed", nil, nil, "second"},
		{"half written: the key is not the certificate's", nil, k1, "second"},
		{"garbage", []byte("not pem"), []byte("not pem"), "second"},
	}
	c2, k2 := selfSigned(t, "second")
	steps[1].cert, steps[1].key = c2, k2
	steps[2].cert = c2
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
