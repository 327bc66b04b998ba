package nats

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	natsgo "github.com/nats-io/nats.go"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

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

// TestCARotatedOnServerFirstIsLogged: the server's certificate moves to a
// CA not in the CA file (the rotation done in the wrong order). The
// bridge's own verification refuses each reconnect, which nats.go reports
// to no handler (the handshake fails in its connect step, not its dial):
// the log must still say why, not only "disconnected; reconnecting".
func TestCARotatedOnServerFirstIsLogged(t *testing.T) {
	ca1, ca2 := testcert.NewCA(t, "CA 1"), testcert.NewCA(t, "CA 2")
	serverTLS := func(ca *testcert.CA) *tls.Config {
		return &tls.Config{Certificates: []tls.Certificate{ca.Issue(t, "nats", x509.ExtKeyUsageServerAuth, "127.0.0.1").TLS()}, MinVersion: tls.VersionTLS12}
	}
	s, opts := startTLSServer(t, serverTLS(ca1), false)
	caFile := filepath.Join(t.TempDir(), "ca.pem")
	testcert.ReplaceFile(t, caFile, ca1.CertPEM())
	nc, logs := connectTLSLogged(t, s, config.TLS{Enabled: true, CAFile: caFile})
	defer nc.Close()

	restartTLS(t, s, opts, serverTLS(ca2))
	named := func() bool {
		for _, e := range logs.FilterMessage("nats: reconnect attempt failed").All() {
			if strings.Contains(fmt.Sprint(e.ContextMap()["error"]), "certificate signed by unknown authority") {
				return true
			}
		}
		return false
	}
	for deadline := time.Now().Add(10 * time.Second); !named(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			var lines []string
			for _, e := range logs.All() {
				lines = append(lines, fmt.Sprintf("%s %v", e.Message, e.ContextMap()))
			}
			t.Fatalf("no log line names the refused server certificate within 10 s (last error %v); log: %q", nc.LastError(), lines)
		}
	}
	// Once, then once per logthrottle.DefaultEvery: not at every attempt.
	time.Sleep(time.Second)
	if n := logs.FilterMessage("nats: reconnect attempt failed").Len(); n > 1 {
		t.Errorf("%d reconnect failure lines in 1 s at a 20 ms reconnect wait: not throttled", n)
	}
}

// TestClientCertRefusedLogIsThrottled: a server that no longer takes the
// bridge's client certificate closes each reconnect after the handshake,
// and the error of each attempt names its own local port. The log says it
// once (and nats.go's own report of the server's alert once), not once per
// attempt.
func TestClientCertRefusedLogIsThrottled(t *testing.T) {
	serverCA, clientCA1, clientCA2 := testcert.NewCA(t, "server CA"), testcert.NewCA(t, "client CA 1"), testcert.NewCA(t, "client CA 2")
	srv := serverCA.Issue(t, "nats", x509.ExtKeyUsageServerAuth, "127.0.0.1").TLS()
	s, opts := startTLSServer(t, &tls.Config{Certificates: []tls.Certificate{srv}, ClientAuth: tls.RequireAndVerifyClientCert,
		ClientCAs: clientCA1.Pool, MinVersion: tls.VersionTLS12}, true)
	dir := t.TempDir()
	caFile, certFile, keyFile := filepath.Join(dir, "ca.pem"), filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	testcert.ReplaceFile(t, caFile, serverCA.CertPEM())
	c1 := clientCA1.Issue(t, "bridge", x509.ExtKeyUsageClientAuth)
	testcert.ReplaceFile(t, certFile, c1.CertPEM())
	testcert.ReplaceFile(t, keyFile, c1.KeyPEM(t))
	nc, logs := connectTLSLogged(t, s, config.TLS{Enabled: true, CAFile: caFile, CertFile: certFile, KeyFile: keyFile})
	defer nc.Close()

	next := opts.TLSConfig.Clone()
	next.ClientCAs = clientCA2.Pool
	restartTLS(t, s, opts, next)
	eventually(t, "reconnect attempts refused", func() bool { return nc.LastError() != nil })
	time.Sleep(2 * time.Second)
	var lines []string
	for _, e := range logs.FilterMessage("nats: reconnect attempt failed").All() {
		lines = append(lines, fmt.Sprint(e.ContextMap()["error"]))
	}
	switch {
	case len(lines) == 0:
		// Throttled is not silent: the refusal must be named once.
		t.Errorf("no reconnect failure line in 2 s of refused reconnects (last error %v)", nc.LastError())
	case len(lines) > 2:
		t.Errorf("%d reconnect failure lines in 2 s: not throttled: %q", len(lines), lines)
	}
}

// startTLSServer starts a TLS server (verify: client certificates
// required) on a port it can be restarted on.
func startTLSServer(t *testing.T, tc *tls.Config, verify bool) (*server.Server, *server.Options) {
	t.Helper()
	opts := plainOptions()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	opts.Port = l.Addr().(*net.TCPAddr).Port // fixed: the server restarts on it
	l.Close()
	opts.TLS, opts.TLSVerify, opts.TLSConfig = true, verify, tc
	return startServer(t, opts), opts
}

// restartTLS shuts s down and starts it again on the same port with tc.
func restartTLS(t *testing.T, s *server.Server, opts *server.Options, tc *tls.Config) {
	t.Helper()
	s.Shutdown()
	s.WaitForShutdown()
	next := *opts
	next.TLSConfig = tc
	startServer(t, &next)
}

// connectTLSLogged connects to s as the bridge does with tc, its log
// observed at Info.
func connectTLSLogged(t *testing.T, s *server.Server, tc config.TLS) (*natsgo.Conn, *observer.ObservedLogs) {
	t.Helper()
	core, logs := observer.New(zap.InfoLevel)
	ct, err := tc.Client(nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(t, serverURL(s))
	cfg.Logger = zap.New(core)
	cfg.TLS, cfg.RootCAs = ct.Config(), ct.RootCAsFunc()
	return connect(t, cfg), logs
}
