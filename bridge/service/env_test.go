package service

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"

	"github.com/delaybridge/delaybridge/bridge/kafka"
	"github.com/delaybridge/delaybridge/bridge/nats"
	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/config"
	"github.com/delaybridge/delaybridge/internal/clock"
	"github.com/delaybridge/delaybridge/internal/natstest"
	"github.com/delaybridge/delaybridge/internal/testlog"
)

// env is a real Kafka-protocol broker (kfake) and a real NATS server with
// JetStream, in process, plus clients a test publishes and consumes with,
// and an injected clock for the bridge.
type env struct {
	t        *testing.T
	kc       *kfake.Cluster
	ns       *natsserver.Server
	natsPort int
	natsDir  string
	clk      *clock.Fake
	dataDir  string
	kcl      *kgo.Client
	nc       *natsgo.Conn
	extra    string // appended to the bridge config
	// mutate, if set, changes the config of every bridge started after:
	// a restart with another config.
	mutate func(*config.Config)
	// kafkaAddr is the broker address the bridge is configured with; by
	// default the kfake cluster's.
	kafkaAddr string

	mu   sync.Mutex
	got  []delivery
	seen chan struct{}
}

// delivery is a message read from a target or DLQ.
type delivery struct {
	transport string
	dest      string
	key       string
	value     string
	headers   []codec.Header
	at        time.Time // the bridge's (fake) clock when it was read
}

func (d delivery) header(k string) string {
	for _, h := range d.headers {
		if h.Key == k {
			return string(h.Value)
		}
	}
	return ""
}

const (
	kafkaDelay = "delay"
	kafkaDLQ   = "delay.dlq"
	kafkaOut   = "orders"
)

func newEnv(t *testing.T, extraConfig string) *env {
	t.Helper()
	e := &env{t: t, clk: clock.NewFake(time.Now()), dataDir: t.TempDir(), extra: extraConfig, seen: make(chan struct{}, 1)}
	var err error
	e.kc, err = kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(3, kafkaDelay, kafkaDLQ, kafkaOut))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.kc.Close)
	e.kafkaAddr = e.kc.ListenAddrs()[0]
	e.natsPort = freePort(t)
	e.natsDir = t.TempDir()
	e.startNATS()
	t.Cleanup(func() { e.ns.Shutdown() })

	e.kcl, err = kgo.NewClient(
		kgo.SeedBrokers(e.kc.ListenAddrs()...),
		kgo.ConsumeTopics(kafkaOut, kafkaDLQ),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.RecordPartitioner(kgo.ManualPartitioner()),
	)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.kcl.Close)
	e.nc, err = natsgo.Connect(e.ns.ClientURL(), natsgo.MaxReconnects(-1), natsgo.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.nc.Close)
	js, err := jetstream.New(e.nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for name, subj := range map[string]string{"ORDERS": "orders.>", "DLQ": "dlq.>"} {
		if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{subj}}); err != nil {
			t.Fatal(err)
		}
	}
	e.consume()
	return e
}

// freePort is natstest.FreePort: below the ephemeral range, so a broker
// stopped and started again finds its port free.
func freePort(t *testing.T) int {
	t.Helper()
	return natstest.FreePort(t)
}

func (e *env) startNATS() {
	e.ns = startNATSServer(e.t, &natsserver.Options{Port: e.natsPort, StoreDir: e.natsDir})
}

// startNATSServer starts a JetStream nats-server on 127.0.0.1 with o (Port
// 0 is a free one, StoreDir "" a temp dir) and waits until it takes
// connections. Shut it down with Shutdown (startNATS restarts it on the
// same port and store), or leave it to Cleanup.
func startNATSServer(t testing.TB, o *natsserver.Options) *natsserver.Server {
	t.Helper()
	o.Host, o.JetStream, o.NoSigs, o.NoLog = "127.0.0.1", true, true, true
	if o.Port == 0 {
		o.Port = -1
	}
	if o.StoreDir == "" {
		o.StoreDir = t.TempDir()
	}
	ns, err := natsserver.NewServer(o)
	if err != nil {
		t.Fatal(err)
	}
	go ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats server did not start")
	}
	t.Cleanup(ns.Shutdown)
	return ns
}

