package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/delaybridge/delaybridge/shard"
)

// A restart with another shard count is refused (the store cannot change
// it); the refusal names the key, the count the store has, and the
// environment variable when the count came from one: the file may say the
// right count while DELAYBRIDGE_SHARDS overrides it. Before, it said only
// "store has 4 shards, options ask for 2".
func TestRunShardsChangedNamesKey(t *testing.T) {
	withoutBridgeEnv(t)
	dir := t.TempDir()
	data := filepath.Join(dir, "data")
	eng, err := shard.Open(shard.Options{Dir: data, Shards: 4})
	if err != nil {
		t.Fatal(err)
	}
	if err := eng.Close(); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfg, []byte(`
data_dir: `+data+`
shards: 4
kafka:
  brokers: ["127.0.0.1:1"]
  sources: [{topic: delay, dlq: delay.dlq}]
admin:
  listen: 127.0.0.1:0
`), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("DELAYBRIDGE_SHARDS", "2")
	var out, errOut bytes.Buffer
	if code := realMain([]string{"run", "--config", cfg}, &out, &errOut); code != 1 {
		t.Fatalf("exit %d, want 1; stderr:\n%s", code, errOut.String())
	}
	last := errOut.String()
	if i := strings.LastIndex(strings.TrimSpace(last), "\n"); i >= 0 {
		last = last[i+1:]
	}
	for _, want := range []string{"shards: 2", "created with 4 shards", "set shards: 4", "DELAYBRIDGE_SHARDS=2"} {
		if !strings.Contains(last, want) {
			t.Errorf("refusal %q does not say %q", last, want)
		}
	}
}
