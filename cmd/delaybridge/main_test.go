package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/bridge/service"
	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/config"
)

// withoutBridgeEnv unsets every DELAYBRIDGE_* variable for the test (they
// come back after it): `run` refuses one that names no config key, and the
// test harness's own (DELAYBRIDGE_LONG=1 of make test-long) names none.
func withoutBridgeEnv(t *testing.T) {
	t.Helper()
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(k, "DELAYBRIDGE_") {
			t.Setenv(k, "") // restores the value after the test
			if err := os.Unsetenv(k); err != nil {
				t.Fatal(err)
			}
		}
	}
}

func TestRealMain(t *testing.T) {
	withoutBridgeEnv(t)
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	unknownKey := write("unknown.yaml", "data_dir: /tmp/x\nkafka:\n  brokers: [localhost:9092]\n  sources: [{topic: delay, dlq: delay.dlq}]\nmax_dleay: 3d\n")
	invalid := write("invalid.yaml", "data_dir: /tmp/x\nshards: 0\nkafka:\n  brokers: [localhost:9092]\n  sources: [{topic: delay}]\n")
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	portInUse := write("port.yaml", "data_dir: "+filepath.Join(dir, "data")+"\nnats:\n  url: nats://nosuchhost.invalid:4222\n  sources: [{subject: delay.>, dlq: dlq.delay}]\nadmin: {listen: \""+taken.Addr().String()+"\"}\n")
	tests := []struct {
		name       string
		args       []string
		code       int
		wantOut    string
		wantErrOut []string
	}{
		{"no command", nil, 2, "", []string{"usage:"}},
		{"unknown command", []string{"serve"}, 2, "", []string{`unknown command "serve"`}},
		{"version", []string{"version"}, 0, "delaybridge ", nil},
		{"help", []string{"help"}, 0, "delaybridge run --config FILE", nil},
		{"help flag", []string{"--help"}, 0, "delaybridge run --config FILE", nil},
		// -help too, as every command and the flag package take it.
		{"help flag, one dash", []string{"-help"}, 0, "delaybridge run --config FILE", nil},
		// version and help take no arguments either: refused like those of
		// run, dev and bench, not ignored.
		// -h asks for help of every command, version's too.
		{"version help flag", []string{"version", "-h"}, 0, "delaybridge version", nil},
		{"version --help", []string{"version", "--help"}, 0, "delaybridge run --config FILE", nil},
		{"version refuses an argument", []string{"version", "extra"}, 2, "", []string{"usage:", `version: unexpected argument "extra": version takes no arguments`}},
		{"version flag refuses an argument", []string{"--version", "extra"}, 2, "", []string{`--version: unexpected argument "extra"`}},
		{"version names every argument", []string{"-v", "a", "--b"}, 2, "", []string{`-v: unexpected arguments "a" "--b"`}},
		{"help refuses an argument", []string{"help", "run"}, 2, "", []string{"usage:", `help: unexpected argument "run": help takes no arguments (a command's flags: delaybridge COMMAND -h)`}},
		{"help flag refuses an argument", []string{"-h", "extra"}, 2, "", []string{`-h: unexpected argument "extra"`}},
		{"run without config", []string{"run"}, 2, "", []string{"--config FILE is required", "-config string"}},
		{"run refuses an unknown flag", []string{"run", "--conifg", "x.yml"}, 2, "", []string{"flag provided but not defined: -conifg", "-config string"}},
		{"run refuses a file as argument", []string{"run", "x.yml"}, 2, "", []string{`run: unexpected argument "x.yml"`, "-config string"}},
		{"run refuses an argument after the flags", []string{"run", "--config", filepath.Join(dir, "nope.yaml"), "extra"}, 2, "", []string{`run: unexpected argument "extra"`, "-config string"}},
		{"run names every argument", []string{"run", "x.yml", "--config", "y.yml"}, 2, "", []string{`run: unexpected arguments "x.yml" "--config" "y.yml"`}},
		{"run with missing file", []string{"run", "--config", filepath.Join(dir, "nope.yaml")}, 1, "", []string{"nope.yaml"}},
		{"run refuses an unknown key", []string{"run", "--config", unknownKey}, 1, "", []string{"unknown.yaml", "max_dleay: unknown key"}},
		{"run names every invalid key", []string{"run", "--config", invalid}, 1, "", []string{"shards", "kafka.sources[0].dlq"}},
		// The cause of an exit after the start is in the JSON log too.
		{"run with the admin port in use", []string{"run", "--config", portInUse}, 1, "", []string{`"msg":"stopped with an error"`, "(admin.listen)", "address already in use"}},
		{"bench refuses an unknown transport", []string{"bench", "-transports", "kafka,amqp"}, 2, "", []string{`unknown transport "amqp"`, "-transports string"}},
		{"bench refuses an unknown part", []string{"bench", "-only", "throughput,latency"}, 2, "", []string{`-only: unknown part "latency" (throughput, lateness, capacity, recovery)`}},
		{"bench refuses a part with a space", []string{"bench", "-only", "throughput, lateness"}, 2, "", []string{`unknown part " lateness"`}},
		{"bench refuses a negative count", []string{"bench", "-n", "-5"}, 2, "", []string{`bench: -n: -5 is negative`}},
		// The bad flag values make a regression fail fast (exit 1) instead
		// of starting the sandbox or the benchmark.
		{"bench refuses an argument", []string{"bench", "-transports", "amqp", "quick"}, 2, "", []string{`bench: unexpected argument "quick"`, "-transports string"}},
		{"dev refuses an argument", []string{"dev", "-nats-port", "70000", "-kafka-port", "70000", "sandbox"}, 2, "", []string{`dev: unexpected argument "sandbox"`, "-kafka-port int"}},
		{"dev refuses an unknown flag", []string{"dev", "-port", "1"}, 2, "", []string{"flag provided but not defined: -port"}},
		// A port or address no listener can take is a bad flag value: exit
		// 2 at once, naming the flag, before any broker starts (-nats-port
		// -5 waited 10 s for a NATS server that never became ready).
		{"dev refuses a port out of range", []string{"dev", "-nats-port", "70000"}, 2, "", []string{"dev: -nats-port: 70000 is not a port (0..65535, 0: any free port)", "-nats-port int"}},
		{"dev refuses a negative port", []string{"dev", "-nats-port", "-5"}, 2, "", []string{"dev: -nats-port: -5 is not a port"}},
		{"dev refuses a negative kafka port", []string{"dev", "-kafka-port", "-1"}, 2, "", []string{"dev: -kafka-port: -1 is not a port"}},
		{"dev refuses an admin address without a port", []string{"dev", "-admin", "localhost"}, 2, "", []string{`dev: -admin: "localhost" is not host:port`, "-admin string"}},
		{"dev refuses an admin address off loopback", []string{"dev", "-admin", "0.0.0.0:8080"}, 2, "", []string{"loopback address only"}},
		// Usage asked for goes to stdout (exit 0, nothing on stderr), as
		// `help` does; after a mistake it goes to stderr (exit 2, above).
		{"help flag of a command", []string{"run", "-h"}, 0, "-config string", nil},
		{"help flag of a command, long", []string{"run", "--help"}, 0, "-check", nil},
		{"help flag of dev", []string{"dev", "-h"}, 0, "-kafka-port int", nil},
		{"help flag of bench", []string{"bench", "-help"}, 0, "-transports string", nil},
		// The help points to what a user has: the README, not CONTRACT.md.
		{"run help names the README", []string{"run", "-h"}, 0, `YAML config file (README, "Configuration")`, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var out, errOut bytes.Buffer
			if code := realMain(tc.args, &out, &errOut); code != tc.code {
				t.Fatalf("exit code %d, want %d; stderr: %s", code, tc.code, errOut.String())
			}
			if !strings.Contains(out.String(), tc.wantOut) {
				t.Errorf("stdout %q does not contain %q", out.String(), tc.wantOut)
			}
			if tc.code != 0 && out.Len() > 0 {
				t.Errorf("exit %d with output on stdout: %q", tc.code, out.String())
			}
			if tc.code == 0 && errOut.Len() > 0 {
				t.Errorf("exit 0 with output on stderr: %q", errOut.String())
			}
			for _, w := range tc.wantErrOut {
				if !strings.Contains(errOut.String(), w) {
					t.Errorf("stderr %q does not contain %q", errOut.String(), w)
				}
			}
		})
	}
}