// consume reads every target and DLQ of both transports into e.got.
func (e *env) consume() {
	ctx, cancel := context.WithCancel(context.Background())
	e.t.Cleanup(cancel)
	go func() {
		for {
			fs := e.kcl.PollFetches(ctx)
			if ctx.Err() != nil {
				return
			}
			fs.EachRecord(func(r *kgo.Record) {
				d := delivery{transport: "kafka", dest: r.Topic, key: string(r.Key), value: string(r.Value), at: e.clk.Now()}
				for _, h := range r.Headers {
					d.headers = append(d.headers, codec.Header{Key: h.Key, Value: h.Value})
				}
				e.add(d)
			})
		}
	}()
	// NATS targets are read from their JetStream streams, so a delivery
	// acknowledged while this test's own connection was reconnecting is
	// still seen (a core subscription would miss it).
	js, err := jetstream.New(e.nc)
	if err != nil {
		e.t.Fatal(err)
	}
	for _, stream := range []string{"ORDERS", "DLQ"} {
		cons, err := js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{})
		if err != nil {
			e.t.Fatal(err)
		}
		cc, err := cons.Consume(func(m jetstream.Msg) {
			d := delivery{transport: "nats", dest: m.Subject(), value: string(m.Data()), at: e.clk.Now()}
			for k, vs := range m.Headers() {
				for _, v := range vs {
					d.headers = append(d.headers, codec.Header{Key: k, Value: []byte(v)})
				}
			}
			e.add(d)
		})
		if err != nil {
			e.t.Fatal(err)
		}
		e.t.Cleanup(cc.Stop)
	}
}

func (e *env) add(d delivery) {
	e.mu.Lock()
	e.got = append(e.got, d)
	e.mu.Unlock()
	select {
	case e.seen <- struct{}{}:
	default:
	}
}

func (e *env) deliveries() []delivery {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.got)
}

// waitFor polls the deliveries until cond holds; it fails after a generous
// real-time bound (brokers are real, so delivery is asynchronous).
func (e *env) waitFor(what string, cond func([]delivery) bool) []delivery {
	e.t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		got := e.deliveries()
		if cond(got) {
			return got
		}
		if time.Now().After(deadline) {
			seen := make([]string, 0, min(len(got), 20))
			for _, d := range got[:min(len(got), 20)] {
				seen = append(seen, d.dest+":"+d.value+" "+d.header("delay-error"))
			}
			e.t.Fatalf("timed out waiting for %s (%d deliveries so far, the first %d: %q)", what, len(got), len(seen), seen)
		}
		select {
		case <-e.seen:
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func (e *env) config() *config.Config {
	e.t.Helper()
	// Top-level settings a test may override through e.extra.
	top := ""
	for _, def := range []string{
		"shards: 4",
		"retry: {initial: 1s, max: 4s, multiplier: 2, jitter: 0.1, max_attempts: 3}",
	} {
		key, _, _ := strings.Cut(def, ":")
		if !strings.Contains(e.extra, key+":") {
			top += def + "\n"
		}
	}
	yml := fmt.Sprintf(`
data_dir: %q
horizon: 1m
max_delay: 30d
max_message_bytes: 65536
%s%s
kafka:
  brokers: [%q]
  group: bridge
  sources:
    - {topic: delay, dlq: delay.dlq}
nats:
  url: %q
  stream: DELAY
  consumer: bridge
  create: true
  sources:
    - {subject: "delay.>", dlq: dlq.delay}
targets:
  allow: ["orders*", "kafka:missing-topic", "nats:orders.>", "kafka:orders", "nats:nostream.>"]
admin:
  listen: "127.0.0.1:0"
`, e.dataDir, top, e.extra, e.kafkaAddr, "nats://127.0.0.1:"+strconv.Itoa(e.natsPort))
	cfg, err := config.LoadBytes([]byte(yml), nil)
	if err != nil {
		e.t.Fatal(err)
	}
	if e.mutate != nil {
		e.mutate(cfg)
	}
	return cfg
}

// fastKafka and fastNATS shorten the clients' waits for tests: group
// joins, fetch waits and reconnects take milliseconds, not seconds.
func fastKafka(c *kafka.Config) {
	c.HeartbeatInterval = 100 * time.Millisecond
	c.SessionTimeout = 6 * time.Second
	c.RebalanceTimeout = 2 * time.Second
	c.JoinBackoff = 100 * time.Millisecond
	c.MaxWait = 50 * time.Millisecond
}

func fastNATS(c *nats.Config) { c.ReconnectWait = 50 * time.Millisecond }

// start runs a bridge process on e's brokers and data dir; stop shuts it
// down the way SIGTERM does and waits for Run to return.
func (e *env) start() (svc *Service, stop func()) {
	e.t.Helper()
	return e.startWith(nil)
}

// startWith is start with kafkaHook (if not nil) adjusting the Kafka
// adapter's config after fastKafka.
func (e *env) startWith(kafkaHook func(*kafka.Config)) (svc *Service, stop func()) {
	e.t.Helper()
	var o Options
	if kafkaHook != nil {
		o.Kafka = func(c *kafka.Config) { fastKafka(c); kafkaHook(c) }
	}
	svc, cancel, done := e.runWith(o)
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					e.t.Errorf("bridge Run: %v", err)
				}
			case <-time.After(30 * time.Second):
				e.t.Error("bridge did not stop within 30s")
			}
		})
	}
	e.t.Cleanup(stop)
	return svc, stop
}

