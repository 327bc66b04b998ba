package nats

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/config"
	"github.com/delaybridge/delaybridge/internal/testcert"
)

// TestRefusedReconnectSaysWhyOnce: the server's password changes (reload)
// before the mounted file does, which drops the connection, and every
// reconnect is refused until the file is rotated. Health must name the
// refusal, not just "reconnecting"; the refusal, which nats.go reports as
// an async error at each attempt (once per ReconnectWait, per server), is
// logged once, then as a reconnect failure that repeats (once per
// logthrottle.DefaultEvery), not at every attempt; and the connection
// comes back by itself once the file holds the new password.
func TestRefusedReconnectSaysWhyOnce(t *testing.T) {
	opts := plainOptions()
	opts.Username, opts.Password = "bridge", "old-secret"
	s := startServer(t, opts)
	file := filepath.Join(t.TempDir(), "password")
	if err := os.WriteFile(file, []byte("old-secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.InfoLevel)
	cfg := testConfig(t, serverURL(s))
	cfg.Logger = zap.New(core)
	cfg.User, cfg.PasswordFunc = "bridge", config.SecretFunc("nats.password_file", file, "old-secret", nil)
	nc, err := Connect(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()

	next := plainOptions()
	next.Port = opts.Port
	next.Username, next.Password = "bridge", "new-secret"
	if err := s.ReloadOptions(next); err != nil {
		t.Fatal(err)
	}
	// Many refused attempts (ReconnectWait is 20 ms here).
	deadline := time.Now().Add(20 * time.Second)
	for nc.Stats().Reconnects < 20 {
		if time.Now().After(deadline) {
			t.Fatalf("reconnects %d, status %v", nc.Stats().Reconnects, nc.Status())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := connErr(nc); err == nil || !strings.Contains(strings.ToLower(err.Error()), "authorization violation") {
		t.Errorf("health while every reconnect is refused = %v, want it to name the authorization violation", err)
	}
	refusals := logs.FilterFieldKey("error").Filter(func(e observer.LoggedEntry) bool {
		return strings.Contains(e.ContextMap()["error"].(string), "authorization violation")
	}).Len()
	if refusals > 2 {
		t.Errorf("%d log lines for %d refused reconnects, want the refusal logged once (then once per %v)",
			refusals, nc.Stats().Reconnects, "30s")
	}

	testcert.ReplaceFile(t, file, []byte("new-secret\n"))
	for nc.Status().String() != "CONNECTED" {
		if time.Now().After(deadline) {
			t.Fatalf("not reconnected with the rotated password: %v", nc.LastError())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := connErr(nc); err != nil {
		t.Errorf("health once reconnected = %v", err)
	}
}
