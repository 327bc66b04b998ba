package fault

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/natstest"
)

// long reports whether the long form runs (DELAYBRIDGE_LONG=1).
func long() bool { return os.Getenv("DELAYBRIDGE_LONG") == "1" }

// Broker-side names used by every test.
const (
	kafkaDelay   = "delay"
	kafkaDLQ     = "delay.dlq"
	kafkaTarget  = "orders"
	natsStream   = "DELAY"
	natsDLQ      = "dlq.delay"
	natsTargetSS = "orders.>" // subjects of the ORDERS stream
)

var (
	buildOnce sync.Once
	binPath   string
	buildErr  error
	binDir    string
)

func TestMain(m *testing.M) {
	code := m.Run()
	if binDir != "" {
		os.RemoveAll(binDir)
	}
	os.Exit(code)
}

// binary builds ./cmd/delaybridge once per test run, so the process as
// shipped is what the tests kill and restart.
func binary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		out, err := exec.Command("go", "env", "GOMOD").Output()
		if err != nil {
			buildErr = fmt.Errorf("go env GOMOD: %w", err)
			return
		}
		root := filepath.Dir(strings.TrimSpace(string(out)))
		binDir, err = os.MkdirTemp("", "delaybridge-fault-bin-")
		if err != nil {
			buildErr = err
			return
		}
		binPath = filepath.Join(binDir, "delaybridge")
		cmd := exec.Command("go", "build", "-o", binPath, "./cmd/delaybridge")
		cmd.Dir = root
		if b, err := cmd.CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("go build ./cmd/delaybridge: %w\n%s", err, b)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binPath
}

// freePort is natstest.FreePort: below the ephemeral range, so a broker
// stopped and started again finds its port free.
func freePort(t *testing.T) int {
	t.Helper()
	return natstest.FreePort(t)
}

// brokers is a kfake cluster and a nats-server, both in process, on fixed
// ports and with their data kept on disk so either can be stopped and
// started again as the same broker.
type brokers struct {
	t     *testing.T
	kport int
	kdir  string
	kc    *kfake.Cluster
	nport int
	ndir  string
	ns    *natsserver.Server
	// maxPayload, if set, is the NATS server's max_payload.
	maxPayload int32
	// natsStarted: the server has started once (a restart keeps nport).
	natsStarted bool
}

func newBrokers(t *testing.T, maxPayload int32) *brokers {
	t.Helper()
	b := &brokers{t: t, kport: freePort(t), kdir: t.TempDir(), nport: freePort(t), ndir: t.TempDir(), maxPayload: maxPayload}
	b.startKafka()
	b.startNATS()
	t.Cleanup(func() {
		if b.kc != nil {
			b.kc.Close()
		}
		if b.ns != nil {
			b.ns.Shutdown()
			b.ns.WaitForShutdown()
		}
	})
	nc := b.natsConn()
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for name, subj := range map[string]string{natsStream: "delay.>", "ORDERS": natsTargetSS, "DLQ": "dlq.>"} {
		if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{subj}}); err != nil {
			t.Fatalf("create stream %s: %v", name, err)
		}
	}
	return b
}

func (b *brokers) kafkaAddr() string { return "127.0.0.1:" + strconv.Itoa(b.kport) }
func (b *brokers) natsURL() string   { return "nats://127.0.0.1:" + strconv.Itoa(b.nport) }

