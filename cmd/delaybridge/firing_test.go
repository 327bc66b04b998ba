package main

import (
	"bytes"
	"encoding/json"
	"net"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/delaybridge/delaybridge/admin"
	"github.com/delaybridge/delaybridge/shard"
)

// firingServer is a real engine behind the admin API with token tok, on a
// loopback port; it returns the engine and the port.
func firingServer(t *testing.T, tok string) (*shard.Engine, string) {
	t.Helper()
	e, err := shard.Open(shard.Options{Dir: t.TempDir(), Shards: 2, Logger: zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close() })
	srv := httptest.NewServer(admin.NewHandler(admin.Options{Engine: e, Token: tok}))
	t.Cleanup(srv.Close)
	_, port, err := net.SplitHostPort(strings.TrimPrefix(srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	return e, port
}

// TestFiringCommand: `delaybridge firing` pauses, reports and resumes a
// bridge through its admin API, finding the address and token in the
// bridge's config (a listen address on every interface reached on the
// loopback, the token from token_file) or taking them from flags; the
// engine's state agrees with each answer printed.
func TestFiringCommand(t *testing.T) {
	withoutBridgeEnv(t)
	const tok = "fire-admin-token"
	e, port := firingServer(t, tok)
	dir := t.TempDir()
	tokFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokFile, []byte(tok+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := firingConfig(t, dir, "listen: 0.0.0.0:"+port+"\n  token_file: "+tokFile)
	run := func(args ...string) (int, firingAnswer, string) {
		t.Helper()
		var out, errOut bytes.Buffer
		code := realMain(append([]string{"firing"}, args...), &out, &errOut)
		var a firingAnswer
		if code == 0 {
			if err := json.Unmarshal(out.Bytes(), &a); err != nil {
				t.Fatalf("firing %v printed %q: %v", args, out.String(), err)
			}
		}
		return code, a, errOut.String()
	}

	code, a, stderr := run("pause", "--config", cfg, "--reason", "orders-svc deploy")
	if code != 0 || !a.Paused || a.Operator == nil || a.Operator.Reason != "orders-svc deploy" {
		t.Fatalf("firing pause = %d %+v %q", code, a, stderr)
	}
	if st := e.Firing(); st.Operator == nil || st.Operator.Reason != "orders-svc deploy" {
		t.Fatalf("engine after firing pause: %+v", st)
	}
	if code, a, stderr := run("status", "--config", cfg); code != 0 || !a.Paused || a.Operator == nil {
		t.Fatalf("firing status = %d %+v %q", code, a, stderr)
	}
	// Flags instead of the config.
	if code, a, stderr := run("resume", "--admin", "127.0.0.1:"+port, "--token-file", tokFile); code != 0 || a.Paused {
		t.Fatalf("firing resume --admin = %d %+v %q", code, a, stderr)
	}
	if e.FiringPaused() {
		t.Fatal("engine still paused after firing resume")
	}

	// Refusals: the server's (no token, bad reason), then the command line's.
	for _, tc := range []struct {
		args []string
		code int
		says string
	}{
		{[]string{"pause", "--admin", "http://127.0.0.1:" + port}, 1, "401"},
		{[]string{"pause", "--config", cfg, "--reason", "two\nlines"}, 1, "without control"},
		{[]string{"status"}, 2, "--config FILE or --admin URL is required"},
		{[]string{"stop", "--config", cfg}, 2, `unknown action "stop"`},
		{[]string{"--config", cfg}, 2, "want an action"},
		{[]string{"resume", "--config", cfg, "--reason", "x"}, 2, "--reason is for pause only"},
		{[]string{"status", "--config", filepath.Join(dir, "absent.yaml")}, 1, "absent.yaml"},
		{[]string{"status", "--admin", "ftp://127.0.0.1:" + port}, 1, "want http://HOST:PORT"},
	} {
		code, _, stderr := run(tc.args...)
		if code != tc.code || !strings.Contains(stderr, tc.says) {
			t.Errorf("firing %q = %d, stderr %q; want %d saying %q", tc.args, code, stderr, tc.code, tc.says)
		}
		if e.FiringPaused() {
			t.Fatalf("firing %q paused the engine", tc.args)
		}
	}
}

// firingConfig writes a bridge config (a Kafka source, never dialled)
// with admin, the lines of its admin block, to dir/config.yaml.
func firingConfig(t *testing.T, dir, admin string) string {
	t.Helper()
	cfg := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfg, []byte(`
data_dir: `+filepath.Join(dir, "data")+`
kafka:
  brokers: ["127.0.0.1:1"]
  sources: [{topic: delay, dlq: delay.dlq}]
admin:
  `+admin+`
`), 0o600); err != nil {
		t.Fatal(err)
	}
	return cfg
}

// firingAnswer is the JSON `delaybridge firing` prints.
type firingAnswer struct {
	Paused   bool `json:"paused"`
	Operator *struct {
		Reason string `json:"reason"`
	} `json:"operator"`
}

// TestFiringTarget: the admin address `delaybridge firing` takes from a
// listen address, and one with port 0 refused.
func TestFiringTarget(t *testing.T) {
	withoutBridgeEnv(t)
	dir := t.TempDir()
	for _, tc := range []struct {
		listen, want, err string
	}{
		{"127.0.0.1:8080", "http://127.0.0.1:8080", ""},
		{"0.0.0.0:8080", "http://127.0.0.1:8080", ""},
		{":8080", "http://127.0.0.1:8080", ""},
		{"[::]:8080", "http://[::1]:8080", ""},
		{"[::1]:9000", "http://[::1]:9000", ""},
		{"127.0.0.1:0", "", "port 0"},
	} {
		cfg := firingConfig(t, dir, `listen: "`+tc.listen+`"`+"\n  token: t0ken")
		url, token, err := firingTarget(cfg, "", "")
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("listen %q: %q, %v; want an error saying %q", tc.listen, url, err, tc.err)
			}
			continue
		}
		if err != nil || url != tc.want || token != "t0ken" {
			t.Errorf("listen %q: %q, %q, %v; want %q and the token", tc.listen, url, token, err, tc.want)
		}
	}
	if _, _, err := firingTarget("", "127.0.0.1:1", filepath.Join(dir, "absent")); err == nil {
		t.Error("a missing --token-file was not refused")
	}
}
