package nats

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"

	"github.com/delaybridge/delaybridge/internal/testcert"
)

func plainOptions() *server.Options {
	return &server.Options{Host: "127.0.0.1", Port: -1, NoLog: true, NoSigs: true}
}

// connectCase connects with cfg and checks the outcome: nil wantErr means
// the connection works (a round trip succeeds).
func connectCase(t *testing.T, cfg Config, wantErr error, secrets ...string) {
	t.Helper()
	cfg.ConnectTimeout = 5 * time.Second
	nc, err := Connect(cfg)
	if wantErr == nil {
		if err != nil {
			t.Fatalf("connect: %v", err)
		}
		defer nc.Close()
		if err := nc.Flush(); err != nil {
			t.Fatalf("flush: %v", err)
		}
		return
	}
	if err == nil {
		nc.Close()
		t.Fatal("connect succeeded, want an error")
	}
	if !errors.Is(err, wantErr) {
		t.Fatalf("err = %v, want %v", err, wantErr)
	}
	for _, s := range secrets {
		if strings.Contains(err.Error(), s) {
			t.Errorf("error %q leaks a secret", err)
		}
	}
}

func TestConnectUserPassword(t *testing.T) {
	opts := plainOptions()
	opts.Username, opts.Password = "bridge", "right-pass"
	s := startServer(t, opts)
	url := serverURL(s)
	t.Run("good", func(t *testing.T) {
		connectCase(t, Config{URL: url, User: "bridge", Password: "right-pass"}, nil)
	})
	t.Run("wrong password", func(t *testing.T) {
		connectCase(t, Config{URL: url, User: "bridge", Password: "wrong-pass"}, ErrAuth, "wrong-pass")
		connectCase(t, Config{URL: url, User: "bridge", Password: "wrong-pass"}, natsgo.ErrAuthorization)
	})
	t.Run("none", func(t *testing.T) {
		connectCase(t, Config{URL: url}, ErrAuth)
	})
	t.Run("credentials in the url are not echoed", func(t *testing.T) {
		u := strings.Replace(url, "nats://", "nats://bridge:url-secret@", 1)
		connectCase(t, Config{URL: u}, ErrAuth, "url-secret")
	})
}

func TestConnectToken(t *testing.T) {
	opts := plainOptions()
	opts.Authorization = "the-token"
	s := startServer(t, opts)
	url := serverURL(s)
	connectCase(t, Config{URL: url, Token: "the-token"}, nil)
	connectCase(t, Config{URL: url, Token: "bad-token"}, ErrAuth, "bad-token")
}

func TestConnectNkey(t *testing.T) {
	dir := t.TempDir()
	kp, _ := nkeys.CreateUser()
	pub, _ := kp.PublicKey()
	seed, _ := kp.Seed()
	good := filepath.Join(dir, "good.nk")
	if err := os.WriteFile(good, seed, 0o600); err != nil {
		t.Fatal(err)
	}
	other, _ := nkeys.CreateUser()
	otherSeed, _ := other.Seed()
	bad := filepath.Join(dir, "bad.nk")
	if err := os.WriteFile(bad, otherSeed, 0o600); err != nil {
		t.Fatal(err)
	}
	opts := plainOptions()
	opts.Nkeys = []*server.NkeyUser{{Nkey: pub}}
	s := startServer(t, opts)
	connectCase(t, Config{URL: serverURL(s), NkeyFile: good}, nil)
	connectCase(t, Config{URL: serverURL(s), NkeyFile: bad}, ErrAuth)
}

// TestConnectCreds runs a server in operator mode and connects with a
// user JWT + seed creds file.
func TestConnectCreds(t *testing.T) {
	s, acc := operatorServer(t)
	credsFile := func(signer nkeys.KeyPair) string {
		u, _ := nkeys.CreateUser()
		f := filepath.Join(t.TempDir(), "user.creds")
		if err := os.WriteFile(f, userCreds(t, signer, u, time.Time{}), 0o600); err != nil {
			t.Fatal(err)
		}
		return f
	}
	connectCase(t, Config{URL: serverURL(s), CredsFile: credsFile(acc)}, nil)
	// A user signed by an account the server does not know.
	stranger, _ := nkeys.CreateAccount()
	connectCase(t, Config{URL: serverURL(s), CredsFile: credsFile(stranger)}, ErrAuth)
}

// operatorServer starts a server in operator mode that knows one
// account, and returns it with that account's key pair.
func operatorServer(t *testing.T) (*server.Server, nkeys.KeyPair) {
	t.Helper()
	op, _ := nkeys.CreateOperator()
	opPub, _ := op.PublicKey()
	opJWT, err := jwt.NewOperatorClaims(opPub).Encode(op)
	if err != nil {
		t.Fatal(err)
	}
	opDecoded, err := jwt.DecodeOperatorClaims(opJWT)
	if err != nil {
		t.Fatal(err)
	}
	acc, _ := nkeys.CreateAccount()
	accPub, _ := acc.PublicKey()
	accJWT, err := jwt.NewAccountClaims(accPub).Encode(op)
	if err != nil {
		t.Fatal(err)
	}
	resolver := &server.MemAccResolver{}
	if err := resolver.Store(accPub, accJWT); err != nil {
		t.Fatal(err)
	}
	opts := plainOptions()
	opts.TrustedOperators = []*jwt.OperatorClaims{opDecoded}
	opts.AccountResolver = resolver
	return startServer(t, opts), acc
}

// userCreds is a creds file (user JWT and seed) for user, signed by the
// account key signer, expiring at expires (zero: never).
func userCreds(t *testing.T, signer, user nkeys.KeyPair, expires time.Time) []byte {
	t.Helper()
	uPub, _ := user.PublicKey()
	uSeed, _ := user.Seed()
	uc := jwt.NewUserClaims(uPub)
	if !expires.IsZero() {
		uc.Expires = expires.Unix()
	}
	uJWT, err := uc.Encode(signer)
	if err != nil {
		t.Fatal(err)
	}
	creds, err := jwt.FormatUserConfig(uJWT, uSeed)
	if err != nil {
		t.Fatal(err)
	}
	return creds
}

// testCA is a CA and a server certificate it issued for 127.0.0.1.
func testCA(t *testing.T) (serverCert tls.Certificate, pool *x509.CertPool) {
	t.Helper()
	ca := testcert.NewCA(t, "delaybridge test CA")
	return ca.Issue(t, "127.0.0.1", x509.ExtKeyUsageServerAuth, "127.0.0.1", "localhost").TLS(), ca.Pool
}

func TestConnectTLS(t *testing.T) {
	cert, pool := testCA(t)
	opts := plainOptions()
	opts.TLS = true
	opts.TLSConfig = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	opts.Username, opts.Password = "bridge", "pw"
	s := startServer(t, opts)
	url := serverURL(s)

	t.Run("trusted CA", func(t *testing.T) {
		connectCase(t, Config{URL: url, User: "bridge", Password: "pw", TLS: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}}, nil)
	})
	t.Run("unknown CA", func(t *testing.T) {
		_, otherPool := testCA(t)
		_, err := Connect(Config{URL: url, User: "bridge", Password: "pw", TLS: &tls.Config{RootCAs: otherPool}})
		var unknown x509.UnknownAuthorityError
		if !errors.As(err, &unknown) {
			t.Fatalf("err = %v, want an unknown authority error", err)
		}
	})
	t.Run("plain client", func(t *testing.T) {
		if _, err := Connect(Config{URL: url, User: "bridge", Password: "pw"}); err == nil {
			t.Fatal("plain connection to a TLS server succeeded")
		}
	})
}