// startKafka starts (or restarts, from its data dir) the Kafka cluster.
func (b *brokers) startKafka() {
	b.t.Helper()
	var err error
	for range 50 { // the port may linger briefly after a Close
		b.kc, err = kfake.NewCluster(kfake.NumBrokers(1), kfake.Ports(b.kport), kfake.DataDir(b.kdir), kfake.SyncWrites(),
			kfake.SeedTopics(3, kafkaDelay, kafkaDLQ, kafkaTarget))
		if err == nil {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	b.t.Fatalf("start kfake on port %d: %v", b.kport, err)
}

func (b *brokers) stopKafka() {
	b.kc.Close()
	b.kc = nil
}

// startNATS starts (or restarts, on the same port and store dir) the NATS
// server with JetStream. The first start may find its port taken by a
// parallel test since freePort picked it (seen once in CI: the server did
// not start): it then starts on a new one. A restart keeps its port.
func (b *brokers) startNATS() {
	b.t.Helper()
	first := !b.natsStarted
	for attempt := 1; ; attempt++ {
		opts := &natsserver.Options{
			Host: "127.0.0.1", Port: b.nport, JetStream: true, StoreDir: b.ndir, NoSigs: true, NoLog: true,
		}
		if b.maxPayload > 0 {
			opts.MaxPayload = b.maxPayload
		}
		ns, err := natsserver.NewServer(opts)
		if err != nil {
			b.t.Fatal(err)
		}
		go ns.Start()
		if ns.ReadyForConnections(20 * time.Second) {
			b.ns, b.natsStarted = ns, true
			return
		}
		ns.Shutdown()
		ns.WaitForShutdown()
		if !first || attempt == 3 {
			b.t.Fatalf("nats server did not start on port %d", b.nport)
		}
		b.nport = freePort(b.t)
	}
}

func (b *brokers) stopNATS() {
	b.ns.Shutdown()
	b.ns.WaitForShutdown()
	b.ns = nil
}

func (b *brokers) natsConn() *natsgo.Conn {
	b.t.Helper()
	nc, err := natsgo.Connect(b.natsURL(), natsgo.MaxReconnects(-1), natsgo.ReconnectWait(50*time.Millisecond),
		natsgo.RetryOnFailedConnect(true))
	if err != nil {
		b.t.Fatal(err)
	}
	return nc
}

func (b *brokers) kafkaClient(opts ...kgo.Opt) *kgo.Client {
	b.t.Helper()
	cl, err := kgo.NewClient(append([]kgo.Opt{
		kgo.SeedBrokers(b.kafkaAddr()),
		kgo.RecordPartitioner(kgo.ManualPartitioner()),
		kgo.RetryTimeout(2 * time.Minute),
		// Batches within the broker's message.max.bytes (1 MiB), so 1 MB
		// records go one per batch.
		kgo.ProducerBatchMaxBytes(1_040_000),
	}, opts...)...)
	if err != nil {
		b.t.Fatal(err)
	}
	return cl
}

// bridgeConfig is the YAML of one bridge process; extra is appended to the
// top level (it must not repeat a key set here).
type bridgeConfig struct {
	dataDir    string
	adminPort  int
	maxBytes   int
	fireBatch  int
	allow      string // YAML list
	retry      string
	extraLines string
}

func (b *brokers) config(c bridgeConfig) string {
	if c.maxBytes == 0 {
		c.maxBytes = 1 << 20
	}
	if c.fireBatch == 0 {
		c.fireBatch = 64
	}
	if c.allow == "" {
		c.allow = `["*"]`
	}
	if c.retry == "" {
		// Fire-time publish failures during an outage must not become
		// publish-failed dead letters in these tests: retry for long.
		c.retry = "{initial: 100ms, max: 1s, multiplier: 2, jitter: 0.1, max_attempts: 100000}"
	}
	return fmt.Sprintf(`data_dir: %q
shards: 4
horizon: 1m
max_delay: 30d
max_message_bytes: %d
fire_batch: %d
retry: %s
shutdown_timeout: 5s
log: {level: info, format: json}
kafka:
  brokers: [%q]
  group: bridge
  sources:
    - {topic: %s, dlq: %s}
nats:
  url: %q
  stream: %s
  consumer: bridge
  create: true
  sources:
    - {subject: "delay.>", dlq: %s}
targets:
  allow: %s
admin:
  listen: "127.0.0.1:%d"
%s`, c.dataDir, c.maxBytes, c.fireBatch, c.retry, b.kafkaAddr(), kafkaDelay, kafkaDLQ, b.natsURL(), natsStream, natsDLQ,
		c.allow, c.adminPort, c.extraLines)
}

// proc is one delaybridge child process.
type proc struct {
	t       *testing.T
	cmd     *exec.Cmd
	admin   string
	logPath string
	logFrom int64 // size of the shared log file when this process started
	exited  chan struct{}
	err     error // of Wait, valid after exited is closed
	onKill  func()
}

// runner starts bridge processes from one config file and data dir, one at
// a time, and keeps their logs in one file for diagnosis.
type runner struct {
	t       *testing.T
	bin     string
	cfgPath string
	admin   string
	logPath string
	cur     *proc
	starts  int
	expiry  *sessionExpiry
}

func newRunner(t *testing.T, b *brokers, c bridgeConfig) *runner {
	t.Helper()
	dir := t.TempDir()
	if c.dataDir == "" {
		c.dataDir = filepath.Join(dir, "store")
	}
	c.adminPort = freePort(t)
	r := &runner{t: t, bin: binary(t), cfgPath: filepath.Join(dir, "config.yaml"), admin: "127.0.0.1:" + strconv.Itoa(c.adminPort),
		logPath: filepath.Join(dir, "bridge.log"), expiry: &sessionExpiry{t: t, group: "bridge", after: sessionTimeout + 5*time.Second}}
	cl := b.kafkaClient()
	t.Cleanup(cl.Close)
	r.expiry.watch(cl)
	if err := os.WriteFile(r.cfgPath, []byte(b.config(c)), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if r.cur != nil {
			r.cur.kill()
		}
		if t.Failed() {
			r.dumpLog(60)
		}
		// FAULT_LOGS=DIR keeps each test's bridge log for diagnosis.
		if keep := os.Getenv("FAULT_LOGS"); keep != "" {
			if b, err := os.ReadFile(r.logPath); err == nil {
				_ = os.MkdirAll(keep, 0o755)
				_ = os.WriteFile(filepath.Join(keep, strings.ReplaceAll(t.Name(), "/", "_")+".log"), b, 0o644)
			}
		}
	})
	return r
}

// start launches a bridge process; it does not wait for readiness.
func (r *runner) start() *proc {
	r.t.Helper()
	f, err := os.OpenFile(r.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		r.t.Fatal(err)
	}
	r.starts++
	fmt.Fprintf(f, "{\"fault-test\":\"start %d\"}\n", r.starts)
	from, _ := f.Seek(0, io.SeekCurrent)
	cmd := exec.Command(r.bin, "run", "--config", r.cfgPath)
	// The bridge refuses DELAYBRIDGE_* variables that name no config key
	// (DELAYBRIDGE_LONG is the test's): the config file is the whole config.
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "DELAYBRIDGE_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	// One client id per process, so that sessionExpiry knows whose group
	// member is whose.
	clientID := "fault-" + strconv.Itoa(r.starts)
	cmd.Env = append(cmd.Env, "DELAYBRIDGE_KAFKA_CLIENT_ID="+clientID)
	cmd.Stdout, cmd.Stderr = f, f
	if err := cmd.Start(); err != nil {
		f.Close()
		r.t.Fatal(err)
	}
	p := &proc{t: r.t, cmd: cmd, admin: r.admin, logPath: r.logPath, logFrom: from, exited: make(chan struct{}),
		onKill: func() { r.expiry.killed(clientID) }}
	go func() {
		p.err = cmd.Wait()
		f.Close()
		close(p.exited)
	}()
	r.cur = p
	return p
}

// kill sends SIGKILL and waits for the process to be gone.
func (p *proc) kill() {
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.exited
	p.onKill()
}

// term sends SIGTERM and waits for a clean exit.
func (p *proc) term() error {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
		return p.err
	case <-time.After(30 * time.Second):
		p.kill()
		return errors.New("bridge did not stop within 30s of SIGTERM")
	}
}

