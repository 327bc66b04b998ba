package kafka

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/delaybridge/delaybridge/config"
	"github.com/delaybridge/delaybridge/internal/testcert"
)

// TestCARotation: a sink built with Config.NewTLS trusts the CA file as it
// is at each new connection. The file first holds another CA, so the
// broker is refused; once the right CA is swapped in, the same sink
// connects, with no restart. A CA file that then breaks keeps the last
// pool that read.
func TestCARotation(t *testing.T) {
	p := newPKI(t)
	c := newCluster(t, kfake.SeedTopics(1, "delay"), kfake.TLS(&tls.Config{
		Certificates: []tls.Certificate{p.serverCert},
		MinVersion:   tls.VersionTLS12,
	}))
	other, err := os.ReadFile(p.otherCAFile)
	if err != nil {
		t.Fatal(err)
	}
	right, err := os.ReadFile(p.caFile)
	if err != nil {
		t.Fatal(err)
	}
	caFile := writeFile(t, p.dir, "rotated-ca.pem", other)
	ct, err := config.TLS{Enabled: true, CAFile: caFile}.Client(nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(t, c.ListenAddrs(), "g-rotate", "delay")
	cfg.NewTLS = ct.Config
	sink, err := NewSink(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer sink.Close()
	if err := sink.Check(context.Background()); !errors.Is(err, ErrTLS) {
		t.Fatalf("Check with another CA in the file = %v, want ErrTLS", err)
	}

	testcert.ReplaceFile(t, caFile, right)
	if err := sink.Check(context.Background()); err != nil {
		t.Fatalf("Check after the CA file was rotated: %v", err)
	}

	testcert.ReplaceFile(t, caFile, []byte("not pem"))
	deliverAndConsume(t, cfg) // new connections: the last pool that read
}

// TestPerConnectionTLSChecksHost: with Config.NewTLS and no server name,
// the broker's certificate is checked against the host of its address,
// an IP address included, as with a fixed configuration: a certificate
// for another name is refused, and accepted under that name.
func TestPerConnectionTLSChecksHost(t *testing.T) {
	ca := testcert.NewCA(t, "test CA")
	dir := t.TempDir()
	caFile := writeFile(t, dir, "ca.pem", ca.CertPEM())
	c := newCluster(t, kfake.SeedTopics(1, "delay"), kfake.TLS(&tls.Config{
		Certificates: []tls.Certificate{ca.Issue(t, "broker", x509.ExtKeyUsageServerAuth, "broker.test").TLS()},
		MinVersion:   tls.VersionTLS12,
	}))
	for _, tc := range []struct {
		serverName string
		want       error
	}{
		{"", ErrTLS}, // dialled as 127.0.0.1, not in the certificate
		{"broker.test", nil},
	} {
		ct, err := config.TLS{Enabled: true, CAFile: caFile, ServerName: tc.serverName}.Client(nil)
		if err != nil {
			t.Fatal(err)
		}
		cfg := testConfig(t, c.ListenAddrs(), "g-host-"+tc.serverName, "delay")
		cfg.NewTLS = ct.Config
		checkTLSCase(t, cfg, tc.want)
	}
}

// TestSASLPasswordRotation: a mechanism built by SASLMechanismFunc asks
// for the password at each new connection. With a wrong password in the
// file the brokers refuse the sink; once the right one is swapped in, the
// same sink connects.
func TestSASLPasswordRotation(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"), kfake.EnableSASL(),
		kfake.Superuser("PLAIN", "plain-user", "plain-pass"),
		kfake.Superuser("SCRAM-SHA-256", "scram256", "pass-256"),
		kfake.Superuser("SCRAM-SHA-512", "scram512", "pass-512"),
	)
	for _, tc := range []struct{ mech, user, pass string }{
		{"PLAIN", "plain-user", "plain-pass"},
		{"SCRAM-SHA-256", "scram256", "pass-256"},
		{"SCRAM-SHA-512", "scram512", "pass-512"},
	} {
		t.Run(tc.mech, func(t *testing.T) {
			file := writeFile(t, t.TempDir(), "password", []byte("old-password\n"))
			pass := config.SecretFunc("kafka.sasl.password_file", file, "old-password", nil)
			mech, err := SASLMechanismFunc(tc.mech, tc.user, pass)
			if err != nil {
				t.Fatal(err)
			}
			cfg := testConfig(t, c.ListenAddrs(), "g-"+tc.user, "delay")
			cfg.SASL = mech
			sink, err := NewSink(cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer sink.Close()
			if err := sink.Check(context.Background()); !errors.Is(err, ErrAuth) {
				t.Fatalf("Check with the old password = %v, want ErrAuth", err)
			}
			testcert.ReplaceFile(t, file, []byte(tc.pass+"\n"))
			if err := sink.Check(context.Background()); err != nil {
				t.Fatalf("Check after the password file was rotated: %v", err)
			}
			deliverAndConsume(t, cfg)
		})
	}
}

// blackhole returns an address whose TCP connects hang, as a broker on a
// stopped machine behind a firewall does: a listener that never accepts,
// its accept queue filled, so the kernel drops further SYNs.
func blackhole(t *testing.T) string {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "blackhole")
	t.Cleanup(func() { f.Close() })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	addr := (&net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: sa.(*syscall.SockaddrInet4).Port}).String()
	for range 32 {
		c, err := net.DialTimeout("tcp", addr, 300*time.Millisecond)
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return addr
		}
		if err != nil {
			t.Fatalf("blackhole: %v", err)
		}
		t.Cleanup(func() { c.Close() })
	}
	t.Skip("cannot make a hanging address here")
	return ""
}

// TestPerConnectionTLSDialCapsEachAddress: with Config.NewTLS the
// Transport dials through dialTLS, which must cap each address as
// kafka-go's own dial does (3 s), so that a hanging bootstrap broker
// tried first leaves time for the next one within DialTimeout rather
// than taking all of it. The dial returns on its own cap, with the
// caller's deadline still far away.
func TestPerConnectionTLSDialCapsEachAddress(t *testing.T) {
	shortDialCap(t)
	dead := blackhole(t)
	dialWithinCap(t, dead)
}

// dialWithinCap dials addr through the per-connection TLS dial with a
// minute's deadline: it must fail, within its own cap (3 s, here 200 ms),
// not at the caller's deadline (the poller's timer may fire a moment
// before the context's, so ctx.Err() alone cannot tell).
func dialWithinCap(t *testing.T, addr string) {
	t.Helper()
	ct, err := config.TLS{Enabled: true}.Client(nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg := Config{NewTLS: ct.Config}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := cfg.transport().Dial(ctx, "tcp", addr)
	if err == nil {
		conn.Close()
		t.Fatal("a hanging or silent address connected")
	}
	if deadline, _ := ctx.Deadline(); time.Until(deadline) < 30*time.Second {
		t.Fatalf("the dial used %v of the caller's minute (%v): no cap of its own", time.Minute-time.Until(deadline), err)
	}
}

// TestPerConnectionTLSHandshakeCapped: a broker address that accepts the
// connection and then never answers the TLS handshake is given up after
// the same per-address cap as one that does not connect, not after the
// caller's whole deadline.
func TestPerConnectionTLSHandshakeCapped(t *testing.T) {
	shortDialCap(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { c.Close() }) // accepted, never a word
		}
	}()
	dialWithinCap(t, ln.Addr().String())
}

// shortDialCap makes the per-address cap 200 ms for one test.
func shortDialCap(t *testing.T) {
	old := perAddressDial
	perAddressDial = 200 * time.Millisecond
	t.Cleanup(func() { perAddressDial = old })
}
