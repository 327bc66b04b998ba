// Package benchrun is the benchmark report of `delaybridge bench`: one run
// on one machine that measures the bridge against the raw broker pipe it is
// built from, the lateness of deliveries at a paced rate, how many pending
// tasks fit in bounded memory, and how long recovery takes after kill -9.
//
// Brokers run in process (kfake, nats-server with JetStream), the bridge is
// bridge/service with the real clock and the shipped defaults, and every
// message is 1 KB. Goals are reported next to the numbers, never asserted:
// the report is a measurement, not a test.
package benchrun

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/shard"
)

// Options configure a report.
type Options struct {
	N        int // messages per transport for the throughput runs
	PacedN   int // messages per transport for the paced lateness runs
	Rate     int // paced publish rate, msg/s
	Delay    time.Duration
	Capacity int      // pending tasks for the capacity run
	Payload  int      // payload bytes per task in the capacity run
	Recovery int      // pending tasks at the kill -9
	Parts    []string // subset of throughput, lateness, capacity, recovery; nil = all
	// Transports of the throughput and lateness runs: kafka, nats; nil = both.
	Transports []string
	Out        string // directory for report.json, lateness.png, report.md
	Profile    bool   // write a CPU profile of each bridge run into Out (bridge-TRANSPORT.cpu.pprof, bridge-TRANSPORT-paced.cpu.pprof)
	Exe        string // this binary: the bridge runs as `Exe run`, engine-level children as `Exe bench -child`; "" = bridge in process
	WorkDir    string // scratch space (stores, broker data); removed afterwards
	Command    string // the command line, recorded in the report
	Logger     *zap.Logger
	Progress   io.Writer // progress lines; nil = none
}

// Defaults are the full run; Quick is the small one for development.
func Defaults(quick bool) Options {
	if quick {
		return Options{N: 20_000, PacedN: 10_000, Rate: 5000, Delay: time.Second, Capacity: 200_000, Payload: 1024, Recovery: 100_000}
	}
	return Options{N: 200_000, PacedN: 50_000, Rate: 5000, Delay: time.Second, Capacity: 10_000_000, Payload: 1024, Recovery: 1_000_000}
}

// Machine describes where the report was made.
type Machine struct {
	NumCPU    int    `json:"nproc"`
	CPU       string `json:"cpu"`
	GoVersion string `json:"go"`
	OS        string `json:"os"`
	MemTotal  string `json:"mem_total"`
	// FreshPageUs is the time per 4 KiB page of a first write to new
	// memory (freshPageMicros), measured when the report starts.
	FreshPageUs float64 `json:"fresh_page_us,omitempty"`
}

// Report is the result of Run.
type Report struct {
	Command  string         `json:"command"`
	Started  time.Time      `json:"started"`
	Took     string         `json:"took"`
	Machine  Machine        `json:"machine"`
	Runs     []*Measurement `json:"runs"`
	Capacity *Capacity      `json:"capacity,omitempty"`
	Recovery *Recovery      `json:"recovery,omitempty"`
	Errors   []string       `json:"errors,omitempty"`
}

func machine() Machine {
	m := Machine{NumCPU: runtime.NumCPU(), GoVersion: runtime.Version(), OS: runtime.GOOS + "/" + runtime.GOARCH}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "model name"); ok {
				m.CPU = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(v), ":"))
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "MemTotal:"); ok {
				m.MemTotal = strings.TrimSpace(v)
			}
		}
	}
	m.FreshPageUs = freshPageMicros()
	return m
}

// Parts are the parts of a report Options.Parts may name.
var Parts = []string{"throughput", "lateness", "capacity", "recovery"}

func (o *Options) want(part string) bool {
	if len(o.Parts) == 0 {
		return true
	}
	for _, p := range o.Parts {
		if p == part {
			return true
		}
	}
	return false
}

// How the two raw runs take their rate, in progress lines and the report.
const (
	rawAckHow  = "rate at its producer acks"
	rawReadHow = "rate at a consumer of its target"
)

func (o *Options) transports() []string {
	if len(o.Transports) == 0 {
		return []string{Kafka, NATS}
	}
	return o.Transports
}

func (o *Options) progress(format string, args ...any) {
	if o.Progress != nil {
		fmt.Fprintf(o.Progress, "%s "+format+"\n", append([]any{time.Now().Format("15:04:05")}, args...)...)
	}
}