func (p *proc) running() bool {
	select {
	case <-p.exited:
		return false
	default:
		return true
	}
}

// readyz returns the status code of GET /readyz, or 0 if the admin server
// does not answer.
func (p *proc) readyz() int {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get("http://" + p.admin + "/readyz")
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

// waitReady polls /readyz until it answers 200.
func (p *proc) waitReady(timeout time.Duration) {
	p.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		if !p.running() {
			p.t.Fatalf("bridge exited before it was ready: %v", p.err)
		}
		if p.readyz() == http.StatusOK {
			return
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("bridge not ready after %v (last /readyz %d)", timeout, p.readyz())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// waitLog waits until this process has logged a line containing each of
// the substrings (the JSON log is written to a file for diagnosis).
func (p *proc) waitLog(timeout time.Duration, subs ...string) {
	p.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		b, err := os.ReadFile(p.logPath)
		if err != nil {
			p.t.Fatal(err)
		}
		if int64(len(b)) >= p.logFrom {
			b = b[p.logFrom:]
		}
		all := true
		for _, s := range subs {
			all = all && strings.Contains(string(b), s)
		}
		if all {
			return
		}
		if !p.running() {
			p.t.Fatalf("bridge exited before logging %q: %v", subs, p.err)
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("bridge did not log %q within %v", subs, timeout)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (r *runner) dumpLog(lines int) {
	f, err := os.Open(r.logPath)
	if err != nil {
		return
	}
	defer f.Close()
	var all []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		all = append(all, sc.Text())
	}
	if len(all) > lines {
		all = all[len(all)-lines:]
	}
	r.t.Logf("last %d lines of %s:\n%s", len(all), r.logPath, strings.Join(all, "\n"))
}

// delivery is one message read from a target or dead-letter destination.
type delivery struct {
	transport string
	dest      string
	pos       string // topic/partition@offset or stream#seq: unique per stored message
	key       string
	value     string
	headers   map[string]string
	at        time.Time
}

// collector reads every target and DLQ of both transports from the
// beginning, continuously, across broker restarts. Kafka: a kgo consumer;
// NATS: durable pull consumers with explicit acks, so nothing stored is
// missed while a connection is down. Deliveries are keyed by their broker
// position, so a consumer redelivery is not mistaken for a duplicate
// publish by the bridge.
type collector struct {
	now   func() time.Time // stamps each delivery (the bridge's clock in clock tests)
	mu    sync.Mutex
	byPos map[string]delivery
}

func (b *brokers) collect(t *testing.T) *collector { return b.collectAt(t, time.Now) }

// collectAt is collect with deliveries stamped by now.
func (b *brokers) collectAt(t *testing.T, now func() time.Time) *collector {
	t.Helper()
	c := &collector{now: now, byPos: map[string]delivery{}}
	ctx, cancel := context.WithCancel(context.Background())
	kcl := b.kafkaClient(kgo.ConsumeTopics(kafkaTarget, kafkaDLQ), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.FetchMaxBytes(64<<20), kgo.FetchMaxPartitionBytes(32<<20))
	kdone := make(chan struct{})
	go func() {
		defer close(kdone)
		for {
			fs := kcl.PollFetches(ctx)
			if ctx.Err() != nil {
				return
			}
			fs.EachRecord(func(r *kgo.Record) {
				d := delivery{transport: "kafka", dest: r.Topic, key: string(r.Key), value: string(r.Value), at: c.now(),
					pos: fmt.Sprintf("%s/%d@%d", r.Topic, r.Partition, r.Offset), headers: map[string]string{}}
				for _, h := range r.Headers {
					d.headers[h.Key] = string(h.Value)
				}
				c.add(d)
			})
		}
	}()
	nc := b.natsConn()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	var ccs []jetstream.ConsumeContext
	for _, stream := range []string{"ORDERS", "DLQ"} {
		cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
		cons, err := js.CreateOrUpdateConsumer(cctx, stream, jetstream.ConsumerConfig{
			Durable: "faulttest", AckPolicy: jetstream.AckExplicitPolicy, DeliverPolicy: jetstream.DeliverAllPolicy,
			MaxAckPending: 100000,
		})
		ccancel()
		if err != nil {
			t.Fatal(err)
		}
		cc, err := cons.Consume(func(m jetstream.Msg) {
			md, err := m.Metadata()
			if err != nil {
				return
			}
			d := delivery{transport: "nats", dest: m.Subject(), value: string(m.Data()), at: c.now(),
				pos: fmt.Sprintf("%s#%d", md.Stream, md.Sequence.Stream), headers: map[string]string{}}
			for k, vs := range m.Headers() {
				if len(vs) > 0 {
					d.headers[strings.ToLower(k)] = vs[0]
				}
			}
			c.add(d)
			_ = m.Ack()
		}, jetstream.PullMaxMessages(2000))
		if err != nil {
			t.Fatal(err)
		}
		ccs = append(ccs, cc)
	}
	t.Cleanup(func() {
		for _, cc := range ccs {
			cc.Stop()
		}
		cancel()
		<-kdone
		kcl.Close()
		nc.Close()
	})
	return c
}

func (c *collector) add(d delivery) {
	c.mu.Lock()
	if _, ok := c.byPos[d.pos]; !ok {
		c.byPos[d.pos] = d
	}
	c.mu.Unlock()
}

// byValue groups the deliveries by value, for destinations dest accepts.
func (c *collector) byValue(dest func(delivery) bool) map[string][]delivery {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := map[string][]delivery{}
	for _, d := range c.byPos {
		if dest(d) {
			out[d.value] = append(out[d.value], d)
		}
	}
	return out
}

func isTarget(d delivery) bool {
	return d.dest == kafkaTarget || strings.HasPrefix(d.dest, "orders.")
}

func isDLQ(d delivery) bool { return d.dest == kafkaDLQ || d.dest == natsDLQ }

// waitFor polls cond every 100 ms until it holds or timeout passes; brokers
// are real, so delivery is asynchronous. It reports whether cond held.
func waitFor(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// header is a convenience for building header lists.
func hdr(kv ...string) []codec.Header {
	var hs []codec.Header
	for i := 0; i+1 < len(kv); i += 2 {
		hs = append(hs, codec.Header{Key: kv[i], Value: []byte(kv[i+1])})
	}
	return hs
}

func kafkaRecord(partition int32, key, value []byte, hs []codec.Header) *kgo.Record {
	r := &kgo.Record{Topic: kafkaDelay, Partition: partition, Key: key, Value: value}
	for _, h := range hs {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: h.Key, Value: h.Value})
	}
	return r
}

func natsMsg(subject string, value []byte, hs []codec.Header) *natsgo.Msg {
	m := natsgo.NewMsg(subject)
	m.Data = value
	for _, h := range hs {
		m.Header.Add(h.Key, string(h.Value))
	}
	return m
}
