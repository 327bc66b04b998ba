package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/internal/benchrun"
)

// blockChildEnv makes the test binary a child that blocks until its stdin
// is closed (see TestMain): a stand-in for a child bridge of bench.
const blockChildEnv = "DELAYBRIDGE_TEST_BLOCK_CHILD"

// progressFunc is an io.Writer for benchrun.Options.Progress.
type progressFunc func(p []byte)

func (f progressFunc) Write(p []byte) (int, error) { f(p); return len(p), nil }

// TestBenchForcedExit forces the exit while benchrun.Run is running,
// through runBench as cmdBench calls it: at its first progress line, when
// benchrun's own work directory exists and a child process is running,
// the forced exit's cleanups run (os.Exit follows them, skipping every
// defer). Bench's work directory (benchrun's inside it) must then be gone
// and the child killed; -out (its files), -work itself and another
// bench's directory in it must be kept.
func TestBenchForcedExit(t *testing.T) {
	exists := func(p string) bool {
		_, err := os.Stat(p)
		return err == nil
	}
	// Where /proc lists a process's children (Linux), the child must be
	// killed; elsewhere killChildren finds none.
	procChildren, _ := filepath.Glob("/proc/self/task/*/children")
	for _, tc := range []struct {
		name     string
		withWork bool // -work DIR; else the system temp dir (TMPDIR)
	}{
		{"system temp dir", false},
		{"-work", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tmpRoot := t.TempDir()
			t.Setenv("TMPDIR", tmpRoot)
			parent, workFlag := tmpRoot, ""
			if tc.withWork {
				parent = filepath.Join(t.TempDir(), "scratch")
				workFlag = parent
			}
			sibling := filepath.Join(parent, "delaybridge-bench-sibling", "store") // another bench's
			out := filepath.Join(t.TempDir(), "bench-out")
			for _, d := range []string{sibling, out} {
				if err := os.MkdirAll(d, 0o755); err != nil {
					t.Fatal(err)
				}
			}
			kept := filepath.Join(out, "bridge-kafka.cpu.pprof") // an earlier run's, the user's
			if err := os.WriteFile(kept, []byte("keep me"), 0o644); err != nil {
				t.Fatal(err)
			}
			benchDirs := func(dir string) []string {
				m, err := filepath.Glob(filepath.Join(dir, "delaybridge-bench-*"))
				if err != nil {
					t.Fatal(err)
				}
				return slices.DeleteFunc(m, func(d string) bool { return d == filepath.Dir(sibling) })
			}

			cleanups := new(exitCleanups)
			forced := false
			var cleanupErr bytes.Buffer
			progress := progressFunc(func([]byte) {
				if forced {
					return
				}
				forced = true
				dirs := benchDirs(parent)
				if len(dirs) != 1 {
					t.Errorf("bench work dirs in %s: %q, want one", parent, dirs)
					return
				}
				if inner := benchDirs(dirs[0]); len(inner) != 1 {
					t.Errorf("benchrun work dirs in %s: %q, want one", dirs[0], inner)
				}
				child := startBlockingChild(t)

				cleanups.run(&cleanupErr) // the forced exit, before os.Exit

				if dirs := benchDirs(parent); len(dirs) != 0 {
					t.Errorf("after the forced exit's cleanup, bench work dirs %q are left behind", dirs)
				}
				if len(procChildren) > 0 {
					select {
					case err := <-child:
						var ee *exec.ExitError
						if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
							t.Errorf("child process: %v, want killed by SIGKILL", err)
						}
					case <-time.After(10 * time.Second):
						t.Error("a child process outlived the forced exit's cleanup")
					}
				}
			})
			o := benchrun.Options{
				Parts:    []string{"recovery"}, // its child fails to start: quick
				Recovery: 10,
				Exe:      filepath.Join(t.TempDir(), "no-such-delaybridge"),
				Out:      out,
				WorkDir:  workFlag,
				Progress: progress,
			}
			if err := runBench(context.Background(), o, io.Discard, cleanups); err != nil {
				t.Fatal(err)
			}
			if !forced {
				t.Fatal("benchrun printed no progress: the forced exit was not tried")
			}
			if cleanupErr.Len() > 0 {
				t.Errorf("cleanup stderr %q", cleanupErr.String())
			}
			if b, err := os.ReadFile(kept); err != nil || string(b) != "keep me" {
				t.Errorf("%s after the forced exit: %q, %v; want it kept", kept, b, err)
			}
			for _, keep := range []string{out, sibling, parent} {
				if !exists(keep) {
					t.Errorf("the forced exit removed %s", keep)
				}
			}
			if tc.withWork {
				if dirs := benchDirs(tmpRoot); len(dirs) != 0 {
					t.Errorf("with -work, bench made %q in the system temp dir", dirs)
				}
			}
		})
	}
}

// startBlockingChild starts the test binary as a child that blocks until
// its stdin is closed, as a child bridge of bench runs until stopped; the
// channel gets its Wait's result. The test's end closes its stdin.
func startBlockingChild(t *testing.T) <-chan error {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), blockChildEnv+"=1")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() { _ = stdin.Close() })
	return done
}

// TestBenchHelpHidesInternalFlags: `bench -h` lists the flags of the
// README and docs/benchmarks.md, not -child and -dir, which only the
// engine-level children benchrun starts are given (hunt H202: they were
// listed as "internal: ..."); those still parse (an unknown child mode is
// the child's error, exit 1, not an unknown flag, exit 2), and the usage
// printed after a bad flag value hides them too.
func TestBenchHelpHidesInternalFlags(t *testing.T) {
	documented := []string{"-quick\n", "-n int", "-paced-n int", "-rate int", "-capacity int", "-payload int",
		"-recovery int", "-only string", "-transports string", "-out string", `(default "bench-out")`, "-profile\n", "-work string"}
	for _, tc := range []struct {
		name string
		args []string
		code int
	}{
		{"help", []string{"bench", "-h"}, 0},
		{"a bad value", []string{"bench", "-out", "elsewhere", "-only", "latency"}, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out, errOut bytes.Buffer
			if code := realMain(tc.args, &out, &errOut); code != tc.code {
				t.Fatalf("exit code %d, want %d; stderr: %s", code, tc.code, errOut.String())
			}
			// Asked for, the usage goes to stdout; after a mistake, to stderr.
			help := errOut.String()
			if tc.code == 0 {
				help = out.String()
			}
			if !strings.HasPrefix(help, "Usage of bench:\n") {
				t.Errorf("usage %q does not start with the usage header", help)
			}
			for _, w := range documented {
				if !strings.Contains(help, w) {
					t.Errorf("usage %q does not list %q", help, w)
				}
			}
			for _, w := range []string{"-child", "-dir", "internal:"} {
				if strings.Contains(help, w) {
					t.Errorf("usage %q lists %q", help, w)
				}
			}
		})
	}
	var out, errOut bytes.Buffer
	if code := realMain([]string{"bench", "-child", "nosuch", "-dir", t.TempDir()}, &out, &errOut); code != 1 || !strings.Contains(errOut.String(), `unknown child mode "nosuch"`) {
		t.Fatalf("bench -child nosuch: exit %d, stderr %q; want 1 and the child's error", code, errOut.String())
	}
}