// TestShutdownOnSignal feeds signals through a channel: the first cancels
// the context (graceful shutdown) and does not exit, the second exits at
// once with 128+its number after one line on stderr, and none is acted on
// after stop.
// TestShutdownOnSignalRepeat (hunt H138): the first signal again within
// repeatSignalWindow is the same kill delivered twice (to the process and
// to its group, as GNU timeout sends it), not a second request; another
// signal, or the same one later, is.
func TestShutdownOnSignalRepeat(t *testing.T) {
	for _, tc := range []struct {
		name   string
		second os.Signal
		after  time.Duration
		exits  bool
	}{
		{"same at once", syscall.SIGTERM, time.Millisecond, false},
		{"same just inside", syscall.SIGTERM, repeatSignalWindow - time.Millisecond, false},
		{"same after the window", syscall.SIGTERM, repeatSignalWindow, true},
		{"another at once", syscall.SIGINT, time.Millisecond, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var clock atomic.Int64
			now := func() time.Time { return time.Unix(0, clock.Load()) }
			sigs := make(chan os.Signal) // unbuffered: a send returns once the watcher has it
			exited := make(chan int, 3)
			ctx, stop := shutdownOnSignal(context.Background(), sigs, io.Discard, func(code int) { exited <- code }, new(exitCleanups), now)
			defer stop()
			send := func(s os.Signal) {
				t.Helper()
				select {
				case sigs <- s:
				case <-time.After(10 * time.Second):
					t.Fatalf("%v not taken", s)
				}
			}
			send(syscall.SIGTERM)
			<-ctx.Done()
			clock.Add(int64(tc.after))
			send(tc.second)
			if !tc.exits {
				// Another signal, taken only once the watcher is back
				// waiting: the repeat did not exit.
				send(syscall.SIGINT)
			}
			select {
			case code := <-exited:
				want := 128 + int(tc.second.(syscall.Signal))
				if !tc.exits {
					want = 130
				}
				if code != want {
					t.Fatalf("exit code %d, want %d", code, want)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("no exit")
			}
			if len(exited) != 0 {
				t.Fatalf("exited again: %d", <-exited)
			}
		})
	}
}

