package benchrun

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// bridgeRunner is a running bridge the measurements read metrics from: in
// process (bridge/service) or the shipped binary as a child process.
type bridgeRunner interface {
	counter(name string) float64
	histogram(name, label, value string) (count uint64, sum float64)
	// peakRSSMB is the bridge's own VmHWM, or 0 when it shares the
	// benchmark process.
	peakRSSMB() float64
	// cpuSeconds is the bridge's own CPU time so far (user + system), or
	// 0 when it shares the benchmark process.
	cpuSeconds() float64
	// minorFaults is the bridge's own minor page faults so far, or 0
	// when it shares the benchmark process.
	minorFaults() float64
	close() error
}

func (br *bridge) peakRSSMB() float64 { return 0 }

func (br *bridge) cpuSeconds() float64 { return 0 }

func (br *bridge) minorFaults() float64 { return 0 }

func (cb *childBridge) cpuSeconds() float64 { return cb.counter("process_cpu_seconds_total") }

// childBridge is `delaybridge run --config FILE` as a child process; its
// metrics come from the admin /metrics endpoint and its RSS from
// /proc/PID/status, so it is the bridge's alone.
type childBridge struct {
	cmd   *exec.Cmd
	admin string
	done  chan error
	log   *os.File
}

func startChildBridge(ctx context.Context, exe string, b *broker, dataDir string, pprof bool) (*childBridge, error) {
	yml, admin, err := bridgeYAML(b, dataDir, pprof)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dataDir, 0o755); err != nil {
		return nil, err
	}
	cfgPath := filepath.Join(filepath.Dir(dataDir), "bridge.yaml")
	if err := os.WriteFile(cfgPath, []byte(yml), 0o600); err != nil {
		return nil, err
	}
	logf, err := os.Create(filepath.Join(filepath.Dir(dataDir), "bridge.log"))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe, "run", "--config", cfgPath)
	for _, kv := range os.Environ() { // the bridge refuses unknown DELAYBRIDGE_* keys
		if !strings.HasPrefix(kv, "DELAYBRIDGE_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	dieWithParent(cmd)
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("benchrun: start bridge: %w", err)
	}
	cb := &childBridge{cmd: cmd, admin: admin, done: make(chan error, 1), log: logf}
	go func() { cb.done <- cmd.Wait() }()
	deadline := time.Now().Add(time.Minute)
	for {
		if resp, err := http.Get("http://" + admin + "/readyz"); err == nil {
			resp.Body.Close()
			// Ready, and firing no longer paused at start (catch_up_wait):
			// the runs measure a bridge in its steady state.
			if resp.StatusCode == http.StatusOK && !cb.firingPaused() {
				return cb, nil
			}
		}
		select {
		case err := <-cb.done:
			cb.done <- err
			return nil, fmt.Errorf("benchrun: bridge exited at start: %v (log %s)", err, logf.Name())
		case <-time.After(50 * time.Millisecond):
		case <-ctx.Done():
			cb.close()
			return nil, ctx.Err()
		}
		if time.Now().After(deadline) {
			cb.close()
			return nil, fmt.Errorf("benchrun: bridge not ready within a minute (log %s)", logf.Name())
		}
	}
}

// scrapeClient asks for the exposition uncompressed: the bridge then spends
// no CPU on gzip for the benchmark's own polling.
var scrapeClient = &http.Client{Transport: &http.Transport{DisableCompression: true}, Timeout: 10 * time.Second}

// metrics reads the Prometheus text exposition of the named families (all
// when none are named): series -> value. Naming them (the handler's
// name[] filter) keeps a scrape from encoding every family.
func (cb *childBridge) metrics(families ...string) map[string]float64 {
	out := map[string]float64{}
	q := url.Values{"name[]": families}
	resp, err := scrapeClient.Get("http://" + cb.admin + "/metrics?" + q.Encode())
	if err != nil {
		return out
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return out // refused (a token): no figures rather than an error body
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err == nil {
			out[line[:i]] = v
		}
	}
	return out
}

func (cb *childBridge) counter(name string) float64 {
	var sum float64
	for series, v := range cb.metrics(name) {
		if series == name || strings.HasPrefix(series, name+"{") {
			sum += v
		}
	}
	return sum
}

func (cb *childBridge) histogram(name, label, value string) (uint64, float64) {
	var count, sum float64
	want := label + `="` + value + `"`
	for series, v := range cb.metrics(name) {
		if !strings.Contains(series, want) {
			continue
		}
		switch {
		case strings.HasPrefix(series, name+"_count{"):
			count += v
		case strings.HasPrefix(series, name+"_sum{"):
			sum += v
		}
	}
	return uint64(count), sum
}

// cpuProfile records secs seconds of the bridge's CPU profile into path
// (the bridge runs with admin.pprof).
func (cb *childBridge) cpuProfile(secs int, path string) error {
	resp, err := http.Get(fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", cb.admin, secs))
	if err != nil {
		return fmt.Errorf("benchrun: cpu profile: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("benchrun: cpu profile: %s", resp.Status)
	}
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("benchrun: cpu profile: %w", err)
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return fmt.Errorf("benchrun: cpu profile: %w", err)
	}
	return f.Close()
}

func (cb *childBridge) minorFaults() float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", cb.cmd.Process.Pid))
	if err != nil {
		return 0
	}
	return statMinorFaults(string(b))
}

func (cb *childBridge) peakRSSMB() float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", cb.cmd.Process.Pid))
	if err != nil {
		return 0
	}
	return statusField(string(b), "VmHWM")
}

func (cb *childBridge) close() error {
	_ = cb.cmd.Process.Signal(syscall.SIGTERM)
	defer cb.log.Close()
	select {
	case err := <-cb.done:
		cb.done <- err
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return fmt.Errorf("benchrun: bridge exited: %w (log %s)", err, cb.log.Name())
		}
		return nil
	case <-time.After(time.Minute):
		_ = cb.cmd.Process.Kill()
		return errors.New("benchrun: bridge did not stop within a minute")
	}
}

// firingPaused reports whether the bridge says its firing is paused
// (delaybridge_firing_paused 1), or cannot be asked.
func (cb *childBridge) firingPaused() bool {
	v, ok := cb.metrics("delaybridge_firing_paused")["delaybridge_firing_paused"]
	return !ok || v != 0
}
