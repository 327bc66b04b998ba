package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kfake"
	"go.uber.org/zap"

	natsgo "github.com/nats-io/nats.go"

	"github.com/delaybridge/delaybridge/bridge/service"
	"github.com/delaybridge/delaybridge/config"
	"github.com/delaybridge/delaybridge/internal/benchrun"
)

// devOptions are the flags of `delaybridge dev`.
type devOptions struct {
	kafkaPort int
	natsPort  int
	admin     string
	dataDir   string
}

// cmdDev runs the sandbox: an embedded NATS server with JetStream and an
// in-process Kafka-protocol broker (kfake) on localhost, the bridge wired to
// both, and copy-paste examples. It is for trying things, not production:
// without --data-dir everything is forgotten on exit.
//
// cleanups (may be nil) gets the removal of the temporary directory, so a
// forced exit (a second signal) removes it too.
func cmdDev(ctx context.Context, args []string, stdout, stderr io.Writer, cleanups *exitCleanups) error {
	var o devOptions
	fs := flag.NewFlagSet("dev", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&o.kafkaPort, "kafka-port", 9092, "port of the in-process Kafka-protocol broker (0: any free port)")
	fs.IntVar(&o.natsPort, "nats-port", 4222, "port of the embedded NATS server (0: any free port)")
	fs.StringVar(&o.admin, "admin", "127.0.0.1:8080", "admin HTTP listen address, on loopback (the sandbox's admin API has no token)")
	fs.StringVar(&o.dataDir, "data-dir", "", "keep the sandbox (the bridge's store and both brokers' data) in this directory across runs (default: a temporary directory removed on exit)")
	if err := parseFlags(fs, args, stdout); err != nil {
		return err
	}
	if err := checkDevFlags(o); err != nil {
		return usagef(fs, "dev: %w", err)
	}
	log, err := newLogger("info", "console", stderr)
	if err != nil {
		return err
	}
	defer func() { _ = log.Sync() }()
	return runDev(ctx, o, stdout, log, cleanups, nil)
}

// checkDevFlags refuses flag values no listener can take, before anything
// starts: a port outside 0..65535 (nats-server would not say why and
// never become ready: a 10 s wait), an -admin that is not host:port or
// not on loopback. cmdDev reports them as usage errors (exit 2). runDev
// checks -admin again for its other callers, and takes -1 for a NATS
// port as any free one (nats-server's RANDOM_PORT), which the flag does
// not: its "any free port" is 0.
func checkDevFlags(o devOptions) error {
	for _, p := range []struct {
		flag string
		port int
	}{{"-kafka-port", o.kafkaPort}, {"-nats-port", o.natsPort}} {
		if p.port < 0 || p.port > 65535 {
			return fmt.Errorf("%s: %d is not a port (0..65535, 0: any free port)", p.flag, p.port)
		}
	}
	if err := config.CheckListen(o.admin, "", true); err != nil {
		return fmt.Errorf("-admin: %w", errors.Unwrap(err)) // without "admin.listen: ": a flag, not a key
	}
	if config.CheckListen(o.admin, "", false) != nil {
		return fmt.Errorf("-admin %s: %s", o.admin, devLoopbackOnly)
	}
	return nil
}

// devLoopbackOnly says why dev refuses an -admin off loopback.
const devLoopbackOnly = "the sandbox's admin API has no token, so it listens on a loopback address only (127.0.0.1:PORT); use delaybridge run with admin.token to serve it further"

// devAddrs are where the sandbox's brokers listen.
type devAddrs struct {
	kafka string // host:port
	nats  string // nats:// URL
	admin string // host:port
}

