package benchrun

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/shard"
)

// Engine-level measurements run in child processes (the bench binary
// re-executed with -child), so their RSS is the engine's alone and a
// SIGKILL is a real crash.

// Capacity is the pending-capacity measurement.
type Capacity struct {
	Tasks        int     `json:"tasks"`
	PayloadBytes int     `json:"payload_bytes"`
	SpreadDays   int     `json:"spread_days"`
	IngestSecs   float64 `json:"ingest_seconds"`
	IngestRate   float64 `json:"ingest_rate"`
	Pending      int64   `json:"pending"`
	InWheel      int     `json:"in_wheel"`
	RSSMB        float64 `json:"rss_mb"`      // VmRSS after ingest
	PeakRSSMB    float64 `json:"peak_rss_mb"` // VmHWM of the child over the whole run
	DiskGB       float64 `json:"disk_gb"`
	ReopenSecs   float64 `json:"reopen_seconds"` // clean Close, then Open
	ReopenRSSMB  float64 `json:"reopen_rss_mb"`  // VmRSS after the reopen
}

// Recovery is the kill -9 recovery measurement.
type Recovery struct {
	Pending    int     `json:"pending_at_kill"` // acknowledged before the kill (at least)
	Recovered  int64   `json:"recovered_pending"`
	InWheel    int     `json:"in_wheel"`
	OpenSecs   float64 `json:"open_seconds"`  // shard.Open in the new process
	ReadySecs  float64 `json:"ready_seconds"` // process start to engine open, as seen by the parent
	PeakRSSMB  float64 `json:"peak_rss_mb"`   // VmHWM of the recovering process
	KillAfterS float64 `json:"fill_seconds"`  // time the first process took to ingest
	Lost       int64   `json:"lost"`          // acknowledged tasks missing after recovery
}

func engineOptions(dir string) shard.Options {
	// The shipped defaults: 8 shards, 10 min horizon.
	return shard.Options{Dir: dir, Logger: zap.NewNop()}
}

func task(id string, due int64, payload []byte) codec.Task {
	return codec.Task{
		Kind: codec.KindSchedule, ID: id, Source: "bench", Origin: "kafka:bench/0@1",
		Stamp: due, Offset: 1, Due: due, Transport: codec.TransportKafka, Target: "orders",
		Key: []byte(id), Value: payload, DLQTransport: codec.TransportKafka, DLQ: "delay.dlq",
	}
}

// ingestAll ingests n tasks with ids prefix+i, due = dueOf(i), with writers
// concurrent batches of batch tasks (as from several source partitions).
func ingestAll(ctx context.Context, e *shard.Engine, prefix string, n, payloadBytes int, dueOf func(i int) int64, progress func(done int)) error {
	// Batches of the Kafka source's default MaxBatch, from as many writers
	// as a delay topic with a few partitions has.
	const writers, batch = 8, 512
	var next, done atomic.Int64
	var wg sync.WaitGroup
	var firstErr atomic.Pointer[error]
	for w := range writers {
		wg.Go(func() {
			// Random payloads, distinct per task: the store compresses, and
			// real payloads rarely compress to nothing.
			rng := rand.New(rand.NewPCG(uint64(w), uint64(time.Now().UnixNano())))
			arena := make([]byte, batch*payloadBytes)
			tasks := make([]codec.Task, 0, batch)
			for ctx.Err() == nil && firstErr.Load() == nil {
				from := int(next.Add(batch) - batch)
				if from >= n {
					return
				}
				for i := 0; i+8 <= len(arena); i += 8 {
					binary.LittleEndian.PutUint64(arena[i:], rng.Uint64())
				}
				tasks = tasks[:0]
				for i := from; i < min(n, from+batch); i++ {
					k := i - from
					tasks = append(tasks, task(prefix+strconv.Itoa(i), dueOf(i), arena[k*payloadBytes:(k+1)*payloadBytes]))
				}
				if err := e.Ingest(ctx, tasks, nil); err != nil {
					firstErr.CompareAndSwap(nil, &err)
					return
				}
				d := done.Add(int64(len(tasks)))
				if progress != nil {
					progress(int(d))
				}
			}
		})
	}
	wg.Wait()
	if p := firstErr.Load(); p != nil {
		return fmt.Errorf("benchrun: ingest: %w", *p)
	}
	return ctx.Err()
}

func inWheel(st shard.Stats) int {
	n := 0
	for _, s := range st.Shards {
		n += s.InWheel
	}
	return n
}