// Run measures what o asks for and writes report.json and lateness.png into
// o.Out. A part that fails is recorded in Report.Errors; the others still
// run.
func Run(ctx context.Context, o Options) (*Report, error) {
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	if o.Out == "" {
		o.Out = "."
	}
	if err := os.MkdirAll(o.Out, 0o755); err != nil {
		return nil, fmt.Errorf("benchrun: %w", err)
	}
	work, err := os.MkdirTemp(o.WorkDir, "delaybridge-bench-")
	if err != nil {
		return nil, fmt.Errorf("benchrun: %w", err)
	}
	defer os.RemoveAll(work)
	r := &Report{Command: o.Command, Started: time.Now().UTC(), Machine: machine()}
	fail := func(part string, err error) {
		o.progress("%s: %v", part, err)
		r.Errors = append(r.Errors, part+": "+err.Error())
	}
	step, last := 0, ""
	sub := func() string { // a fresh scratch dir per run; the previous one is removed
		os.RemoveAll(last)
		// Each run starts its own brokers in this process; give back the
		// heap the last run's brokers and readers left, so a run does not
		// pay for the one before it.
		debug.FreeOSMemory()
		step++
		last = filepath.Join(work, fmt.Sprint(step))
		return last
	}
	// Save after each part, so an interrupted run keeps what it measured.
	save := func() {
		r.Took = time.Since(r.Started).Round(time.Second).String()
		if err := r.save(o.Out); err != nil {
			o.progress("save: %v", err)
		}
	}

	if o.want("throughput") {
		for _, tr := range o.transports() {
			for _, read := range []bool{false, true} {
				how := rawAckHow
				if read {
					how = rawReadHow
				}
				o.progress("%s raw pipe, %d messages, %s", tr, o.N, how)
				if run, err := rawRun(ctx, tr, o.N, sub(), read); err != nil {
					fail(tr+" raw", err)
				} else {
					r.Runs = append(r.Runs, run)
				}
			}
			o.progress("%s bridge, %d messages, delay %v", tr, o.N, o.Delay)
			prof := ""
			if o.Profile {
				prof = filepath.Join(o.Out, "bridge-"+tr+".cpu.pprof")
			}
			if run, err := bridgeRun(ctx, tr, o.N, 0, 0, o.Delay, sub(), o.Exe, prof, o.Logger); err != nil {
				fail(tr+" bridge", err)
			} else {
				r.Runs = append(r.Runs, run)
			}
			save()
			o.progress("%s bridge, %d messages, delay %v, after %d through the same process", tr, o.N, o.Delay, o.N)
			if run, err := bridgeRun(ctx, tr, o.N, 0, o.N, o.Delay, sub(), o.Exe, "", o.Logger); err != nil {
				fail(tr+" bridge warm", err)
			} else {
				r.Runs = append(r.Runs, run)
			}
			save()
		}
	}
	if o.want("lateness") {
		for _, tr := range o.transports() {
			o.progress("%s paced at %d msg/s, %d messages", tr, o.Rate, o.PacedN)
			prof := ""
			if o.Profile {
				prof = filepath.Join(o.Out, "bridge-"+tr+"-paced.cpu.pprof")
			}
			if run, err := bridgeRun(ctx, tr, o.PacedN, o.Rate, 0, o.Delay, sub(), o.Exe, prof, o.Logger); err != nil {
				fail(tr+" paced", err)
			} else {
				r.Runs = append(r.Runs, run)
			}
			save()
		}
	}
	if o.want("recovery") {
		o.progress("recovery: %d pending, kill -9, reopen (child processes)", o.Recovery)
		if rc, err := recoveryRun(ctx, o.Exe, sub(), o.Recovery); err != nil {
			fail("recovery", err)
		} else {
			r.Recovery = rc
		}
	}
	save()
	if o.want("capacity") {
		o.progress("capacity: %d tasks over 30 days (child process)", o.Capacity)
		if c, err := capacityRun(ctx, o.Exe, sub(), o.Capacity, o.Payload); err != nil {
			fail("capacity", err)
		} else {
			r.Capacity = c
		}
	}
	r.Took = time.Since(r.Started).Round(time.Second).String()

	if err := r.save(o.Out); err != nil {
		return r, err
	}
	return r, nil
}

func (r *Report) save(dir string) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "report.json"), b, 0o644); err != nil {
		return fmt.Errorf("benchrun: %w", err)
	}
	var ss []series
	for _, run := range r.Runs {
		if len(run.samples) == 0 {
			continue
		}
		name := fmt.Sprintf("%s %s", run.Transport, run.Mode)
		if run.Mode == "paced" {
			name = fmt.Sprintf("%s paced %d/s", run.Transport, run.PublishRate)
		}
		ss = append(ss, series{name: name, xs: run.samples, col: palette[len(ss)%len(palette)]})
	}
	if len(ss) > 0 {
		png, err := latencyCDF(ss)
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dir, "lateness.png"), png, 0o644); err != nil {
			return fmt.Errorf("benchrun: %w", err)
		}
	}
	return os.WriteFile(filepath.Join(dir, "report.md"), []byte(r.Markdown()), 0o644)
}

