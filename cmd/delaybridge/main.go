// Command delaybridge holds delayed messages for Kafka and NATS JetStream and
// republishes them to their target when due.
//
//	delaybridge run --config FILE   the service (--check: validate the config and exit)
//	delaybridge dev                 a sandbox with embedded brokers
//	delaybridge bench               the benchmark report
//	delaybridge version
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/delaybridge/delaybridge/bridge/service"
	"github.com/delaybridge/delaybridge/config"
	"github.com/delaybridge/delaybridge/shard"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	os.Exit(realMain(os.Args[1:], os.Stdout, os.Stderr))
}

const usage = `usage:
  delaybridge run --config FILE   run the bridge (--check: only validate the config)
  delaybridge dev [flags]         sandbox: embedded NATS + Kafka-protocol broker on localhost
  delaybridge bench [flags]       benchmark report: raw broker pipe vs the bridge (see docs/benchmarks.md)
  delaybridge firing status|pause|resume --config FILE
                                  ask a running bridge whether firing is paused, pause or resume it
  delaybridge version             print the version
`

func realMain(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	sigs := make(chan os.Signal, 2)
	// SIGHUP (the terminal of a foreground dev or run closed, an ssh
	// session dropped) stops as SIGTERM does, so dev still forgets its
	// sandbox; a process started with SIGHUP ignored (nohup) keeps
	// ignoring it.
	stopSigs := []os.Signal{syscall.SIGTERM, syscall.SIGINT}
	if !signal.Ignored(syscall.SIGHUP) {
		stopSigs = append(stopSigs, syscall.SIGHUP)
	}
	signal.Notify(sigs, stopSigs...)
	defer signal.Stop(sigs)
	cleanups := new(exitCleanups) // dev and bench register what they create; run nothing
	ctx, stop := shutdownOnSignal(context.Background(), sigs, stderr, os.Exit, cleanups, time.Now)
	defer stop()
	var err error
	switch args[0] {
	case "run":
		err = cmdRun(ctx, args[1:], stdout, stderr)
	case "dev":
		err = cmdDev(ctx, args[1:], stdout, stderr, cleanups)
	case "bench":
		err = cmdBench(ctx, args[1:], stdout, stderr, cleanups)
	case "firing":
		err = cmdFiring(ctx, args[1:], stdout, stderr)
	case "version", "--version", "-v":
		if helpAsked(args) {
			fmt.Fprint(stdout, usage)
			return 0
		}
		if err = noArguments(args, stderr, ""); err == nil {
			fmt.Fprintln(stdout, "delaybridge", versionString())
			return 0
		}
	case "help", "-h", "-help", "--help":
		if err = noArguments(args, stderr, " (a command's flags: delaybridge COMMAND -h)"); err == nil {
			fmt.Fprint(stdout, usage)
			return 0
		}
	default:
		fmt.Fprintf(stderr, "unknown command %q\n%s", args[0], usage)
		return 2
	}
	if err != nil && cleanups.started() {
		stop() // returns only after the forced exit's exit call (never, but in tests)
	}
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		fmt.Fprintln(stderr, "delaybridge:", err)
		if errors.As(err, new(usageError)) {
			return 2
		}
		return 1
	}
	return 0
}

// helpAsked reports whether a command that takes no arguments (version)
// was given only -h or --help, as every other command takes them: the
// usage, not an error about an unexpected argument.
func helpAsked(args []string) bool {
	return len(args) == 2 && (args[1] == "-h" || args[1] == "-help" || args[1] == "--help")
}

// noArguments refuses arguments after a command that takes none (version,
// help), as parseFlags does for the others: `version extra` is a mistake to
// report, not to ignore. It prints the usage to stderr and returns a
// usageError naming every argument after args[0]; hint ends the message.
func noArguments(args []string, stderr io.Writer, hint string) error {
	if len(args) < 2 {
		return nil
	}
	fmt.Fprint(stderr, usage)
	return usageError{errors.New(unexpectedArgs(args[0], args[1:]) + hint)}
}

// unexpectedArgs names the arguments a command that takes none was given.
func unexpectedArgs(cmd string, rest []string) string {
	quoted := make([]string, len(rest))
	for i, a := range rest {
		quoted[i] = strconv.Quote(a)
	}
	plural := ""
	if len(rest) > 1 {
		plural = "s"
	}
	return fmt.Sprintf("%s: unexpected argument%s %s: %s takes no arguments", cmd, plural, strings.Join(quoted, " "), cmd)
}

