package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/config"
)

// run --check validates the file and the environment and exits without
// opening the store (the data dir is not even created) or dialling a
// broker: 0 when valid, with the effective config (secrets redacted) as
// YAML on stdout and the verdict on stderr; 1 and every problem on stderr,
// nothing on stdout, when not.
func TestRunCheck(t *testing.T) {
	withoutBridgeEnv(t)
	dir := t.TempDir()
	data := filepath.Join(dir, "data")
	valid := `
data_dir: ` + data + `
kafka:
  brokers: ["127.0.0.1:1"]
  sources: [{topic: delay, dlq: delay.dlq}]
admin:
  listen: 127.0.0.1:0
  allow_insecure_listen: true
`
	const secret = "s3cret-admin-token"
	tests := []struct {
		name    string
		yaml    string
		env     map[string]string
		code    int
		wants   []string // on stderr
		wantOut []string // on stdout: the effective config as YAML
	}{
		{"valid", valid, nil, 0, []string{"config.yaml: valid (--check"}, []string{"data_dir: " + data + "\n", "shards: 8\n", "max_delay: 365d\n"}},
		{"valid with a secret from the environment", valid, map[string]string{"DELAYBRIDGE_ADMIN_TOKEN": secret, "DELAYBRIDGE_SHARDS": "4"}, 0,
			[]string{"valid"}, []string{"token: REDACTED\n", "shards: 4\n"}},
		// Valid, but every schedule would be dead-lettered: said beside
		// the verdict (a "targets:" whose list lost its indentation).
		{"a mis-indented allow is a key of its own", valid + "targets:\nallow: [orders.*]\n", nil, 1, []string{"allow: unknown key"}, nil},
		{"valid, no target allowed", valid + "targets:\n", nil, 0, []string{"valid", "warning: targets.allow is empty, so no target is allowed"}, []string{"allow: []\n"}},
		{"bad key", valid + "max_delya: 1h\n", nil, 1, []string{"max_delya: unknown key"}, nil},
		{"bad env", valid, map[string]string{"DELAYBRIDGE_RETRY_MAX_ATTEMPTS": "0"}, 1, []string{"retry.max_attempts (from DELAYBRIDGE_RETRY_MAX_ATTEMPTS)"}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for k, v := range tt.env {
				t.Setenv(k, v)
			}
			cfg := filepath.Join(t.TempDir(), "config.yaml")
			if err := os.WriteFile(cfg, []byte(tt.yaml), 0o600); err != nil {
				t.Fatal(err)
			}
			var out, errOut bytes.Buffer
			if code := realMain([]string{"run", "--check", "--config", cfg}, &out, &errOut); code != tt.code {
				t.Fatalf("exit %d, want %d; stderr:\n%s", code, tt.code, errOut.String())
			}
			for _, w := range tt.wants {
				if !strings.Contains(errOut.String(), w) {
					t.Errorf("stderr does not say %q:\n%s", w, errOut.String())
				}
			}
			for _, w := range tt.wantOut {
				if !strings.Contains(out.String(), w) {
					t.Errorf("stdout does not say %q:\n%s", w, out.String())
				}
			}
			if !strings.Contains(tt.name, "no target allowed") && strings.Contains(errOut.String(), "warning") {
				t.Errorf("a warning for a config that allows targets:\n%s", errOut.String())
			}
			if strings.Contains(out.String()+errOut.String(), secret) {
				t.Errorf("the secret is printed:\n%s\n%s", out.String(), errOut.String())
			}
			if tt.code != 0 {
				if out.Len() > 0 {
					t.Errorf("exit %d with output on stdout:\n%s", tt.code, out.String())
				}
				return
			}
			// What stdout holds is a config: it loads back to the same one.
			back, err := config.LoadBytes(out.Bytes(), nil)
			if err != nil {
				t.Fatalf("the effective config does not load back: %v\n%s", err, out.String())
			}
			if back.DataDir != data || back.Kafka == nil || back.Kafka.Sources[0].DLQ != "delay.dlq" {
				t.Errorf("loaded back as %+v", back)
			}
			if _, err := os.Stat(data); !os.IsNotExist(err) {
				t.Errorf("data dir touched by --check: %v", err)
			}
		})
	}
}

// TestStoppedDuringStart: a start ended by the stop signal (the store's
// open returns the cancelled context's error) is a clean stop for run and
// dev; any other failure, or a cancellation without the stop, is not.
func TestStoppedDuringStart(t *testing.T) {
	stopped, cancel := context.WithCancel(context.Background())
	cancel()
	canceledOpen := fmt.Errorf("open store /x: stopped while the store was opening: %w", context.Canceled)
	for _, tc := range []struct {
		name string
		ctx  context.Context
		err  error
		want bool
	}{
		{"stopped during the open", stopped, canceledOpen, true},
		{"started", stopped, nil, false},
		{"another failure after the stop", stopped, errors.New("open store /x: permission denied"), false},
		{"cancelled without the stop", context.Background(), canceledOpen, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := stoppedDuringStart(tc.ctx, tc.err, zap.NewNop()); got != tc.want {
				t.Fatalf("stoppedDuringStart = %v, want %v", got, tc.want)
			}
		})
	}
}
