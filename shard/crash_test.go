package shard

import (
	"bufio"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/clock"
)

const (
	crashChildEnv = "DELAYBRIDGE_CRASH_CHILD"
	crashShards   = 4
	crashBatch    = 16 // FireBatch: bounds the duplicates of one kill
)

func longTests() bool { return os.Getenv("DELAYBRIDGE_LONG") == "1" }

// TestCrashSafety runs the engine in a child process that ingests and fires
// continuously, kills it with SIGKILL at random moments, and proves that
// every task whose Ingest returned was delivered or is still pending: zero
// lost, and duplicates only from batches in flight at a kill.
func TestCrashSafety(t *testing.T) {
	if dir := os.Getenv(crashChildEnv); dir != "" {
		crashChild(dir)
		return
	}
	rounds := 3
	if longTests() {
		rounds = 25
	}
	dir := t.TempDir()
	seed := uint64(time.Now().UnixNano())
	t.Logf("random seed %d (kill times are real time: a seed repeats the choices, not the run)", seed)
	rng := rand.New(rand.NewPCG(seed, 1))
	acked := map[string]bool{}
	for round := 0; round < rounds; round++ {
		killAfter := 3 + rng.IntN(40) // acknowledged batches before the kill
		runChildUntilKill(t, "TestCrashSafety", crashChildEnv+"="+dir, round, killAfter, func(line string) bool {
			if !strings.HasPrefix(line, "ACK ") {
				return false
			}
			for _, id := range strings.Fields(line[4:]) {
				acked[id] = true
			}
			return true
		})
	}

	// Recover once more, far in the future so everything is due, and drain.
	clk := clock.NewFake(time.Now().Add(time.Hour))
	h := &harness{t: t, clk: clk, opts: crashOptions(dir, clk, zap.NewNop()), sink: newRecSink(clk)}
	h.open()
	t.Cleanup(h.close)
	pendingAtRecovery := h.e.Stats().Pending
	h.checkPending()
	h.run()
	if p := h.e.Stats().Pending; p != 0 {
		t.Fatalf("%d tasks still pending after draining", p)
	}
	distinct, dups := tallyDeliveries(t, dir, h.sink.acked(), acked)
	t.Logf("%d rounds: %d tasks acknowledged, %d pending at final recovery, %d distinct delivered, %d duplicates",
		rounds, len(acked), pendingAtRecovery, distinct, dups)
	// In flight at a kill, per shard: the batch its lane is publishing or
	// holding while it waits to queue its commit, up to fireCommitDepth
	// delivered batches queued whose delete is not yet synced, and the one
	// the commit loop is syncing.
	if limit := rounds * crashShards * crashBatch * (2 + fireCommitDepth); dups > limit {
		t.Fatalf("%d duplicates, more than the %d that can be in flight at %d kills", dups, limit, rounds)
	}
}

// runChildUntilKill runs the test named test in a child process (env set
// for it and DELAYBRIDGE_CRASH_ROUND=round), hands each line of its output
// to line, which reports whether it was an acknowledged batch, and kills
// the child with SIGKILL at the killAfter-th.
func runChildUntilKill(t *testing.T, test, env string, round, killAfter int, line func(string) bool) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^"+test+"$")
	cmd.Env = append(os.Environ(), env, "DELAYBRIDGE_CRASH_ROUND="+strconv.Itoa(round))
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(out)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	n := 0
	for sc.Scan() {
		if line(sc.Text()) {
			if n++; n == killAfter {
				cmd.Process.Signal(syscall.SIGKILL)
			}
		}
	}
	err = cmd.Wait()
	if n < killAfter {
		t.Fatalf("round %d: child exited after %d batches: %v", round, n, err)
	}
}

func crashOptions(dir string, clk clock.Clock, log *zap.Logger) Options {
	return Options{
		Dir:       filepath.Join(dir, "db"),
		Shards:    crashShards,
		FireBatch: crashBatch,
		Horizon:   time.Second,
		Clock:     clk,
		Logger:    log,
	}
}

func readDeliveries(t *testing.T, dir string) []string {
	b, err := os.ReadFile(filepath.Join(dir, "delivered"))
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(b), "\n")
	return lines[:len(lines)-1] // the last one is empty or torn by the kill
}

// fileSink records each delivery durably before acknowledging it, like a
// broker that acked the publish.
type fileSink struct{ f *os.File }

func (s fileSink) Deliver(_ context.Context, batch []*codec.Task) []error {
	var b []byte
	for _, t := range batch {
		b = append(b, t.ID...)
		b = append(b, '\n')
	}
	if _, err := s.f.Write(b); err != nil {
		return allErr(len(batch), err)
	}
	if err := s.f.Sync(); err != nil {
		return allErr(len(batch), err)
	}
	return nil
}

func allErr(n int, err error) []error {
	errs := make([]error, n)
	for i := range errs {
		errs[i] = err
	}
	return errs
}

// crashChild is the child process: ingest and fire until killed.
func crashChild(dir string) {
	fail := func(err error) {
		fmt.Fprintln(os.Stderr, "crash child:", err)
		os.Exit(2)
	}
	round := os.Getenv("DELAYBRIDGE_CRASH_ROUND")
	e, err := Open(crashOptions(dir, clock.Real{}, zap.NewNop()))
	if err != nil {
		fail(err)
	}
	f, err := os.OpenFile(filepath.Join(dir, "delivered"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		fail(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute) // a safety net, never reached
	defer cancel()
	go e.Run(ctx, fileSink{f})
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 2))
	w := bufio.NewWriter(os.Stdout)
	for n := 0; ctx.Err() == nil; {
		now := time.Now().UnixMilli()
		batch := make([]codec.Task, 40)
		var line strings.Builder
		line.WriteString("ACK")
		for i := range batch {
			n++
			id := fmt.Sprintf("r%s-%d", round, n)
			due := now - 50 + rng.Int64N(1500)
			batch[i] = codec.Task{Kind: codec.KindSchedule, ID: id, Source: "crash", Stamp: now, Offset: int64(n),
				Due: due, Transport: codec.TransportKafka, Target: "out", Value: make([]byte, 100)}
			line.WriteString(" " + id)
		}
		if err := e.Ingest(ctx, batch, nil); err != nil {
			fail(err)
		}
		// Reported only after Ingest returned: these ids are durable.
		w.WriteString(line.String() + "\n")
		w.Flush()
		time.Sleep(time.Duration(rng.IntN(5)) * time.Millisecond)
	}
	os.Exit(3)
}

// tallyDeliveries counts the deliveries the killed children synced to dir
// and those of the final drain: the distinct tasks and the duplicates. It
// fails the test if a task in acked (its ingest returned) was never
// delivered.
func tallyDeliveries(t *testing.T, dir string, drained []string, acked map[string]bool) (distinct, dups int) {
	t.Helper()
	delivered := map[string]int{}
	for _, id := range readDeliveries(t, dir) {
		delivered[id]++
	}
	for _, id := range drained {
		delivered[id]++
	}
	lost := 0
	for id := range acked {
		if delivered[id] == 0 {
			lost++
			if lost < 10 {
				t.Errorf("acknowledged task %s was never delivered", id)
			}
		}
	}
	for _, c := range delivered {
		dups += c - 1
	}
	if lost > 0 {
		t.Fatalf("%d acknowledged tasks lost", lost)
	}
	return len(delivered), dups
}
