package config

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"sync"
)

// Build returns the client TLS configuration these settings describe
// (whether or not Enabled is set; callers decide that). It is shared by the
// Kafka and NATS connections: nothing in it is transport specific.
func (t TLS) Build() (*tls.Config, error) {
	cfg := &tls.Config{
		MinVersion:         tls.VersionTLS12,
		ServerName:         t.ServerName,
		InsecureSkipVerify: t.InsecureSkipVerify, //nolint:gosec // explicit operator choice
	}
	if t.CAFile != "" {
		pem, err := os.ReadFile(t.CAFile)
		if err != nil {
			return nil, fmt.Errorf("tls ca file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("tls ca file %s: no PEM certificate found", t.CAFile)
		}
		cfg.RootCAs = pool
	}
	switch {
	case t.CertFile != "" && t.KeyFile != "":
		cert, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("tls client certificate: %w", err)
		}
		cfg.Certificates = []tls.Certificate{cert} // checked at start; GetClientCertificate wins
		cfg.GetClientCertificate = reloadingClientCert(t.CertFile, t.KeyFile, cert)
	case t.CertFile != "" || t.KeyFile != "":
		return nil, errors.New("tls: cert file and key file must be given together")
	}
	return cfg, nil
}

// reloadingClientCert returns a GetClientCertificate that reads the pair
// again at every handshake: a mounted Secret (cert-manager renews it in
// place) changes under a running process, and a reconnect must present the
// certificate the files hold now, not the one of the start, which may have
// expired. A pair that does not load (caught mid-update, say) falls back to
// the last one that did. Handshakes are rare (one per connection), so the
// reads cost nothing that matters.
func reloadingClientCert(certFile, keyFile string, first tls.Certificate) func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
	var mu sync.Mutex
	last := first
	return func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
		mu.Lock()
		defer mu.Unlock()
		if c, err := tls.LoadX509KeyPair(certFile, keyFile); err == nil {
			last = c
		}
		c := last
		return &c, nil
	}
}
