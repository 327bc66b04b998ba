package main

import (
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// mainChildEnv makes the test binary run realMain with these
// (space-separated) arguments, as the delaybridge binary does (see TestMain).
const mainChildEnv = "DELAYBRIDGE_TEST_MAIN_CHILD"

// TestDevSIGHUPForgetsSandbox: `delaybridge dev` run from a terminal gets a
// SIGHUP when that terminal is closed (or an ssh session drops). The README
// promises that without --data-dir "everything is kept in a temporary
// directory and forgotten on exit"; a SIGHUP must not leave the sandbox's
// directory (its store with a preallocated WAL, ~140 MB, and JetStream
// data) behind in $TMPDIR.
func TestDevSIGHUPForgetsSandbox(t *testing.T) {
	// Run under nohup (a CI job started in the background, say), this
	// process has SIGHUP ignored, and the child would inherit that and,
	// as designed for nohup, keep running on SIGHUP until its deadline.
	// A signal this process handles starts the child with the default.
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	tmpRoot := t.TempDir()
	cmd, lines, errOut := startChild(t, tmpRoot, mainChildEnv+"=dev -nats-port 0 -kafka-port 0 -admin 127.0.0.1:0")
	running := false
	for line := range lines {
		if strings.Contains(line, "sandbox is running") {
			running = true
			break
		}
	}
	if !running {
		_ = cmd.Wait()
		t.Fatalf("the sandbox did not start; stderr: %s", errOut.String())
	}
	go func() { // drain, so the child never blocks on its stdout
		for range lines {
		}
	}()
	dirs, _ := filepath.Glob(filepath.Join(tmpRoot, "delaybridge-dev-*"))
	if len(dirs) != 1 {
		t.Fatalf("sandbox temp dirs %q, want one", dirs)
	}
	if _, err := os.Stat(filepath.Join(dirs[0], "store")); err != nil {
		t.Fatalf("no store in the sandbox dir: %v", err)
	}

	if err := cmd.Process.Signal(syscall.SIGHUP); err != nil { // the terminal closes
		t.Fatal(err)
	}
	_ = cmd.Wait()
	t.Logf("exit: %v", cmd.ProcessState)
	if _, err := os.Stat(dirs[0]); err == nil {
		t.Errorf("after SIGHUP (%v) the sandbox's temporary directory %s is left behind", cmd.ProcessState, dirs[0])
	}
	if code := cmd.ProcessState.ExitCode(); code != 0 {
		out := errOut.String()
		if len(out) > 96<<10 { // the dump's start has the main goroutine's stack
			out = out[:64<<10] + "\n[...]\n" + out[len(out)-32<<10:]
		}
		t.Errorf("exit code %d after SIGHUP, want 0 (a graceful shutdown); stderr (a hang ends in SIGQUIT's stacks):\n%s", code, out)
	}
}