// Child runs one engine-level measurement in this process (the re-executed
// bench binary) and writes its result as a "RESULT {json}" line to out.
func Child(ctx context.Context, mode, dir string, n, payload int, out io.Writer) error {
	switch mode {
	case "capacity":
		return capacityChild(ctx, dir, n, payload, out)
	case "recovery-fill":
		return recoveryFill(ctx, dir, n, out)
	case "recovery-open":
		return recoveryOpen(dir, n, out)
	}
	return fmt.Errorf("benchrun: unknown child mode %q", mode)
}

func result(out io.Writer, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(out, "RESULT %s\n", b)
	return err
}

func capacityChild(ctx context.Context, dir string, n, payload int, out io.Writer) error {
	const days = 30
	e, err := shard.Open(engineOptions(dir))
	if err != nil {
		return err
	}
	now := time.Now().UnixMilli()
	span := int64(days * 24 * time.Hour / time.Millisecond)
	start := time.Now()
	lastReport := time.Now()
	var mu sync.Mutex
	err = ingestAll(ctx, e, "c", n, payload, func(i int) int64 { return now + 60_000 + int64(i)*span/int64(n) }, func(done int) {
		mu.Lock()
		defer mu.Unlock()
		if time.Since(lastReport) > 10*time.Second {
			lastReport = time.Now()
			fmt.Fprintf(os.Stderr, "capacity: %d of %d ingested, %.0f/s, rss %.0f MB\n", done, n, float64(done)/time.Since(start).Seconds(), rssMB("VmRSS"))
		}
	})
	secs := time.Since(start).Seconds()
	if err != nil {
		e.Close()
		return err
	}
	st := e.Stats()
	c := Capacity{Tasks: n, PayloadBytes: payload, SpreadDays: days, IngestSecs: secs, IngestRate: float64(n) / secs,
		Pending: st.Pending, InWheel: inWheel(st), RSSMB: rssMB("VmRSS")}
	if err := e.Close(); err != nil {
		return err
	}
	c.DiskGB = float64(dirSize(dir)) / 1e9
	t := time.Now()
	e, err = shard.Open(engineOptions(dir))
	if err != nil {
		return err
	}
	c.ReopenSecs = time.Since(t).Seconds()
	c.ReopenRSSMB = rssMB("VmRSS")
	if p := e.Stats().Pending; p != c.Pending {
		e.Close()
		return fmt.Errorf("benchrun: %d pending after reopen, %d before", p, c.Pending)
	}
	if err := e.Close(); err != nil {
		return err
	}
	c.PeakRSSMB = rssMB("VmHWM")
	return result(out, c)
}

// recoveryFill ingests n tasks due over the next 30 minutes (a third of
// them inside the 10 min horizon), reports "FILLED", and keeps ingesting
// until it is killed, so the kill lands during writes.
func recoveryFill(ctx context.Context, dir string, n int, out io.Writer) error {
	e, err := shard.Open(engineOptions(dir))
	if err != nil {
		return err
	}
	now := time.Now().UnixMilli()
	span := int64(30 * time.Minute / time.Millisecond)
	dueOf := func(i int) int64 { return now + 60_000 + int64(i%n)*span/int64(n) }
	start := time.Now()
	if err := ingestAll(ctx, e, "r", n, msgSize, dueOf, nil); err != nil {
		return err
	}
	fmt.Fprintf(out, "FILLED %d %.3f\n", n, time.Since(start).Seconds())
	for i := 0; ctx.Err() == nil; i++ {
		if err := ingestAll(ctx, e, "x"+strconv.Itoa(i)+"-", 100, msgSize, dueOf, nil); err != nil {
			return err
		}
	}
	return ctx.Err()
}

func recoveryOpen(dir string, n int, out io.Writer) error {
	t := time.Now()
	e, err := shard.Open(engineOptions(dir))
	if err != nil {
		return err
	}
	secs := time.Since(t).Seconds()
	fmt.Fprintln(out, "OPENED")
	st := e.Stats()
	r := Recovery{OpenSecs: secs, Recovered: st.Pending, InWheel: inWheel(st)}
	// Every task acknowledged before the kill must be there.
	for i := range n {
		if _, err := e.Lookup("bench", "r"+strconv.Itoa(i)); errors.Is(err, shard.ErrNotFound) {
			r.Lost++
		} else if err != nil {
			e.Close()
			return err
		}
	}
	r.PeakRSSMB = rssMB("VmHWM")
	if err := e.Close(); err != nil {
		return err
	}
	return result(out, r)
}