func TestShutdownOnSignal(t *testing.T) {
	tests := []struct {
		first, second os.Signal
		code          int
	}{
		{syscall.SIGTERM, syscall.SIGINT, 130},
		{syscall.SIGINT, syscall.SIGTERM, 143},
		{syscall.SIGINT, syscall.SIGINT, 130},
	}
	for _, tc := range tests {
		t.Run(fmt.Sprintf("%v then %v", tc.first, tc.second), func(t *testing.T) {
			sigs := make(chan os.Signal) // unbuffered: a send returns once the watcher has the signal
			exited := make(chan int, 2)
			var errOut bytes.Buffer
			// An empty registry, as `run` leaves it: the exit is as before.
			ctx, stop := shutdownOnSignal(context.Background(), sigs, &errOut, func(code int) { exited <- code }, new(exitCleanups), time.Now)
			defer stop()
			if ctx.Err() != nil {
				t.Fatal("context cancelled before any signal")
			}
			sigs <- tc.first
			select {
			case <-ctx.Done():
			case <-time.After(10 * time.Second):
				t.Fatal("the first signal did not cancel the context")
			}
			select {
			case code := <-exited:
				t.Fatalf("the first signal exited (%d)", code)
			case <-time.After(50 * time.Millisecond):
			}
			select {
			case sigs <- tc.second:
			case <-time.After(10 * time.Second):
				t.Fatal("the second signal was not taken")
			}
			select {
			case code := <-exited:
				if code != tc.code {
					t.Errorf("exit code %d, want %d", code, tc.code)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("the second signal did not exit")
			}
			if got, want := errOut.String(), "delaybridge: second signal: exiting without waiting\n"; got != want {
				t.Errorf("stderr %q, want %q", got, want)
			}
		})
	}
	t.Run("stop", func(t *testing.T) {
		for _, signals := range []int{0, 1} {
			sigs := make(chan os.Signal)
			exited := make(chan int, 1)
			cleanups := new(exitCleanups)
			cleaned := false
			if _, err := cleanups.add("a test hook", func(context.Context) error { cleaned = true; return nil }); err != nil {
				t.Fatal(err)
			}
			ctx, stop := shutdownOnSignal(context.Background(), sigs, io.Discard, func(code int) { exited <- code }, cleanups, time.Now)
			if signals == 1 {
				sigs <- syscall.SIGTERM
			}
			stop()
			if ctx.Err() == nil {
				t.Error("stop did not cancel the context")
			}
			select {
			case sigs <- syscall.SIGINT:
				t.Errorf("after %d signal(s) and stop, a signal was still taken", signals)
			default:
			}
			select {
			case code := <-exited:
				t.Errorf("after %d signal(s) and stop: exit(%d)", signals, code)
			default:
			}
			if cleaned {
				t.Errorf("after %d signal(s) and stop, the cleanup ran", signals)
			}
			stop() // idempotent
		}
	})
}

// TestShutdownOnSignalCleanups: the forced exit runs the registered
// cleanups before calling exit, with the same exit code, and does not wait
// for one beyond the timeout.
func TestShutdownOnSignalCleanups(t *testing.T) {
	// forceExit sends two signals and returns the exit code and what
	// the cleanups had done when exit was called.
	forceExit := func(t *testing.T, cleanups *exitCleanups, second os.Signal, stderr io.Writer, state func() string) (int, string) {
		t.Helper()
		sigs := make(chan os.Signal)
		type exitCall struct {
			code  int
			state string
		}
		exited := make(chan exitCall, 1)
		// Each look at the clock a window later: the second signal is
		// never taken for the first one delivered twice.
		var clock atomic.Int64
		now := func() time.Time { return time.Unix(0, clock.Add(int64(repeatSignalWindow))) }
		_, stop := shutdownOnSignal(context.Background(), sigs, stderr, func(code int) { exited <- exitCall{code, state()} }, cleanups, now)
		defer stop()
		sigs <- syscall.SIGTERM
		sigs <- second
		select {
		case e := <-exited:
			return e.code, e.state
		case <-time.After(20 * time.Second):
			t.Fatal("the second signal did not exit")
		}
		return 0, ""
	}

	t.Run("before exit", func(t *testing.T) {
		for _, tc := range []struct {
			second os.Signal
			code   int
		}{{syscall.SIGINT, 130}, {syscall.SIGTERM, 143}} {
			cleanups := new(exitCleanups)
			var mu sync.Mutex
			var done []string
			for _, name := range []string{"a", "b"} {
				if _, err := cleanups.add(name, func(context.Context) error {
					mu.Lock()
					defer mu.Unlock()
					done = append(done, name)
					return nil
				}); err != nil {
					t.Fatal(err)
				}
			}
			removed, err := cleanups.add("removed", func(context.Context) error { t.Error("an unregistered cleanup ran"); return nil })
			if err != nil {
				t.Fatal(err)
			}
			removed()
			var errOut bytes.Buffer
			code, state := forceExit(t, cleanups, tc.second, &errOut, func() string {
				mu.Lock()
				defer mu.Unlock()
				return strings.Join(slices.Sorted(slices.Values(done)), ",")
			})
			if code != tc.code || state != "a,b" {
				t.Errorf("exit(%d) with cleanups %q done, want exit(%d) after a,b", code, state, tc.code)
			}
			if got, want := errOut.String(), "delaybridge: second signal: exiting without waiting\n"; got != want {
				t.Errorf("stderr %q, want %q", got, want)
			}
			if _, err := cleanups.add("late", func(context.Context) error { return nil }); err == nil {
				t.Error("a cleanup was registered after the forced exit started")
			}
		}
	})

	t.Run("bounded", func(t *testing.T) {
		cleanups := &exitCleanups{timeout: 200 * time.Millisecond}
		block := make(chan struct{})
		defer close(block)
		if _, err := cleanups.add("the stuck one", func(context.Context) error { <-block; return nil }); err != nil {
			t.Fatal(err)
		}
		if _, err := cleanups.add("the failing one", func(context.Context) error { return errors.New("boom") }); err != nil {
			t.Fatal(err)
		}
		var errOut bytes.Buffer
		start := time.Now()
		code, _ := forceExit(t, cleanups, syscall.SIGINT, &errOut, func() string { return "" })
		if code != 130 {
			t.Errorf("exit(%d), want 130", code)
		}
		if d := time.Since(start); d < 200*time.Millisecond {
			t.Errorf("exited after %s, before the cleanup timeout", d)
		}
		for _, want := range []string{
			"delaybridge: second signal: exiting without waiting\n",
			"delaybridge: cleanup of the failing one: boom\n",
			"delaybridge: cleanup of the stuck one did not finish within 200ms: left behind\n",
		} {
			if !strings.Contains(errOut.String(), want) {
				t.Errorf("stderr %q lacks %q", errOut.String(), want)
			}
		}
	})
}

// TestExitCleanupsTempDir: tempDir's directory is removed by the forced
// exit's cleanup, and nothing else is: not a sibling with the same prefix
// (another sandbox's), not one already released.
func TestExitCleanupsTempDir(t *testing.T) {
	tmpRoot := t.TempDir()
	t.Setenv("TMPDIR", tmpRoot)
	sibling := filepath.Join(tmpRoot, "delaybridge-dev-sibling")
	if err := os.MkdirAll(filepath.Join(sibling, "store"), 0o700); err != nil {
		t.Fatal(err)
	}
	cleanups := new(exitCleanups)
	released, remove, err := cleanups.tempDir("delaybridge-dev-")
	if err != nil {
		t.Fatal(err)
	}
	if err := remove(); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(released, 0o700); err != nil { // someone else's now
		t.Fatal(err)
	}
	dir, _, err := cleanups.tempDir("delaybridge-dev-")
	if err != nil {
		t.Fatal(err)
	}
	if filepath.Dir(dir) != tmpRoot {
		t.Fatalf("temp dir %s is not under TMPDIR %s", dir, tmpRoot)
	}
	if err := os.MkdirAll(filepath.Join(dir, "store", "wal"), 0o700); err != nil {
		t.Fatal(err)
	}
	if cleanups.started() || (*exitCleanups)(nil).started() {
		t.Fatal("forced exit started before run")
	}
	var errOut bytes.Buffer
	cleanups.run(&errOut)
	if errOut.Len() > 0 {
		t.Errorf("stderr %q", errOut.String())
	}
	if !cleanups.started() {
		t.Error("forced exit not started after run: a command's error would be reported over it")
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s after the forced exit's cleanup: %v, want it removed", dir, err)
	}
	for _, keep := range []string{filepath.Join(sibling, "store"), released} {
		if _, err := os.Stat(keep); err != nil {
			t.Errorf("%s was not ours and is gone: %v", keep, err)
		}
	}
	if _, _, err := cleanups.tempDir("delaybridge-dev-"); err == nil {
		t.Error("tempDir made a directory after the forced exit started")
	}
}

// TestDevPortInUse: a port the sandbox cannot take is refused at once with
// the flag that moves it (nats-server alone would only log it and never
// become ready, a 10 s wait without a reason), and every such port in one
// error: a second sandbox beside a running one (all three default ports
// taken) was refused for the admin port alone, then at the next try for
// the NATS port, then for the Kafka port.
func TestDevPortInUse(t *testing.T) {
	var ports []int
	for range 3 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	admin := fmt.Sprintf("127.0.0.1:%d", ports[2])
	for _, tc := range []struct {
		name  string
		o     devOptions
		flags []string
	}{
		{"nats", devOptions{kafkaPort: 0, natsPort: ports[0], admin: "127.0.0.1:0"}, []string{"-nats-port 0"}},
		{"kafka", devOptions{kafkaPort: ports[1], natsPort: -1, admin: "127.0.0.1:0"}, []string{"-kafka-port 0"}},
		{"admin", devOptions{kafkaPort: 0, natsPort: -1, admin: admin}, []string{"-admin 127.0.0.1:0"}},
		{"all three", devOptions{kafkaPort: ports[1], natsPort: ports[0], admin: admin}, []string{"-admin 127.0.0.1:0 -nats-port 0 -kafka-port 0 move this one",
			"admin on " + admin, fmt.Sprintf("nats server on port %d", ports[0]), fmt.Sprintf("kafka broker on port %d", ports[1])}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := runDev(context.Background(), tc.o, io.Discard, zap.NewNop(), nil, nil)
			if !errors.Is(err, syscall.EADDRINUSE) {
				t.Fatalf("runDev = %v, want address in use", err)
			}
			for _, f := range tc.flags {
				if !strings.Contains(err.Error(), f) {
					t.Errorf("runDev = %v, want it to say %q", err, f)
				}
			}
		})
	}
}