// runWith runs a bridge on e's brokers and data dir with o (what o leaves
// zero is as in start: the test logger, e's clock, fastKafka, fastNATS)
// and returns its cancel (SIGTERM) and Run's result; at Cleanup it is
// cancelled and waited for.
func (e *env) runWith(o Options) (svc *Service, cancel context.CancelFunc, done <-chan error) {
	e.t.Helper()
	if o.Logger == nil {
		o.Logger = testlog.New(e.t, zaptest.Level(testLogLevel()))
	}
	if o.Clock == nil {
		o.Clock = e.clk
	}
	if o.Kafka == nil {
		o.Kafka = fastKafka
	}
	if o.NATS == nil {
		o.NATS = fastNATS
	}
	ctx, cancel := context.WithCancel(context.Background())
	svc, err := New(ctx, e.config(), o)
	if err != nil {
		cancel()
		e.t.Fatalf("start bridge: %v", err)
	}
	ch, finished := make(chan error, 1), make(chan struct{})
	go func() {
		defer close(finished)
		ch <- svc.Run(ctx)
	}()
	e.t.Cleanup(func() {
		cancel()
		select {
		case <-finished:
		case <-time.After(30 * time.Second):
			e.t.Error("bridge did not stop within 30s")
		}
	})
	return svc, cancel, ch
}

// heldProduce is a Kafka target broker that takes produce requests for a
// topic and does not answer until released (see holdProduceTo).
type heldProduce struct {
	held     chan struct{} // a value when a produce is held
	release  chan struct{}
	refuse   atomic.Bool // released with refuse: the held produces fail at the connection
	released atomic.Bool
	once     sync.Once
}

// holdProduceTo makes kfake hold every produce request for topic until
// Release; after it they go through, or with Release(true) fail at the
// connection, the held ones and all later ones.
func (e *env) holdProduceTo(topic string) *heldProduce {
	h := &heldProduce{held: make(chan struct{}, 1), release: make(chan struct{})}
	e.kc.ControlKey(int16(kmsg.Produce), func(req kmsg.Request) (kmsg.Response, error, bool) {
		e.kc.KeepControl()
		for _, tp := range req.(*kmsg.ProduceRequest).Topics {
			if tp.Topic != topic {
				continue
			}
			if !h.released.Load() {
				select {
				case h.held <- struct{}{}:
				default:
				}
				e.kc.SleepControl(func() { <-h.release })
			}
			if h.refuse.Load() {
				return nil, errors.New("test: connection dropped"), true
			}
			return nil, nil, false
		}
		return nil, nil, false
	})
	e.t.Cleanup(func() { h.Release(false) })
	return h
}

// Release lets the held produces go (with refuse: fail at the connection,
// as every later one does).
func (h *heldProduce) Release(refuse bool) {
	h.once.Do(func() {
		h.refuse.Store(refuse) // before released: no produce slips through
		h.released.Store(true)
		close(h.release)
	})
}

// awaitHeld moves the bridge clock a second at a time until a produce is
// held (the fire loop published), or fails after a minute.
func (e *env) awaitHeld(h *heldProduce) {
	e.t.Helper()
	watchdog := time.After(60 * time.Second)
	for {
		e.clk.Advance(time.Second)
		select {
		case <-h.held:
			return
		case <-time.After(50 * time.Millisecond):
		case <-watchdog:
			e.t.Fatal("the fire loop never published")
		}
	}
}

