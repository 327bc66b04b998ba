package nats

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

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
	s, acc := operatorServer(t)
	user, _ := nkeys.CreateUser()
	creds := func(expires time.Time) []byte { return userCreds(t, acc, user, expires) }
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