// TestDevAdminOnLoopbackOnly: the sandbox has no admin token, so an
// -admin reachable from other hosts is refused before anything starts,
// saying so (not with advice to set a token dev cannot take).
func TestDevAdminOnLoopbackOnly(t *testing.T) {
	for _, c := range []struct{ admin, want string }{
		{"0.0.0.0:0", "loopback address only"},
		{":0", "loopback address only"},
		{"127.0.0.1", "admin.listen"},
	} {
		err := runDev(context.Background(), devOptions{kafkaPort: 0, natsPort: -1, admin: c.admin}, io.Discard, zap.NewNop(), nil, nil)
		if err == nil || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), "set admin.token") {
			t.Errorf("-admin %s: %v, want an error saying %q", c.admin, err, c.want)
		}
	}
}

// TestDev runs the sandbox on free ports and sends a delayed message
// through it with a real Kafka client.
func TestDev(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out bytes.Buffer
	ready := make(chan devAddrs, 1)
	done := make(chan error, 1)
	obs, logs := observer.New(zap.InfoLevel)
	log := zap.New(zapcore.NewTee(zaptest.NewLogger(t).Core(), obs))
	go func() {
		done <- runDev(ctx, devOptions{kafkaPort: 0, natsPort: 0, admin: "127.0.0.1:0"}, &out, log, nil,
			func(_ *service.Service, a devAddrs) { ready <- a })
	}()
	var addrs devAddrs
	select {
	case addrs = <-ready:
	case err := <-done:
		t.Fatalf("dev stopped: %v", err)
	case <-time.After(60 * time.Second):
		t.Fatal("dev did not start")
	}
	if strings.HasSuffix(addrs.nats, ":4222") || strings.HasSuffix(addrs.kafka, ":9092") {
		t.Errorf("ports 0 gave %s and %s, want free ports (nats-server's own 0 is 4222)", addrs.nats, addrs.kafka)
	}
	if strings.HasSuffix(addrs.admin, ":0") {
		t.Errorf("-admin 127.0.0.1:0 gave %s, want the port taken", addrs.admin)
	}
	for _, want := range []string{"kcat -P -b " + addrs.kafka, "nats -s " + addrs.nats, "delay-after", "http://" + addrs.admin + "/v1/stats"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("banner lacks %q", want)
		}
	}
	eventuallyOK := time.Now().Add(30 * time.Second)
	for {
		r, err := http.Get("http://" + addrs.admin + "/healthz")
		if err == nil {
			r.Body.Close()
			if r.StatusCode == http.StatusOK {
				break
			}
		}
		if time.Now().After(eventuallyOK) {
			t.Fatalf("admin at %s (the banner's address): %v", addrs.admin, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(addrs.kafka), kgo.ConsumeTopics("orders"), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	rec := &kgo.Record{Topic: "delay", Key: []byte("order-42"), Value: []byte(`{"order":42}`), Headers: []kgo.RecordHeader{
		{Key: "delay-after", Value: []byte("50ms")}, {Key: "delay-target", Value: []byte("orders")},
	}}
	if err := cl.ProduceSync(ctx, rec).FirstErr(); err != nil {
		t.Fatal(err)
	}
	pctx, pcancel := context.WithTimeout(ctx, 30*time.Second)
	defer pcancel()
	var got *kgo.Record
	for got == nil {
		fs := cl.PollFetches(pctx)
		if pctx.Err() != nil {
			t.Fatal("the delayed message did not arrive on orders")
		}
		fs.EachRecord(func(r *kgo.Record) { got = r })
	}
	if string(got.Key) != "order-42" || string(got.Value) != `{"order":42}` {
		t.Errorf("delivered %q=%q", got.Key, got.Value)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("dev exit: %v", err)
	}
	// The service's "kept in the store" is followed by what dev does
	// without --data-dir: the store goes.
	if n := logs.FilterMessageSnippet("removing the sandbox").Len(); n != 1 {
		t.Errorf("%d lines say the sandbox is removed, want 1", n)
	}
}

// TestDevDataDirRestart runs the sandbox twice on one --data-dir, each time
// publishing three delayed messages before the bridge starts consuming. The
// bridge's store keeps each partition's high-water offset and the source
// starts after it; brokers that forgot their logs on exit restart the
// partition at offset 0, and the second run skipped the messages at offsets
// the first run had taken in.
func TestDevDataDirRestart(t *testing.T) {
	dataDir := t.TempDir()
	for run := range 2 {
		values := []string{fmt.Sprintf("run%d-a", run), fmt.Sprintf("run%d-b", run), fmt.Sprintf("run%d-c", run)}
		ctx, cancel := context.WithCancel(context.Background())
		done, addrs := startDev(t, ctx, devOptions{kafkaPort: 0, natsPort: -1, admin: "127.0.0.1:0", dataDir: dataDir}, nil,
			func(a devAddrs) { produceDelayed(t, ctx, a.kafka, values...) })
		awaitOrders(t, ctx, addrs.kafka, values...)
		cancel()
		if err := <-done; err != nil {
			t.Fatalf("run %d: dev exit: %v", run, err)
		}
	}
}

// startDev starts runDev and waits until it is serving; beforeRun (if not
// nil) is called after the brokers are up and before the bridge runs.
func startDev(t *testing.T, ctx context.Context, o devOptions, cleanups *exitCleanups, beforeRun func(devAddrs)) (<-chan error, devAddrs) {
	t.Helper()
	var out bytes.Buffer
	ready := make(chan devAddrs, 1)
	done := make(chan error, 1)
	go func() {
		done <- runDev(ctx, o, &out, zaptest.NewLogger(t), cleanups, func(_ *service.Service, a devAddrs) {
			if beforeRun != nil {
				beforeRun(a)
			}
			ready <- a
		})
	}()
	select {
	case a := <-ready:
		return done, a
	case err := <-done:
		t.Fatalf("dev stopped: %v", err)
	case <-time.After(60 * time.Second):
		t.Fatal("dev did not start")
	}
	return nil, devAddrs{}
}

// produceDelayed sends each value to the delay topic, all keyed order-42
// (one partition) with their own delay-id, due in 50 ms on topic orders.
func produceDelayed(t *testing.T, ctx context.Context, kafkaAddr string, values ...string) {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(kafkaAddr))
	if err != nil {
		t.Error(err)
		return
	}
	defer cl.Close()
	for _, v := range values {
		rec := &kgo.Record{Topic: "delay", Key: []byte("order-42"), Value: []byte(v), Headers: []kgo.RecordHeader{
			{Key: "delay-after", Value: []byte("50ms")}, {Key: "delay-target", Value: []byte("orders")},
			{Key: "delay-id", Value: []byte(v)},
		}}
		if err := cl.ProduceSync(ctx, rec).FirstErr(); err != nil {
			t.Error(err)
		}
	}
}

// awaitOrders waits until every value has been delivered on topic orders.
func awaitOrders(t *testing.T, ctx context.Context, kafkaAddr string, values ...string) {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(kafkaAddr), kgo.ConsumeTopics("orders"), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	missing := map[string]bool{}
	for _, v := range values {
		missing[v] = true
	}
	pctx, pcancel := context.WithTimeout(ctx, 20*time.Second)
	defer pcancel()
	for len(missing) > 0 {
		fs := cl.PollFetches(pctx)
		if pctx.Err() != nil {
			t.Fatalf("not delivered on orders: %v", slices.Sorted(maps.Keys(missing)))
		}
		fs.EachRecord(func(r *kgo.Record) { delete(missing, string(r.Value)) })
	}
}

// devChildEnv makes the test binary a sandbox for TestDevForcedExit (see
// TestMain): its value is the --data-dir, "-" for none.
const devChildEnv = "DELAYBRIDGE_TEST_DEV_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(blockChildEnv) != "" {
		_, _ = io.Copy(io.Discard, os.Stdin)
		os.Exit(0)
	}
	if args := os.Getenv(mainChildEnv); args != "" {
		os.Exit(realMain(strings.Fields(args), os.Stdout, os.Stderr))
	}
	if dataDir := os.Getenv(devChildEnv); dataDir != "" {
		devChild(dataDir)
		os.Exit(3) // devChild returns only on failure
	}
	os.Exit(m.Run())
}

