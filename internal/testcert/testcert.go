// Package testcert makes throwaway certificate authorities and the
// certificates they issue, for tests of TLS connections (mutual TLS
// included) against in-process brokers. Keys are ECDSA P-256; everything
// is valid from an hour ago for a day. NATSCreds makes a NATS .creds file
// the same throwaway way.
package testcert

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math"
	"math/big"
	"net"
	"os"
	"testing"
	"time"
)

// CA is a self-signed certificate authority.
type CA struct {
	Cert *x509.Certificate
	Key  *ecdsa.PrivateKey
	// Pool holds Cert alone: a client's RootCAs or a server's ClientCAs.
	Pool *x509.CertPool
}

// Leaf is a certificate a CA issued, with its key.
type Leaf struct {
	DER []byte
	Key *ecdsa.PrivateKey
}

// NewCA makes a CA named name (its common name).
func NewCA(t testing.TB, name string) *CA {
	t.Helper()
	key := newKey(t)
	tmpl := template(t, name)
	tmpl.IsCA, tmpl.BasicConstraintsValid = true, true
	tmpl.KeyUsage = x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return &CA{Cert: cert, Key: key, Pool: pool}
}

// CertPEM is the CA's certificate in PEM, as a ca_file holds it.
func (ca *CA) CertPEM() []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ca.Cert.Raw})
}

// Issue makes a certificate named name (its common name) for usage (server
// or client authentication), valid for hosts: DNS names and IP addresses
// ("broker.test", "127.0.0.1").
func (ca *CA) Issue(t testing.TB, name string, usage x509.ExtKeyUsage, hosts ...string) Leaf {
	t.Helper()
	key := newKey(t)
	tmpl := template(t, name)
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	tmpl.ExtKeyUsage = []x509.ExtKeyUsage{usage}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.Key)
	if err != nil {
		t.Fatal(err)
	}
	return Leaf{DER: der, Key: key}
}

// TLS is the leaf as a tls.Config's certificate.
func (l Leaf) TLS() tls.Certificate {
	return tls.Certificate{Certificate: [][]byte{l.DER}, PrivateKey: l.Key}
}

// CertPEM is the leaf's certificate in PEM, as a cert_file holds it.
func (l Leaf) CertPEM() []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: l.DER})
}

// KeyPEM is the leaf's key in PEM, as a key_file holds it.
func (l Leaf) KeyPEM(t testing.TB) []byte {
	t.Helper()
	der, err := x509.MarshalECPrivateKey(l.Key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der})
}

func newKey(t testing.TB) *ecdsa.PrivateKey {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return key
}

func template(t testing.TB, name string) *x509.Certificate {
	t.Helper()
	serial, err := rand.Int(rand.Reader, big.NewInt(math.MaxInt64))
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	return &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(24 * time.Hour),
	}
}

// ReplaceFile swaps path's content the way a Kubernetes Secret update
// does: a new file renamed over the old one (another inode), as the
// certificate and secret files of the rotation tests are.
func ReplaceFile(t testing.TB, path string, data []byte) {
	t.Helper()
	if err := os.WriteFile(path+".new", data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(path+".new", path); err != nil {
		t.Fatal(err)
	}
}
