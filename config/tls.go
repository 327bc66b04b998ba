package config

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"

	"go.uber.org/zap"
)

// Build returns the client TLS configuration these settings describe
// (whether or not Enabled is set; callers decide that). It is shared by the
// Kafka and NATS connections: nothing in it is transport specific.
func (t TLS) Build() (*tls.Config, error) { return t.BuildLogged(nil) }

// BuildLogged is Build whose client certificate reloads (see
// reloadingClientCert) say on log when a renewed pair cannot be read and
// when one can again. log may be nil.
func (t TLS) BuildLogged(log *zap.Logger) (*tls.Config, error) {
	cfg := &tls.Config{
		MinVersion:         tls.VersionTLS12,
		ServerName:         t.ServerName,
		InsecureSkipVerify: t.InsecureSkipVerify, //nolint:gosec // explicit operator choice
	}
	if t.CAFile != "" {
		pool, err := readCAs(t.CAFile)
		if err != nil {
			return nil, err
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
		cfg.GetClientCertificate = reloadingClientCert(t.CertFile, t.KeyFile, cert, log)
	case t.CertFile != "" || t.KeyFile != "":
		return nil, errors.New("tls: cert file and key file must be given together")
	}
	return cfg, nil
}

// ClientTLS is the client TLS of a long-running process: each new
// connection gets a configuration with the files as they are then. The
// client certificate is read at each handshake (see reloadingClientCert),
// and so is the CA file (parsed again when it changed, see fileWatch), so a CA
// rotated in a mounted Secret, the old and the new CA side by side during
// the change, is trusted from the next connection on without a restart.
type ClientTLS struct {
	base *tls.Config
	cas  *fileWatch[*x509.CertPool] // nil: no CA file, or no verification
}

// Client builds the ClientTLS these settings describe, checking the files
// as Build does. log (may be nil) says when a file changed and when a
// changed one cannot be used.
func (t TLS) Client(log *zap.Logger) (*ClientTLS, error) {
	base, err := t.BuildLogged(log)
	if err != nil {
		return nil, err
	}
	c := &ClientTLS{base: base}
	if t.CAFile != "" && !t.InsecureSkipVerify {
		c.cas = newSecretWatch("tls.ca_file", t.CAFile, parseCAs, base.RootCAs, log)
	}
	return c, nil
}

// Config returns a new connection's configuration, its own to change
// (setting ServerName, say).
func (c *ClientTLS) Config() *tls.Config {
	cfg := c.base.Clone()
	if c.cas != nil {
		cfg.RootCAs = c.cas.get()
	}
	return cfg
}

// RootCAsFunc returns a function giving the CA pool as the CA file is
// now, or nil when the roots are fixed (no CA file: the system's).
func (c *ClientTLS) RootCAsFunc() func() (*x509.CertPool, error) {
	if c.cas == nil {
		return nil
	}
	return func() (*x509.CertPool, error) { return c.cas.get(), nil }
}

// reloadingClientCert returns a GetClientCertificate that reads the pair
// again at every handshake (a fileWatch): a mounted Secret (cert-manager
// renews it in place) changes under a running process, and a reconnect
// must present the certificate the files hold now, not the one of the
// start, which may have expired. A pair that does not load (caught
// mid-update, say) falls back to the last one that did, and log (if not
// nil) says so once per distinct error, and once when a pair loads again:
// a renewal that never becomes readable ends in handshakes refused for an
// expired certificate, and the log must say why.
func reloadingClientCert(certFile, keyFile string, first tls.Certificate, log *zap.Logger) func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
	if log == nil {
		log = zap.NewNop()
	}
	w := &fileWatch[tls.Certificate]{
		files:    []string{certFile, keyFile},
		parse:    func(data ...[]byte) (tls.Certificate, error) { return tls.X509KeyPair(data[0], data[1]) },
		log:      log,
		fields:   []zap.Field{zap.String("cert_file", certFile), zap.String("key_file", keyFile)},
		failMsg:  "tls client certificate could not be read again; presenting the last one that loaded",
		againMsg: "tls client certificate readable again",
		val:      first,
	}
	return func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
		c := w.get()
		return &c, nil
	}
}