func (r *Report) find(tr, mode string) *Measurement {
	for _, run := range r.Runs {
		if run.Transport == tr && run.Mode == mode {
			return run
		}
	}
	return nil
}

func verdict(ok bool) string {
	if ok {
		return "met"
	}
	return "**missed**"
}

// recoveryGoalPending is the pending count the recovery goal (ready in
// <= 3 s after kill -9) is set at.
const recoveryGoalPending = 1_000_000

// goalRows are the rows of the goals table for the parts that ran: the
// throughput ratios and lateness of each transport, the capacity run's
// peak RSS and the recovery run's time to ready and lost tasks.
func (r *Report) goalRows() string {
	var b strings.Builder
	for _, tr := range []string{Kafka, NATS} {
		raw, read, br := r.find(tr, "raw"), r.find(tr, "raw-read"), r.find(tr, "bridge")
		if raw != nil && br != nil {
			ratio := br.Rate / raw.Rate
			fmt.Fprintf(&b, "| bridge / raw pipe throughput | %s | %.2f | >= 0.5 | %s |\n", tr, ratio, verdict(ratio >= 0.5))
		}
		if read != nil && br != nil {
			ratio := br.Rate / read.Rate
			fmt.Fprintf(&b, "| bridge / raw pipe throughput, both read at a target consumer | %s | %.2f | >= 0.5 | %s |\n", tr, ratio, verdict(ratio >= 0.5))
		}
		// The same bridge process after a first burst: a long-running
		// bridge's memory is taken already. For information: the
		// goal's rows are those of the first run above.
		if w := r.find(tr, "bridge-warm"); w != nil {
			for _, base := range []*Measurement{raw, read} {
				if base == nil {
					continue
				}
				how := "at its producer acks"
				if base == read {
					how = "both read at a target consumer"
				}
				ratio := w.Rate / base.Rate
				fmt.Fprintf(&b, "| bridge after %d through the same process / raw pipe, %s | %s | %.2f | (>= 0.5) | for information |\n", w.Warm, how, tr, ratio)
			}
		}
		if p := r.find(tr, "paced"); p != nil && p.Lateness != nil {
			fmt.Fprintf(&b, "| p99 lateness at %d msg/s | %s | %.1f ms | <= 50 ms | %s |\n", p.PublishRate, tr, p.Lateness.P99, verdict(p.Lateness.P99 <= 50))
		}
	}
	if c := r.Capacity; c != nil {
		// The store's fixed memory (its cache, memtables included)
		// plus 256 MB for everything else.
		limit := float64(shard.DefaultCacheBytes>>20) + 256
		fmt.Fprintf(&b, "| peak RSS with %d pending | engine | %.0f MB | < %.0f MB (store cache + 256) | %s |\n", c.Tasks, c.PeakRSSMB, limit, verdict(c.PeakRSSMB < limit))
	}
	if rc := r.Recovery; rc != nil {
		// The goal is set at 1 M pending: fewer (-quick, -recovery N)
		// say little about it.
		v, goal := verdict(rc.ReadySecs <= 3), "<= 3 s"
		if rc.Pending < recoveryGoalPending {
			v, goal = "for information", "(<= 3 s at 1 M)"
		}
		fmt.Fprintf(&b, "| ready after kill -9 with %d pending (process start to open) | engine | %.2f s | %s | %s |\n", rc.Pending, rc.ReadySecs, goal, v)
		fmt.Fprintf(&b, "| acknowledged tasks lost at the kill -9 | engine | %d | 0 | %s |\n", rc.Lost, verdict(rc.Lost == 0))
	}
	return b.String()
}

