package nats

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nkeys"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/internal/testcert"
)

// TestCredsFileExpiredJWTRenewed: the user JWT in nats.creds_file
// expires while the bridge runs (the server drops the connection, and
// every reconnect with it is refused); once the file holds a renewed JWT
// the connection comes back by itself: nats.go reads the file at each
// connect.
func TestCredsFileExpiredJWTRenewed(t *testing.T) {
	okp, _ := nkeys.CreateOperator()
	opub, _ := okp.PublicKey()
	oc := jwt.NewOperatorClaims(opub)
	ojwt, err := oc.Encode(okp)
	if err != nil {
		t.Fatal(err)
	}
	akp, _ := nkeys.CreateAccount()
	apub, _ := akp.PublicKey()
	ajwt, err := jwt.NewAccountClaims(apub).Encode(okp)
	if err != nil {
		t.Fatal(err)
	}
	ukp, _ := nkeys.CreateUser()
	upub, _ := ukp.PublicKey()
	seed, _ := ukp.Seed()
	creds := func(expires time.Time) []byte {
		uc := jwt.NewUserClaims(upub)
		uc.IssuerAccount = apub
		uc.Expires = expires.Unix()
		ujwt, err := uc.Encode(akp)
		if err != nil {
			t.Fatal(err)
		}
		b, err := jwt.FormatUserConfig(ujwt, seed)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	oclaims, err := jwt.DecodeOperatorClaims(ojwt)
	if err != nil {
		t.Fatal(err)
	}
	res := &server.MemAccResolver{}
	opts := plainOptions()
	opts.TrustedOperators = []*jwt.OperatorClaims{oclaims}
	opts.AccountResolver = res
	s := startServer(t, opts)
	if err := res.Store(apub, ajwt); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(t.TempDir(), "bridge.creds")
	if err := os.WriteFile(file, creds(time.Now().Add(2*time.Second)), 0o600); err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.InfoLevel)
	cfg := testConfig(t, serverURL(s))
	cfg.Logger = zap.New(core)
	cfg.CredsFile = file
	nc, err := Connect(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	deadline := time.Now().Add(20 * time.Second)
	for nc.IsConnected() || nc.Stats().Reconnects < 20 {
		if time.Now().After(deadline) {
			t.Fatalf("still %v with %d reconnects after the JWT expired", nc.Status(), nc.Stats().Reconnects)
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("health while expired: %v", connErr(nc))
	for _, e := range logs.All() {
		t.Logf("LOG %s %s %v", e.Level, e.Message, e.ContextMap())
	}
	if err := connErr(nc); err == nil || !strings.Contains(strings.ToLower(err.Error()), "expired") && !strings.Contains(strings.ToLower(err.Error()), "authorization") {
		t.Errorf("health while the JWT is expired = %v", err)
	}
	testcert.ReplaceFile(t, file, creds(time.Now().Add(time.Hour)))
	renewed := time.Now()
	for !nc.IsConnected() {
		if time.Now().After(deadline) {
			t.Fatalf("not reconnected with the renewed JWT: %v", nc.LastError())
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("reconnected %v after the creds file was renewed", time.Since(renewed))
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
}