// failProduceTo makes kfake drop the connection of every produce request
// for topic while the returned flag is set.
func (e *env) failProduceTo(topic string) *atomic.Bool {
	var fail atomic.Bool
	e.kc.ControlKey(int16(kmsg.Produce), func(req kmsg.Request) (kmsg.Response, error, bool) {
		e.kc.KeepControl()
		if !fail.Load() {
			return nil, nil, false
		}
		for _, tp := range req.(*kmsg.ProduceRequest).Topics {
			if tp.Topic == topic {
				return nil, errors.New("injected produce outage"), true
			}
		}
		return nil, nil, false
	})
	return &fail
}

// advanceUntil is waitFor moving the bridge's clock a second per poll: a
// publish that failed is rescheduled with backoff on that clock, however
// long it took in real time.
func (e *env) advanceUntil(what string, done func([]delivery) bool) []delivery {
	e.t.Helper()
	return e.waitFor(what, func(ds []delivery) bool {
		if done(ds) {
			return true
		}
		e.clk.Advance(time.Second)
		return false
	})
}

// publishKafka writes one record to the delay topic's partition with the
// given timestamp (zero: the fake clock's now, so a delay-after counts
// from the bridge's clock however long the test's setup took in real
// time) and headers as key, value pairs.
func (e *env) publishKafka(partition int32, ts time.Time, key, value []byte, headers ...string) {
	e.t.Helper()
	if ts.IsZero() {
		ts = e.clk.Now()
	}
	r := &kgo.Record{Topic: kafkaDelay, Partition: partition, Key: key, Value: value, Timestamp: ts}
	for i := 0; i+1 < len(headers); i += 2 {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: headers[i], Value: []byte(headers[i+1])})
	}
	if err := e.kcl.ProduceSync(context.Background(), r).FirstErr(); err != nil {
		e.t.Fatalf("produce: %v", err)
	}
}

// publishNATS writes one message to a delay subject through JetStream.
func (e *env) publishNATS(subject string, value []byte, headers ...string) {
	e.t.Helper()
	m := natsgo.NewMsg(subject)
	m.Data = value
	for i := 0; i+1 < len(headers); i += 2 {
		m.Header.Add(headers[i], headers[i+1])
	}
	js, err := jetstream.New(e.nc)
	if err != nil {
		e.t.Fatal(err)
	}
	if _, err := js.PublishMsg(context.Background(), m); err != nil {
		e.t.Fatalf("publish %s: %v", subject, err)
	}
}

// advance moves the bridge clock in steps, letting the fire loops catch up
// with each step (the engine reports nothing overdue) before the next one.
func (e *env) advance(svc *Service, total, step time.Duration) {
	e.t.Helper()
	for moved := time.Duration(0); moved < total; moved += step {
		e.clk.Advance(step)
		e.settle(svc)
	}
}

// settle waits until the engine has delivered everything due at the
// current fake time (or is retrying it with a future fire time: NextDue is
// a retry's time, while OldestOverdue counts the task from its due time)
// and its loaders have moved the horizons past that time.
func (e *env) settle(svc *Service) {
	e.t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		// The wheels' next due time says nothing of tasks still on disk:
		// the loaders must also have moved the horizons past the clock.
		st := svc.Engine().Stats()
		if (st.NextDue.IsZero() || st.NextDue.After(e.clk.Now())) && st.Horizon.After(e.clk.Now()) {
			return
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("engine did not settle: %+v at %v", st, e.clk.Now())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func byValue(ds []delivery, dest string) map[string][]delivery {
	out := map[string][]delivery{}
	for _, d := range ds {
		if dest == "" || d.dest == dest {
			out[d.value] = append(out[d.value], d)
		}
	}
	return out
}

func countDest(ds []delivery, pred func(delivery) bool) int {
	n := 0
	for _, d := range ds {
		if pred(d) {
			n++
		}
	}
	return n
}

// testLogLevel is warn unless DELAYBRIDGE_TEST_LOG names a zap level.
func testLogLevel() zapcore.Level {
	if l, err := zapcore.ParseLevel(os.Getenv("DELAYBRIDGE_TEST_LOG")); err == nil && os.Getenv("DELAYBRIDGE_TEST_LOG") != "" {
		return l
	}
	return zap.WarnLevel
}

// committedOffset is the bridge group's committed offset of a partition of
// the Kafka delay topic, -1 while it has none.
func (e *env) committedOffset(partition int32) int64 {
	gi := e.kc.GroupInfo("bridge")
	if gi == nil {
		return -1
	}
	c, ok := gi.Commits[kafkaDelay][partition]
	if !ok {
		return -1
	}
	return c.Offset
}