// Markdown renders the report as the tables of docs/benchmarks.md.
func (r *Report) Markdown() string {
	var b strings.Builder
	m := r.Machine
	fmt.Fprintf(&b, "## delaybridge benchmark report\n\n")
	fmt.Fprintf(&b, "- command: `%s`\n- started: %s, took %s\n- machine: %d CPUs (%s), %s, %s, memory %s\n",
		r.Command, r.Started.Format(time.RFC3339), r.Took, m.NumCPU, m.CPU, m.OS, m.GoVersion, m.MemTotal)
	if m.FreshPageUs > 0 {
		fmt.Fprintf(&b, "- fresh memory: %.2f µs per 4 KiB page (first write to each page of a new 64 MiB mapping; well under 1 µs on bare metal); the page-fault columns count such first touches\n", m.FreshPageUs)
	}
	b.WriteString("\n")

	if len(r.Runs) > 0 {
		fmt.Fprintf(&b, "### Throughput and lateness (1 KB messages, brokers in process)\n\n")
		fmt.Fprintf(&b, "| transport | run | n | rate msg/s | ingest msg/s | fire msg/s | lateness p50 / p99 / p999 / max ms | dups | ingest commits (mean ms) | publishes (mean ms, mean batch) | bridge CPU µs/msg | bench process CPU µs/msg | bridge page faults /msg | bench process page faults /msg | bridge peak RSS MB | bench process peak RSS MB |\n")
		fmt.Fprintf(&b, "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
		for _, run := range r.Runs {
			what := map[string]string{"raw": "raw pipe (no delay, no store), " + rawAckHow, "raw-read": "raw pipe, " + rawReadHow, "bridge": fmt.Sprintf("bridge, delay %d ms, unpaced", run.DelayMs),
				"bridge-warm": fmt.Sprintf("bridge, delay %d ms, unpaced, after %d through the same process", run.DelayMs, run.Warm),
				"paced":       fmt.Sprintf("bridge, delay %d ms, paced %d/s", run.DelayMs, run.PublishRate)}[run.Mode]
			lat := "-"
			if s := run.Lateness; s != nil {
				lat = fmt.Sprintf("%.1f / %.1f / %.1f / %.1f", s.P50, s.P99, s.P999, s.Max)
			}
			commits := "-"
			if run.IngestCommits > 0 {
				commits = fmt.Sprintf("%d (%.1f)", run.IngestCommits, run.IngestCommitMs)
			}
			pubs := "-"
			if run.Publishes > 0 {
				pubs = fmt.Sprintf("%d (%.1f, %.0f)", run.Publishes, run.PublishMs, float64(run.N)/float64(run.Publishes))
			}
			cpu := "-"
			if run.BridgeCPUUs > 0 {
				cpu = fmt.Sprintf("%.1f", run.BridgeCPUUs)
			}
			faults := "-"
			if run.BridgeFaults > 0 {
				faults = fmt.Sprintf("%.2f", run.BridgeFaults)
			}
			fmt.Fprintf(&b, "| %s | %s | %d | %.0f | %s | %s | %s | %d | %s | %s | %s | %.1f | %s | %.2f | %s | %.0f |\n", run.Transport, what, run.N, run.Rate,
				orDash(run.IngestRate), orDash(run.FireRate), lat, run.Duplicates, commits, pubs, cpu, run.BenchCPUUs, faults, run.BenchFaults, orDash(run.BridgeRSSMB), run.PeakRSSMB)
		}
		b.WriteString("\n")
	}
	if goals := r.goalRows(); goals != "" {
		fmt.Fprintf(&b, "### Goals\n\n| goal | transport | value | goal | verdict |\n|---|---|---:|---:|---|\n%s\n", goals)
	}
	if c := r.Capacity; c != nil {
		fmt.Fprintf(&b, "### Pending capacity (engine, child process, shipped defaults: 8 shards, 10 min horizon)\n\n")
		fmt.Fprintf(&b, "| tasks | payload | due spread | ingest s | ingest tasks/s | in wheel | RSS after ingest MB | peak RSS MB | disk GB | clean reopen s | RSS after reopen MB |\n")
		fmt.Fprintf(&b, "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
		fmt.Fprintf(&b, "| %d | %d B | %d days | %.1f | %.0f | %d | %.0f | %.0f | %.2f | %.2f | %.0f |\n\n",
			c.Tasks, c.PayloadBytes, c.SpreadDays, c.IngestSecs, c.IngestRate, c.InWheel, c.RSSMB, c.PeakRSSMB, c.DiskGB, c.ReopenSecs, c.ReopenRSSMB)
	}
	if rc := r.Recovery; rc != nil {
		fmt.Fprintf(&b, "### Recovery after kill -9 (engine, child processes)\n\n")
		fmt.Fprintf(&b, "| pending at kill | fill s | recovered pending | in wheel after open | shard.Open s | process start to open s | peak RSS MB | acknowledged tasks lost |\n")
		fmt.Fprintf(&b, "|---:|---:|---:|---:|---:|---:|---:|---:|\n")
		fmt.Fprintf(&b, "| %d | %.1f | %d | %d | %.2f | %.2f | %.0f | %d |\n\n",
			rc.Pending, rc.KillAfterS, rc.Recovered, rc.InWheel, rc.OpenSecs, rc.ReadySecs, rc.PeakRSSMB, rc.Lost)
	}
	for _, e := range r.Errors {
		fmt.Fprintf(&b, "- error: %s\n", e)
	}
	return b.String()
}

func orDash(v float64) string {
	if v == 0 {
		return "-"
	}
	return fmt.Sprintf("%.0f", v)
}