// devChild runs the sandbox as `delaybridge dev` does, the forced exit
// calling os.Exit, except that the sandbox does not see the signals (a
// context of its own), as when its graceful shutdown hangs: it is still
// running, with its store and JetStream open in its directory, when the
// second signal comes. It prints "ready" once the sandbox is serving and
// "stopping" when the first signal has been taken (the kernel merges a
// second SIGINT sent before that into the first).
func devChild(dataDir string) {
	if dataDir == "-" {
		dataDir = ""
	}
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	cleanups := new(exitCleanups)
	// Each look at the clock a repeat window later: the test's second
	// SIGINT follows "stopping" within milliseconds, which would be taken
	// for the first one delivered twice (TestShutdownOnSignalRepeat).
	var clock atomic.Int64
	now := func() time.Time { return time.Unix(0, clock.Add(int64(repeatSignalWindow))) }
	ctx, stop := shutdownOnSignal(context.Background(), sigs, os.Stderr, os.Exit, cleanups, now)
	defer stop()
	go func() {
		<-ctx.Done()
		fmt.Println("stopping")
	}()
	err := runDev(context.Background(), devOptions{kafkaPort: 0, natsPort: -1, admin: "127.0.0.1:0", dataDir: dataDir}, io.Discard, zap.NewNop(), cleanups,
		func(*service.Service, devAddrs) { fmt.Println("ready") })
	if cleanups.started() {
		stop() // as realMain: the forced exit owns the exit
	}
	fmt.Fprintln(os.Stderr, "dev child: runDev returned:", err)
}

