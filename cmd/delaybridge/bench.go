package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/internal/benchrun"
)

// cmdBench runs the benchmark report (internal/benchrun): brokers in
// process, the bridge as `run` builds it, a Markdown table on stdout and
// report.json, report.md and lateness.png in -out.
//
// cleanups (may be nil) gets what runBench registers, so a forced exit (a
// second signal) removes the work directory too; a -child registers
// nothing (its -dir is in its parent's work directory).
func cmdBench(ctx context.Context, args []string, stdout, stderr io.Writer, cleanups *exitCleanups) error {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	quick := fs.Bool("quick", false, "small sizes for a quick look (20 k messages, 200 k pending, 100 k at the kill)")
	n := fs.Int("n", 0, "messages per transport for the throughput runs (default 200000; -quick 20000)")
	paced := fs.Int("paced-n", 0, "messages per transport for the paced lateness runs (default 50000; -quick 10000)")
	rate := fs.Int("rate", 0, "paced publish rate, msg/s (default 5000)")
	capacity := fs.Int("capacity", 0, "pending tasks for the capacity run (default 10000000; -quick 200000)")
	payload := fs.Int("payload", 0, "payload bytes per task in the capacity run (default 1024)")
	recovery := fs.Int("recovery", 0, "pending tasks at the kill -9 of the recovery run (default 1000000; -quick 100000)")
	only := fs.String("only", "", "comma-separated parts to run: throughput,lateness,capacity,recovery (default all)")
	transports := fs.String("transports", "", "comma-separated transports of the throughput and lateness runs: kafka,nats (default both)")
	out := fs.String("out", "bench-out", "directory for report.json, report.md and lateness.png")
	profile := fs.Bool("profile", false, "write a 3 s CPU profile of each bridge run (not the warm ones) into -out (bridge-kafka.cpu.pprof, bridge-nats.cpu.pprof; paced runs: bridge-kafka-paced.cpu.pprof, ...)")
	work := fs.String("work", "", "scratch directory for stores and broker data (default the system temp dir)")
	// Flags of the engine-level children benchrun starts (`bench -child
	// capacity -dir D ...`), not of a user: they work but -h leaves them out.
	child := fs.String("child", "", "internal: run one engine-level measurement in this process")
	dir := fs.String("dir", "", "internal: the child's store directory")
	fs.Usage = usageHiding(fs, "child", "dir")
	if err := parseFlags(fs, args, stdout); err != nil {
		return err
	}
	if *child != "" {
		return benchrun.Child(ctx, *child, *dir, *capacity+*recovery, *payload, stdout)
	}
	o := benchrun.Defaults(*quick)
	for _, f := range []struct {
		name string
		v    int
		dst  *int
	}{{"n", *n, &o.N}, {"paced-n", *paced, &o.PacedN}, {"rate", *rate, &o.Rate},
		{"capacity", *capacity, &o.Capacity}, {"payload", *payload, &o.Payload}, {"recovery", *recovery, &o.Recovery}} {
		switch {
		case f.v < 0:
			return usagef(fs, "bench: -%s: %d is negative (0 or no flag: the default)", f.name, f.v)
		case f.v > 0:
			*f.dst = f.v
		}
	}
	if *only != "" {
		for _, part := range strings.Split(*only, ",") {
			if !slices.Contains(benchrun.Parts, part) {
				return usagef(fs, "bench: -only: unknown part %q (%s)", part, strings.Join(benchrun.Parts, ", "))
			}
			o.Parts = append(o.Parts, part)
		}
	}
	if *transports != "" {
		for _, tr := range strings.Split(*transports, ",") {
			if tr != benchrun.Kafka && tr != benchrun.NATS {
				return usagef(fs, "bench: -transports: unknown transport %q (kafka, nats)", tr)
			}
			o.Transports = append(o.Transports, tr)
		}
	}
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	o.Exe, o.Out, o.WorkDir, o.Profile = exe, *out, *work, *profile
	o.Command = "delaybridge bench " + strings.Join(args, " ")
	o.Logger = zap.NewNop()
	o.Progress = stderr
	return runBench(ctx, o, stdout, cleanups)
}

// usageHiding is a Usage for fs that prints what the flag package's
// default does (the header, then PrintDefaults) without the flags named
// hidden: flags for the program's own use, which still parse.
func usageHiding(fs *flag.FlagSet, hidden ...string) func() {
	return func() {
		shown := flag.NewFlagSet(fs.Name(), flag.ContinueOnError)
		shown.SetOutput(fs.Output())
		fs.VisitAll(func(f *flag.Flag) {
			if slices.Contains(hidden, f.Name) {
				return
			}
			shown.Var(f.Value, f.Name, f.Usage)
			// Var takes the current value as the default: after a parse
			// that set the flag it is not.
			shown.Lookup(f.Name).DefValue = f.DefValue
		})
		fmt.Fprintf(fs.Output(), "Usage of %s:\n", fs.Name())
		shown.PrintDefaults()
	}
}

// runBench runs benchrun.Run with its scratch space (stores, broker data,
// the child bridges' configs and logs, the engine children's stores) in a
// new directory in o.WorkDir (-work; "" is the system temp dir), removed
// on return and, through cleanups (may be nil), by a forced exit, which
// also kills the child processes benchrun started (see killChildren).
// benchrun makes its own work directory inside that one and removes it on
// return, but a forced exit skips that. Only that new directory is
// removed: never -work itself or its other entries, never -out (the
// report, the profiles and whatever else the user keeps there).
func runBench(ctx context.Context, o benchrun.Options, stdout io.Writer, cleanups *exitCleanups) error {
	work, remove, err := cleanups.tempDirIn(o.WorkDir, "delaybridge-bench-")
	if err != nil {
		return fmt.Errorf("bench: work dir: %w", err)
	}
	defer func() { _ = remove() }()
	unregister, err := cleanups.add("bench's child processes", killChildren)
	if err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	defer unregister()
	o.WorkDir = work
	r, err := benchrun.Run(ctx, o)
	if r != nil {
		fmt.Fprint(stdout, r.Markdown())
	}
	return err
}

// killChildren kills (SIGKILL) every child process of this one, for a
// forced exit of bench, whose only children are benchrun's. The
// engine-level children (`bench -child`) are already killed by the first
// signal (exec.CommandContext with the context it cancels); a child
// bridge (`delaybridge run`) only gets a SIGTERM when the first signal
// ends its run, and bench waits up to a minute for it to stop: a forced
// exit does not wait, and the bridge would go on until its graceful stop
// ends, closing its store in the work directory being removed. Every
// child also has a parent-death signal (benchrun's dieWithParent), but it
// fires only once this process is gone, after the removal. It finds the
// children in /proc/self/task/*/children (Linux); where that does not
// exist it finds none.
func killChildren(context.Context) error {
	files, err := filepath.Glob("/proc/self/task/*/children")
	if err != nil {
		return err
	}
	var errs []error
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil { // the thread has exited
			continue
		}
		for _, field := range strings.Fields(string(b)) {
			pid, err := strconv.Atoi(field)
			if err != nil {
				continue
			}
			p, err := os.FindProcess(pid)
			if err == nil {
				err = p.Kill()
				_ = p.Release()
			}
			if err != nil && !errors.Is(err, os.ErrProcessDone) {
				errs = append(errs, fmt.Errorf("kill %d: %w", pid, err))
			}
		}
	}
	return errors.Join(errs...)
}