// usageError is a mistake in the command line: an unknown flag, a bad flag
// value, an argument where none is taken, a missing required flag. realMain
// exits 2 on it, the conventional status of a usage error; failures at run
// time (including an invalid config file) exit 1.
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

// usagef prints fs's usage and returns a usageError; realMain prints the
// error after it, so the error is the last line, as for the flag package's
// own errors.
func usagef(fs *flag.FlagSet, format string, a ...any) error {
	fs.Usage()
	return usageError{fmt.Errorf(format, a...)}
}

// parseFlags parses the arguments of a subcommand. None of them takes a
// positional argument, and the flag package stops at the first one, so one
// is refused (naming every argument from it on) rather than ignored along
// with the flags after it: `run x.yml` would otherwise complain only that
// --config is missing, and `run --config a.yml extra` would run.
//
// What the flag package prints while parsing goes to stdout when the
// usage was asked for (-h, -help, --help: exit 0, so `run -h | less`
// works) and to fs's own output (stderr) after a mistake (exit 2).
func parseFlags(fs *flag.FlagSet, args []string, stdout io.Writer) error {
	out := fs.Output()
	var printed bytes.Buffer
	fs.SetOutput(&printed)
	err := fs.Parse(args)
	fs.SetOutput(out)
	if errors.Is(err, flag.ErrHelp) {
		_, _ = printed.WriteTo(stdout)
		return err
	}
	_, _ = printed.WriteTo(out)
	if err != nil {
		return usageError{err} // fs has printed the error and its usage
	}
	if fs.NArg() > 0 {
		return usagef(fs, "%s, only flags", unexpectedArgs(fs.Name(), fs.Args()))
	}
	return nil
}

// repeatSignalWindow: the same signal again within it is the first one
// delivered twice, not a second request.
const repeatSignalWindow = 50 * time.Millisecond

// shutdownOnSignal returns a context cancelled by the first signal on sigs:
// the graceful shutdown (stop the sources, finish the batch in flight, close
// the store within shutdown_timeout). A second signal means whoever sent it
// will not wait for that (Ctrl-C pressed again, a supervisor's second
// SIGTERM): it prints one line to stderr and calls exit with 128+the
// signal's number (130 for SIGINT, 143 for SIGTERM), as a shell reports a
// process killed by it. That exit skips every defer, so just before it, it
// runs what the command registered in cleanups (may be nil), for at most
// exitCleanupTimeout: dev's temporary directory, bench's work directory
// and child processes. `run` registers nothing and exits at once. Exiting
// mid-shutdown loses nothing: the store is crash-safe (a source offset is
// committed only after its task is fsynced, and a task leaves the store
// only after its target acknowledged it), so the next start replays the WAL
// and at most redelivers what was in flight, as after kill -9.
//
// The first signal repeated within repeatSignalWindow (now tells the time)
// is not a second one: a kill sent to the process and to its process group
// arrives twice at once (GNU timeout does that), and was taken as the
// operator giving up on the graceful stop (hunt H138).
//
// stop cancels the context and ends the watch; once it has returned, no
// signal is acted on. It may be called more than once.
func shutdownOnSignal(parent context.Context, sigs <-chan os.Signal, stderr io.Writer, exit func(code int), cleanups *exitCleanups, now func() time.Time) (ctx context.Context, stop func()) {
	ctx, cancel := context.WithCancel(parent)
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		var first os.Signal
		var at time.Time
		select {
		case first = <-sigs:
			at = now()
			cancel()
		case <-done:
			return
		}
		for {
			var sig os.Signal
			select {
			case sig = <-sigs:
			case <-done:
				return
			}
			if sig == first && now().Sub(at) < repeatSignalWindow {
				continue
			}
			fmt.Fprintln(stderr, "delaybridge: second signal: exiting without waiting")
			shard.Exiting() // the cleanups may remove a store's directory under it
			code := 128 + int(syscall.SIGINT)
			if s, ok := sig.(syscall.Signal); ok {
				code = 128 + int(s)
			}
			cleanups.run(stderr)
			exit(code)
			return
		}
	}()
	var once sync.Once
	return ctx, func() {
		once.Do(func() {
			close(done)
			wg.Wait()
			cancel()
		})
	}
}

func versionString() string {
	v := version
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" && len(s.Value) >= 12 {
				v += " (" + s.Value[:12] + ")"
			}
		}
		v += " " + bi.GoVersion
	}
	return v
}

