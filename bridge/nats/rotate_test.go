package nats

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/delaybridge/delaybridge/config"
	"github.com/delaybridge/delaybridge/internal/testcert"
)

// TestSecretRotation: the password or token is rotated the usual way:
// the mounted file first, then the server, which drops the connection
// the old secret opened. The connection comes back with the file's new
// secret, without a restart.
func TestSecretRotation(t *testing.T) {
	for _, tc := range []struct {
		name   string
		server func(o *server.Options, secret string)
		client func(c *Config, secret func() string)
	}{
		{"password",
			func(o *server.Options, s string) { o.Username, o.Password = "bridge", s },
			func(c *Config, s func() string) { c.User, c.PasswordFunc = "bridge", s }},
		{"token",
			func(o *server.Options, s string) { o.Authorization = s },
			func(c *Config, s func() string) { c.TokenFunc = s }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts := plainOptions()
			tc.server(opts, "old-secret")
			s := startServer(t, opts)
			file := filepath.Join(t.TempDir(), "secret")
			if err := os.WriteFile(file, []byte("old-secret\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			cfg := testConfig(t, serverURL(s))
			tc.client(&cfg, config.SecretFunc("nats."+tc.name+"_file", file, "old-secret", nil))
			nc, err := Connect(cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer nc.Close()

			testcert.ReplaceFile(t, file, []byte("new-secret\n"))
			next := plainOptions()
			next.Port = opts.Port
			tc.server(next, "new-secret")
			if err := s.ReloadOptions(next); err != nil {
				t.Fatal(err)
			}
			deadline := time.Now().Add(10 * time.Second)
			for nc.Stats().Reconnects == 0 || !nc.IsConnected() {
				if time.Now().After(deadline) {
					t.Fatalf("not reconnected with the rotated %s: reconnects %d, status %v, last error %v",
						tc.name, nc.Stats().Reconnects, nc.Status(), nc.LastError())
				}
				time.Sleep(10 * time.Millisecond)
			}
			if err := nc.Flush(); err != nil {
				t.Fatalf("flush after the reconnect: %v", err)
			}
		})
	}
}

// TestCARotation: Config.RootCAs is asked at each connect. With another
// CA in the file the server is refused; once the right CA is swapped in,
// the next connect with the same Config works.
func TestCARotation(t *testing.T) {
	ca := testcert.NewCA(t, "test CA")
	cert := ca.Issue(t, "127.0.0.1", x509.ExtKeyUsageServerAuth, "127.0.0.1").TLS()
	opts := plainOptions()
	opts.TLS = true
	opts.TLSConfig = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	s := startServer(t, opts)
	dir := t.TempDir()
	caFile := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(caFile, testcert.NewCA(t, "other CA").CertPEM(), 0o600); err != nil {
		t.Fatal(err)
	}
	ct, err := config.TLS{Enabled: true, CAFile: caFile}.Client(nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(t, serverURL(s))
	cfg.TLS, cfg.RootCAs = ct.Config(), ct.RootCAsFunc()
	var unknown x509.UnknownAuthorityError
	if _, err := Connect(cfg); !errors.As(err, &unknown) {
		t.Fatalf("connect with another CA in the file = %v, want an unknown authority error", err)
	}
	testcert.ReplaceFile(t, caFile, ca.CertPEM())
	nc, err := Connect(cfg)
	if err != nil {
		t.Fatalf("connect after the CA file was rotated: %v", err)
	}
	defer nc.Close()
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
}