// child runs exe with -child mode and returns its stdout lines through
// onLine; it returns the parsed RESULT into v.
func runChild(ctx context.Context, exe string, args []string, onLine func(line string, p *os.Process), v any) error {
	cmd := exec.CommandContext(ctx, exe, args...)
	cmd.Stderr = os.Stderr
	dieWithParent(cmd)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("benchrun: start child: %w", err)
	}
	sc := bufio.NewScanner(stdout)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	var res string
	for sc.Scan() {
		line := sc.Text()
		if s, ok := strings.CutPrefix(line, "RESULT "); ok {
			res = s
		}
		if onLine != nil {
			onLine(line, cmd.Process)
		}
	}
	werr := cmd.Wait()
	if res == "" {
		return fmt.Errorf("benchrun: child %v: no result: %v", args, werr)
	}
	return json.Unmarshal([]byte(res), v)
}

// capacityRun measures n pending tasks over 30 days in a child process.
func capacityRun(ctx context.Context, exe, dir string, n, payload int) (*Capacity, error) {
	var c Capacity
	err := runChild(ctx, exe, []string{"bench", "-child", "capacity", "-dir", dir, "-capacity", strconv.Itoa(n), "-payload", strconv.Itoa(payload)}, nil, &c)
	if err != nil {
		return nil, err
	}
	return &c, nil
}

// recoveryRun fills a store with n tasks in one child, SIGKILLs it while it
// keeps writing, and times the recovery of a second child.
func recoveryRun(ctx context.Context, exe, dir string, n int) (*Recovery, error) {
	var fillSecs float64
	var dummy struct{}
	err := runChild(ctx, exe, []string{"bench", "-child", "recovery-fill", "-dir", dir, "-recovery", strconv.Itoa(n)}, func(line string, p *os.Process) {
		if s, ok := strings.CutPrefix(line, "FILLED "); ok {
			f := strings.Fields(s)
			if len(f) == 2 {
				fillSecs, _ = strconv.ParseFloat(f[1], 64)
			}
			time.Sleep(200 * time.Millisecond) // into the writes that follow
			_ = p.Signal(syscall.SIGKILL)
		}
	}, &dummy)
	if fillSecs == 0 {
		return nil, fmt.Errorf("benchrun: recovery fill did not finish: %v", err)
	}
	var r Recovery
	start := time.Now()
	var ready time.Duration
	err = runChild(ctx, exe, []string{"bench", "-child", "recovery-open", "-dir", dir, "-recovery", strconv.Itoa(n)}, func(line string, _ *os.Process) {
		if line == "OPENED" {
			ready = time.Since(start)
		}
	}, &r)
	if err != nil {
		return nil, err
	}
	r.Pending, r.ReadySecs, r.KillAfterS = n, ready.Seconds(), fillSecs
	return &r, nil
}

func dirSize(dir string) int64 {
	var n int64
	_ = filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			if fi, err := d.Info(); err == nil {
				n += fi.Size()
			}
		}
		return nil
	})
	return n
}

// rssMB reads a memory field (VmRSS, VmHWM) of /proc/self/status in MB.
func rssMB(field string) float64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	return statusField(string(b), field)
}

// statusField reads a kB field of a /proc/PID/status text in MB.
func statusField(status, field string) float64 {
	for _, line := range strings.Split(status, "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			f := strings.Fields(v)
			if len(f) > 0 {
				kb, _ := strconv.ParseFloat(f[0], 64)
				return kb / 1024
			}
		}
	}
	return 0
}

func peakRSSMB() float64 { return rssMB("VmHWM") }

// selfMinorFaults is the minor page faults this process has taken (first
// touches of memory pages).
func selfMinorFaults() float64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return float64(ru.Minflt)
}

// statMinorFaults reads minflt, the tenth field of a /proc/PID/stat text;
// the second field (the command, in parentheses) may hold spaces and
// parentheses, so the fields are counted after its last ')'. 0 when the
// text does not parse.
func statMinorFaults(stat string) float64 {
	i := strings.LastIndexByte(stat, ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(stat[i+1:]) // from the third field, state, on
	if len(f) < 8 {
		return 0
	}
	n, err := strconv.ParseUint(f[7], 10, 64)
	if err != nil {
		return 0
	}
	return float64(n)
}

// selfCPUSeconds is the CPU time (user + system) this process has used:
// the in-process brokers, publishers, readers and, in a raw run, the pipe.
func selfCPUSeconds() float64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()).Seconds()
}