// startChild runs this test binary again as a child process (see
// TestMain) with env added and TMPDIR=tmpRoot, for at most 2 minutes. It
// returns the child, its stdout lines (closed when the child closes its
// stdout) and its stderr.
func startChild(t *testing.T, tmpRoot string, env ...string) (*exec.Cmd, <-chan string, *bytes.Buffer) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	// A child still running at the deadline is stopped with SIGQUIT
	// first: the Go runtime then writes every goroutine's stack to its
	// stderr, which a test that sees it hang can log.
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGQUIT) }
	cmd.WaitDelay = 10 * time.Second
	cmd.Env = append(append(os.Environ(), env...), "TMPDIR="+tmpRoot, "GOTRACEBACK=all")
	errOut := new(bytes.Buffer)
	cmd.Stderr = errOut
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := make(chan string, 2)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
	}()
	return cmd, lines, errOut
}

// TestDevForcedExit forces the exit (two signals) of a running sandbox in
// a child process: the sandbox's temporary directory (its store and
// JetStream data) is gone when the process has exited with 130, and
// nothing else is removed: not another sandbox's directory, not a
// --data-dir.
func TestDevForcedExit(t *testing.T) {
	exists := func(p string) bool {
		_, err := os.Stat(p)
		return err == nil
	}
	for _, withDataDir := range []bool{false, true} {
		name := "temp dir"
		if withDataDir {
			name = "data dir"
		}
		t.Run(name, func(t *testing.T) {
			tmpRoot := t.TempDir()
			sibling := filepath.Join(tmpRoot, "delaybridge-dev-sibling") // another sandbox's
			if err := os.MkdirAll(filepath.Join(sibling, "store"), 0o700); err != nil {
				t.Fatal(err)
			}
			devDirs := func() []string {
				m, err := filepath.Glob(filepath.Join(tmpRoot, "delaybridge-dev-*"))
				if err != nil {
					t.Fatal(err)
				}
				return slices.DeleteFunc(m, func(d string) bool { return d == sibling })
			}
			dataDir := "-"
			if withDataDir {
				dataDir = filepath.Join(t.TempDir(), "sandbox")
			}

			cmd, lines, errOut := startChild(t, tmpRoot, devChildEnv+"="+dataDir)
			await := func(want string) {
				t.Helper()
				select {
				case got, ok := <-lines:
					if !ok || got != want {
						_ = cmd.Process.Kill()
						_ = cmd.Wait()
						t.Fatalf("the sandbox printed %q (open %v), want %q; stderr: %s", got, ok, want, errOut.String())
					}
				case <-time.After(60 * time.Second):
					t.Fatalf("the sandbox did not print %q", want)
				}
			}
			await("ready")

			root := dataDir
			if !withDataDir {
				dirs := devDirs()
				if len(dirs) != 1 {
					t.Fatalf("sandbox temp dirs %q, want one", dirs)
				}
				root = dirs[0]
			} else if dirs := devDirs(); len(dirs) != 0 {
				t.Errorf("with --data-dir the sandbox made temp dirs %q", dirs)
			}
			for _, sub := range []string{"store", "jetstream"} {
				if !exists(filepath.Join(root, sub)) {
					t.Fatalf("no %s in %s", sub, root)
				}
			}

			if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
				t.Fatal(err)
			}
			await("stopping")
			if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
				t.Fatal(err)
			}
			for range lines { // until the child closes its stdout
			}
			_ = cmd.Wait()
			if code := cmd.ProcessState.ExitCode(); code != 130 {
				t.Errorf("exit code %d, want 130; stderr: %s", code, errOut.String())
			}
			if got, want := errOut.String(), "delaybridge: second signal: exiting without waiting\n"; got != want {
				t.Errorf("stderr %q, want %q", got, want)
			}
			if exists(root) != withDataDir {
				t.Errorf("after the forced exit, %s exists: %v, want %v", root, exists(root), withDataDir)
			}
			if withDataDir && !exists(filepath.Join(dataDir, "store")) {
				t.Error("the forced exit removed the --data-dir store")
			}
			if !exists(filepath.Join(sibling, "store")) {
				t.Error("the forced exit removed another sandbox's directory")
			}
		})
	}
}