// runDev is cmdDev after flag parsing; ready (if not nil) is called with the
// service and the broker addresses once the examples are printed, so tests
// can drive it.
//
// Without --data-dir the sandbox lives in a new temporary directory, removed
// on return and, through cleanups (may be nil), by a forced exit. That
// directory is the only thing dev ever removes: never a --data-dir (the
// user's), never another sandbox's temporary directory.
func runDev(ctx context.Context, o devOptions, stdout io.Writer, log *zap.Logger, cleanups *exitCleanups, ready func(*service.Service, devAddrs)) error {
	// The brokers keep their data beside the bridge's store: the store
	// holds each partition's high-water offset and the source starts after
	// it, so a store kept across runs with brokers that start empty would
	// skip that many new messages.
	if err := config.CheckListen(o.admin, "", true); err != nil {
		return fmt.Errorf("dev: -admin: %w", err)
	}
	if config.CheckListen(o.admin, "", false) != nil {
		return fmt.Errorf("dev: -admin %s: %s", o.admin, devLoopbackOnly)
	}
	// Every port is tried before anything starts, and all those in use
	// are named in one error with the flags that move them: a second
	// sandbox beside a running one is told everything at once, not one
	// port per try. An admin port 0 becomes the port the banner shows.
	// The listeners are closed again for the servers to take.
	if err := devPortsFree(&o); err != nil {
		return err
	}
	root := o.dataDir
	if root == "" {
		tmp, remove, err := cleanups.tempDir("delaybridge-dev-")
		if err != nil {
			return fmt.Errorf("dev: %w", err)
		}
		defer func() { _ = remove() }()
		root = tmp
	}

	if o.natsPort == 0 {
		o.natsPort = natsserver.RANDOM_PORT // nats-server's 0 is its default, 4222
	}
	ns, err := natsserver.NewServer(&natsserver.Options{
		Host: "127.0.0.1", Port: o.natsPort, JetStream: true,
		StoreDir: filepath.Join(root, "jetstream"), NoSigs: true,
	})
	if err != nil {
		return fmt.Errorf("dev: nats server: %w", err)
	}
	go ns.Start()
	defer ns.Shutdown()
	if !ns.ReadyForConnections(10 * time.Second) {
		return errors.New("dev: nats server did not start")
	}
	natsURL := ns.ClientURL()
	if err := devNATSTargets(ctx, natsURL); err != nil {
		return err
	}

	kopts := []kfake.Opt{
		kfake.Ports(o.kafkaPort),
		kfake.SeedTopics(3, "delay", "delay.dlq", "orders"),
		kfake.AllowAutoTopicCreation(),
		kfake.BrokerConfigs(benchrun.KfakeBrokerConfigs()),
	}
	if o.dataDir != "" {
		kopts = append(kopts, kfake.DataDir(filepath.Join(root, "kafka")))
	}
	kc, err := kfake.NewCluster(kopts...)
	if err != nil {
		return portHint(fmt.Errorf("dev: kafka broker on port %d: %w", o.kafkaPort, err), "-kafka-port")
	}
	defer kc.Close()
	kafkaAddr := kc.ListenAddrs()[0]

	cfg, err := config.LoadBytes([]byte(devConfig(filepath.Join(root, "store"), kafkaAddr, natsURL, o.admin)), nil)
	if err != nil {
		return fmt.Errorf("dev: config: %w", err)
	}
	svc, err := service.New(ctx, cfg, service.Options{Logger: log})
	if stoppedDuringStart(ctx, err, log) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("dev: %w", err)
	}
	fmt.Fprint(stdout, devBanner(kafkaAddr, natsURL, o.admin, time.Now(), o.dataDir))
	if ready != nil {
		ready(svc, devAddrs{kafka: kafkaAddr, nats: natsURL, admin: o.admin})
	}
	err = svc.Run(ctx)
	if o.dataDir == "" {
		// The service's last line says pending tasks are kept in the
		// store; in this sandbox the store goes with it.
		log.Info("removing the sandbox: its pending tasks and both brokers' messages are discarded (--data-dir keeps them)", zap.String("dir", root))
	}
	return portHint(err, "-admin")
}

// portsInUse is the ports the sandbox cannot take (devPortsFree), each
// error with the flag that moves it.
type portsInUse struct {
	errs  []error
	flags []string
}

func (e *portsInUse) Error() string {
	msgs := make([]string, len(e.errs))
	for i, err := range e.errs {
		msgs[i] = err.Error()
	}
	hint := ""
	if errors.Is(e, syscall.EADDRINUSE) {
		hint = fmt.Sprintf(" (is another delaybridge dev running? %s move this one: 0 picks a free port)", strings.Join(e.flags, " "))
	}
	return "dev: " + strings.Join(msgs, "; ") + hint
}

func (e *portsInUse) Unwrap() []error { return e.errs }

// devPortsFree listens on each port the sandbox will take (the admin
// address, and the NATS and Kafka ports unless any free one is asked for)
// and closes it again; it returns every one that failed in one error, or
// nil with o.admin's port 0 replaced by the port it got. nats-server only
// logs a port it cannot listen on (and has no logger here), then never
// becomes ready: hence the check for it too.
func devPortsFree(o *devOptions) error {
	e := &portsInUse{}
	try := func(addr, what, flag string) string {
		l, err := net.Listen("tcp", addr)
		if err != nil {
			e.errs = append(e.errs, fmt.Errorf("%s: %w", what, err))
			e.flags = append(e.flags, flag)
			return ""
		}
		got := l.Addr().String()
		_ = l.Close()
		return got
	}
	if got := try(o.admin, "admin on "+o.admin, "-admin 127.0.0.1:0"); got != "" {
		o.admin = got
	}
	if o.natsPort > 0 {
		try(net.JoinHostPort("127.0.0.1", strconv.Itoa(o.natsPort)), fmt.Sprintf("nats server on port %d", o.natsPort), "-nats-port 0")
	}
	if o.kafkaPort > 0 {
		try(net.JoinHostPort("127.0.0.1", strconv.Itoa(o.kafkaPort)), fmt.Sprintf("kafka broker on port %d", o.kafkaPort), "-kafka-port 0")
	}
	if len(e.errs) > 0 {
		return e
	}
	return nil
}