func cmdRun(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("run", flag.ContinueOnError)
	fs.SetOutput(stderr)
	path := fs.String("config", "", "YAML config file (README, \"Configuration\"); DELAYBRIDGE_* environment variables override it")
	check := fs.Bool("check", false, "validate the config (file and environment) and exit: 0 if it is valid, with the effective config (secrets redacted) as YAML on stdout; 1 with every problem on stderr. Opens no store and connects to no broker")
	if err := parseFlags(fs, args, stdout); err != nil {
		return err
	}
	if *path == "" {
		return usagef(fs, "run: --config FILE is required")
	}
	cfg, err := config.Load(*path, os.Environ()) // validates: every problem, each naming its key and the file
	if err != nil {
		return err
	}
	if *check {
		// The effective config (defaults and environment applied, secrets
		// redacted) is the output, for a pipe or a file; the verdict is a
		// message, beside the problems an invalid config prints.
		if _, err := io.WriteString(stdout, cfg.String()); err != nil {
			return fmt.Errorf("--check: writing the effective config: %w", err)
		}
		fmt.Fprintf(stderr, "delaybridge: config %s: valid (--check: no store opened, no broker dialled)\n", *path)
		if len(cfg.Targets.Allow) == 0 {
			// Valid, and most likely not meant: a "targets:" or "allow:"
			// with nothing under it (a list mis-indented) denies all.
			fmt.Fprintf(stderr, "delaybridge: config %s: warning: targets.allow is empty, so no target is allowed: every schedule will be dead-lettered target-not-allowed\n", *path)
		}
		return nil
	}
	log, err := newLogger(cfg.Log.Level, cfg.Log.Format, stderr)
	if err != nil {
		return fmt.Errorf("log: %w", err)
	}
	defer func() { _ = log.Sync() }()
	log.Info("starting delaybridge", zap.String("version", versionString()), zap.Object("config", cfg.Redacted()))
	logMemory(log, cfg.Store.CacheMB)
	svc, err := service.New(ctx, cfg, service.Options{Logger: log})
	if v, ok := os.LookupEnv("DELAYBRIDGE_SHARDS"); ok && errors.As(err, new(*shard.ShardCountError)) {
		// The file may say otherwise: name where the count came from.
		err = fmt.Errorf("%w (shards is set by DELAYBRIDGE_SHARDS=%s)", err, v)
	}
	if stoppedDuringStart(ctx, err, log) {
		return nil
	}
	if err != nil {
		log.Error("start failed", zap.Error(err))
		return err
	}
	// The cause of an exit in the JSON log too (a log pipeline sees it),
	// not only on stderr.
	if err := svc.Run(ctx); err != nil {
		log.Error("stopped with an error", zap.Error(err))
		return err
	}
	return nil
}

// stoppedDuringStart reports (and logs) whether err, from service.New,
// is the stop ctx was cancelled for (a signal while the store opened):
// nothing was taken in yet and the store is as it was, so that is a clean
// stop, not a failed start.
func stoppedDuringStart(ctx context.Context, err error, log *zap.Logger) bool {
	if err == nil || ctx.Err() == nil || !errors.Is(err, context.Canceled) {
		return false
	}
	log.Info("stopped before the start completed", zap.Error(err))
	return true
}

// colorTerminal reports whether w is a terminal to colour the levels on:
// a pipe or a file (`dev 2>dev.log`, a container's log) gets no escape
// codes, nor does a terminal when NO_COLOR is set (no-color.org).
func colorTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok || os.Getenv("NO_COLOR") != "" {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// newLogger builds the process logger: JSON for `run` (machines read it),
// console for `dev` (people read it).
func newLogger(level, format string, w io.Writer) (*zap.Logger, error) {
	lvl, err := zapcore.ParseLevel(level)
	if err != nil {
		return nil, err
	}
	encCfg := zap.NewProductionEncoderConfig()
	encCfg.EncodeTime = zapcore.ISO8601TimeEncoder
	var enc zapcore.Encoder
	switch format {
	case "", "json":
		enc = zapcore.NewJSONEncoder(encCfg)
	case "console":
		encCfg.EncodeLevel = zapcore.CapitalLevelEncoder
		if colorTerminal(w) {
			encCfg.EncodeLevel = zapcore.CapitalColorLevelEncoder
		}
		enc = zapcore.NewConsoleEncoder(encCfg)
	default:
		return nil, fmt.Errorf("unknown log format %q", format)
	}
	return zap.New(zapcore.NewCore(enc, zapcore.AddSync(w), lvl)), nil
}
