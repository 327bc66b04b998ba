package testcert

import (
	"crypto/tls"
	"crypto/x509"
	"testing"
)

// An issued leaf verifies against its CA's pool, for its usage and hosts
// only, and not against another CA; its PEM forms load as a key pair.
func TestIssue(t *testing.T) {
	ca, other := NewCA(t, "ca"), NewCA(t, "other")
	srv := ca.Issue(t, "broker", x509.ExtKeyUsageServerAuth, "broker.test", "127.0.0.1")
	cert, err := x509.ParseCertificate(srv.DER)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name  string
		pool  *x509.CertPool
		host  string
		usage x509.ExtKeyUsage
		ok    bool
	}{
		{"its CA, DNS name", ca.Pool, "broker.test", x509.ExtKeyUsageServerAuth, true},
		{"its CA, IP address", ca.Pool, "127.0.0.1", x509.ExtKeyUsageServerAuth, true},
		{"another host", ca.Pool, "elsewhere.test", x509.ExtKeyUsageServerAuth, false},
		{"another usage", ca.Pool, "broker.test", x509.ExtKeyUsageClientAuth, false},
		{"another CA", other.Pool, "broker.test", x509.ExtKeyUsageServerAuth, false},
	}
	for _, tt := range tests {
		_, err := cert.Verify(x509.VerifyOptions{Roots: tt.pool, DNSName: tt.host, KeyUsages: []x509.ExtKeyUsage{tt.usage}})
		if (err == nil) != tt.ok {
			t.Errorf("%s: verify error %v, want ok=%v", tt.name, err, tt.ok)
		}
	}
	if _, err := tls.X509KeyPair(srv.CertPEM(), srv.KeyPEM(t)); err != nil {
		t.Errorf("PEM pair: %v", err)
	}
	if cert.Subject.CommonName != "broker" {
		t.Errorf("common name %q", cert.Subject.CommonName)
	}
}