// portHint adds to an address-in-use error the flag that moves the port:
// the usual cause is a dev sandbox still running.
func portHint(err error, flag string) error {
	if errors.Is(err, syscall.EADDRINUSE) {
		return fmt.Errorf("%w (is another delaybridge dev running? %s picks another)", err, flag)
	}
	return err
}

// devNATSTargets creates a JetStream stream for the example target subjects
// so NATS deliveries are acknowledged (not best-effort core NATS).
func devNATSTargets(ctx context.Context, url string) error {
	nc, err := natsgo.Connect(url)
	if err != nil {
		return fmt.Errorf("dev: connect nats: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	for name, subjects := range map[string][]string{"ORDERS": {"orders.>"}, "DLQ": {"dlq.>"}} {
		if _, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: subjects}); err != nil {
			return fmt.Errorf("dev: create stream %s: %w", name, err)
		}
	}
	return nil
}

func devConfig(dataDir, kafkaAddr, natsURL, admin string) string {
	return `data_dir: ` + strconv.Quote(dataDir) + `
log: {level: info, format: console}
kafka:
  brokers: [` + strconv.Quote(kafkaAddr) + `]
  group: delaybridge-dev
  sources:
    - {topic: delay, dlq: delay.dlq}
nats:
  url: ` + strconv.Quote(natsURL) + `
  stream: DELAY
  consumer: delaybridge
  create: true
  sources:
    - {subject: "delay.>", dlq: dlq.delay}
targets:
  allow: ["*"]
admin:
  listen: ` + strconv.Quote(admin) + `
`
}

// devBanner is what dev prints once it runs. The absolute-time example is
// the next 09:00 UTC after now, so it is always in the future and within
// max_delay; dataDir (empty: a temporary directory) says what survives.
func devBanner(kafkaAddr, natsURL, admin string, now time.Time, dataDir string) string {
	at := now.UTC().Truncate(24 * time.Hour).Add(9 * time.Hour)
	if !at.After(now) {
		at = at.Add(24 * time.Hour)
	}
	keep := "everything is forgotten on exit"
	if dataDir != "" {
		keep = "the store and the brokers' data stay in " + dataDir
	}
	return `
delaybridge dev sandbox is running (Ctrl-C to stop; ` + keep + `)

  Kafka (in-process kfake):  ` + kafkaAddr + `   delay topic "delay", DLQ "delay.dlq", target "orders"
  NATS (embedded, JetStream): ` + natsURL + `   delay subjects "delay.>", targets "orders.>" (stream ORDERS), DLQ "dlq.delay"
  Admin:                      http://` + admin + `/v1/stats   /metrics   /readyz

Kafka, with kcat (apt-get install kcat):
  # watch the target
  kcat -C -b ` + kafkaAddr + ` -t orders -f 'key=%k value=%s headers=%h\n'
  # deliver in 10 seconds
  echo '{"order":42,"action":"close-unpaid"}' | kcat -P -b ` + kafkaAddr + ` -t delay -k order-42 \
      -H delay-after=10s -H delay-target=orders
  # cancel it (same key = same task id; the body is ignored, but kcat skips an empty line)
  echo cancel | kcat -P -b ` + kafkaAddr + ` -t delay -k order-42 -H delay-cancel=true
  # or cancel with a tombstone (key order-42, null value)
  echo 'order-42:' | kcat -P -Z -K: -b ` + kafkaAddr + ` -t delay
  # cross to NATS at an absolute time
  echo 'hello' | kcat -P -b ` + kafkaAddr + ` -t delay -H delay-at=` + at.Format(time.RFC3339) + ` -H delay-target=nats:orders.reminders

NATS, with the nats CLI (go install github.com/nats-io/natscli/nats@latest):
  nats -s ` + natsURL + ` sub 'orders.>'
  nats -s ` + natsURL + ` pub delay.orders '{"order":7}' -H delay-after:5s -H delay-target:orders.closed -H Nats-Msg-Id:order-7
  # cancel it (a new Nats-Msg-Id, or none: JetStream drops a repeated one)
  nats -s ` + natsURL + ` pub delay.orders '' -H delay-cancel:true -H delay-id:order-7

A message that cannot be scheduled (try one without delay-after) lands in the DLQ with a delay-error header:
  kcat -C -b ` + kafkaAddr + ` -t delay.dlq -f 'key=%k value=%s headers=%h\n'
  nats -s ` + natsURL + ` sub 'dlq.>'

Hold every delivery (messages are still taken in), then let them go:
  curl -X POST -d '{"reason":"trying it"}' http://` + admin + `/v1/firing/pause
  curl -X POST http://` + admin + `/v1/firing/resume
`
}
