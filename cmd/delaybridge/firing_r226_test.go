package main

import (
	"bytes"
	"strings"
	"testing"
)

// TestR226FiringActionAfterFlags (review R226): `delaybridge firing` takes
// its action after the flags too ("firing --config F pause", as many
// CLIs allow). It was refused, exit 2, with "firing: unexpected argument
// "pause": firing takes no arguments", which is wrong: firing takes an
// action. A second action is still a usage error, and says so.
func TestR226FiringActionAfterFlags(t *testing.T) {
	withoutBridgeEnv(t)
	const tok = "r226-admin-token"
	e, port := firingServer(t, tok)
	dir := t.TempDir()
	cfg := firingConfig(t, dir, "listen: 127.0.0.1:"+port+"\n  token: "+tok)
	run := func(args ...string) (int, string, string) {
		t.Helper()
		var out, errOut bytes.Buffer
		code := realMain(append([]string{"firing"}, args...), &out, &errOut)
		return code, out.String(), errOut.String()
	}
	if code, out, stderr := run("--config", cfg, "--reason", "pause", "pause"); code != 0 || !strings.Contains(out, `"paused":true`) {
		t.Fatalf("firing --config F --reason pause pause = %d, %q, stderr %q; want 0 and paused", code, out, stderr)
	}
	if st := e.Firing(); st.Operator == nil || st.Operator.Reason != "pause" {
		t.Fatalf("engine after the pause: %+v, want paused with reason \"pause\"", st)
	}
	if code, out, stderr := run("--config="+cfg, "resume"); code != 0 || !strings.Contains(out, `"paused":false`) {
		t.Fatalf("firing --config=F resume = %d, %q, stderr %q; want 0 and resumed", code, out, stderr)
	}
	for _, args := range [][]string{
		{"pause", "resume", "--config", cfg},
		{"--config", cfg, "pause", "resume"},
	} {
		code, _, stderr := run(args...)
		if code != 2 || strings.Contains(stderr, "takes no arguments") || !strings.Contains(stderr, `"resume"`) {
			t.Errorf("firing %q = %d, stderr %q; want 2 naming the extra argument, not \"takes no arguments\"", args, code, stderr)
		}
	}
	if e.FiringPaused() {
		t.Fatal("a refused command line paused the engine")
	}
}