// TestDevBannerExamplesSchedule: every kcat example in the banner that
// schedules (delay-after or delay-at) is a valid schedule under the
// sandbox's rules at any time of day, the absolute one within max_delay (a
// fixed date went stale and was dead-lettered as delay-too-long), and the
// banner says what survives the exit.
func TestDevBannerExamplesSchedule(t *testing.T) {
	headerRe := regexp.MustCompile(`-H (delay-[a-z]+)=(\S+)`)
	for _, now := range []time.Time{
		time.Date(2026, 11, 23, 8, 59, 59, 0, time.UTC),
		time.Date(2026, 11, 23, 9, 0, 0, 0, time.UTC),
		time.Date(2026, 12, 31, 23, 30, 0, 0, time.FixedZone("CET", 3600)),
	} {
		banner := devBanner("127.0.0.1:9092", "nats://127.0.0.1:4222", "127.0.0.1:8080", now, "")
		if !strings.Contains(banner, "everything is forgotten on exit") {
			t.Errorf("banner without --data-dir does not say it forgets")
		}
		var examples int
		for _, line := range strings.Split(banner, "\n") {
			line = strings.TrimSpace(line)
			if !strings.Contains(line, "kcat -P") && !strings.HasPrefix(line, "-H delay-") {
				continue
			}
			var hs []codec.Header
			for _, m := range headerRe.FindAllStringSubmatch(line, -1) {
				hs = append(hs, codec.Header{Key: m[1], Value: []byte(m[2])})
			}
			if len(hs) == 0 || headerOf(hs, "delay-cancel") != "" || headerOf(hs, "delay-target") == "" {
				continue // the cancel, or the first half of a continued line
			}
			examples++
			task := codec.Parse(&codec.Message{Transport: codec.TransportKafka, Source: "delay", Key: []byte("k"), Value: []byte("v"),
				Headers: hs, Time: now}, &codec.Rules{MaxDelay: config.DefaultMaxDelay, DLQ: "delay.dlq",
				Transports: func(codec.Transport) bool { return true }})
			if task.Kind != codec.KindSchedule {
				t.Errorf("at %v the example %q is a %v: %s %s", now, line, task.Kind, task.Code, task.Detail)
			}
		}
		if examples != 2 {
			t.Errorf("found %d scheduling kcat examples, want 2 (delay-after, delay-at)", examples)
		}
		// kcat sends no message for an empty input line (tried by hand:
		// the cancel example did nothing): every producing example pipes
		// a body, and the tombstone one sends its empty value as null.
		if strings.Contains(banner, "echo '' |") || !strings.Contains(banner, "echo cancel | kcat -P") ||
			!strings.Contains(banner, "echo 'order-42:' | kcat -P -Z -K:") {
			t.Errorf("the cancel examples are not ones kcat sends:\n%s", banner)
		}
	}
	kept := devBanner("127.0.0.1:9092", "nats://127.0.0.1:4222", "127.0.0.1:8080", time.Now(), "/data/sandbox")
	if strings.Contains(kept, "forgotten") || !strings.Contains(kept, "/data/sandbox") {
		t.Errorf("banner with --data-dir: %q", strings.SplitN(strings.TrimSpace(kept), "\n", 2)[0])
	}
}

func headerOf(hs []codec.Header, k string) string {
	for _, h := range hs {
		if h.Key == k {
			return string(h.Value)
		}
	}
	return ""
}
