package benchrun

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kfake"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/bridge/service"
	"github.com/delaybridge/delaybridge/config"
)

// Transports measured.
const (
	Kafka = "kafka"
	NATS  = "nats"
)

// broker is one in-process broker of a measurement: a fresh kfake cluster
// or nats-server per run, so runs do not share logs or memory.
type broker struct {
	transport string
	kc        *kfake.Cluster
	ns        *natsserver.Server
	dir       string
}

// KfakeSegmentBytes is log.segment.bytes of the in-process Kafka broker
// (kfake) of bench and dev. kfake keeps a segment in memory in one byte
// slice that doubles when full: copying a 32 or 64 MiB segment (its
// 100 MiB default allows that) under the broker's lock stalled every
// produce and fetch for 30-100 ms, about once a second at 5000 msg/s,
// which showed as the bridge's p99 lateness (a probe client of the bench
// process stalled at the same moments as the bridge's publishes). With
// 4 MiB segments a doubling copies at most 2 MiB. A real broker appends to
// files; Kafka's own minimum is 1 MiB.
const KfakeSegmentBytes = 4 << 20

// KfakeBrokerConfigs is the broker configuration bench and dev give kfake.
func KfakeBrokerConfigs() map[string]string {
	return map[string]string{"log.segment.bytes": strconv.Itoa(KfakeSegmentBytes)}
}

func startBroker(transport, dir string) (*broker, error) {
	b := &broker{transport: transport, dir: dir}
	switch transport {
	case Kafka:
		kc, err := kfake.NewCluster(kfake.NumBrokers(1),
			kfake.SeedTopics(3, "delay", "delay.dlq", "orders", "raw.in", "raw.out"),
			kfake.BrokerConfigs(KfakeBrokerConfigs()))
		if err != nil {
			return nil, fmt.Errorf("benchrun: kfake: %w", err)
		}
		b.kc = kc
	case NATS:
		port, err := freePort()
		if err != nil {
			return nil, err
		}
		ns, err := natsserver.NewServer(&natsserver.Options{
			Host: "127.0.0.1", Port: port, JetStream: true, StoreDir: filepath.Join(dir, "jetstream"),
			NoSigs: true, NoLog: true, JetStreamMaxMemory: 1 << 30, JetStreamMaxStore: 64 << 30,
		})
		if err != nil {
			return nil, fmt.Errorf("benchrun: nats server: %w", err)
		}
		go ns.Start()
		if !ns.ReadyForConnections(20 * time.Second) {
			return nil, errors.New("benchrun: nats server did not start")
		}
		b.ns = ns
		nc, err := natsgo.Connect(ns.ClientURL())
		if err != nil {
			b.close()
			return nil, fmt.Errorf("benchrun: connect nats: %w", err)
		}
		defer nc.Close()
		js, err := jetstream.New(nc)
		if err != nil {
			b.close()
			return nil, err
		}
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		for name, subj := range map[string]string{"DELAY": "delay.>", "ORDERS": "orders.>", "DLQ": "dlq.>", "RAWIN": "raw.in", "RAWOUT": "raw.out"} {
			if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{subj}}); err != nil {
				b.close()
				return nil, fmt.Errorf("benchrun: create stream %s: %w", name, err)
			}
		}
	default:
		return nil, fmt.Errorf("benchrun: unknown transport %q", transport)
	}
	return b, nil
}

func (b *broker) addr() string {
	if b.kc != nil {
		return b.kc.ListenAddrs()[0]
	}
	return b.ns.ClientURL()
}

func (b *broker) close() {
	if b.kc != nil {
		b.kc.Close()
	}
	if b.ns != nil {
		b.ns.Shutdown()
		b.ns.WaitForShutdown()
	}
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("benchrun: free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// bridgeYAML is a shipped-default configuration wired to one broker: only
// the settings that name the brokers, the data dir and the admin port
// differ from what `delaybridge run` defaults to. It returns the admin
// address too.
func bridgeYAML(b *broker, dataDir string, pprof bool) (yml, admin string, err error) {
	port, err := freePort()
	if err != nil {
		return "", "", err
	}
	admin = "127.0.0.1:" + strconv.Itoa(port)
	yml = "data_dir: " + strconv.Quote(dataDir) + "\nlog: {level: warn}\n"
	switch b.transport {
	case Kafka:
		yml += "kafka:\n  brokers: [" + strconv.Quote(b.addr()) + "]\n  group: bench\n  sources:\n    - {topic: delay, dlq: delay.dlq}\n"
	case NATS:
		yml += "nats:\n  url: " + strconv.Quote(b.addr()) + "\n  stream: DELAY\n  consumer: bench\n  create: true\n  sources:\n    - {subject: \"delay.>\", dlq: dlq.delay}\n"
	}
	yml += "targets:\n  allow: [\"*\"]\nadmin:\n  listen: " + strconv.Quote(admin) + "\n"
	if pprof {
		yml += "  pprof: true\n"
	}
	return yml, admin, nil
}

func bridgeConfig(b *broker, dataDir string) (*config.Config, error) {
	yml, _, err := bridgeYAML(b, dataDir, false)
	if err != nil {
		return nil, err
	}
	cfg, err := config.LoadBytes([]byte(yml), nil)
	if err != nil {
		return nil, fmt.Errorf("benchrun: bridge config: %w", err)
	}
	return cfg, nil
}

// bridge is a running in-process bridge (bridge/service, what `run` runs).
type bridge struct {
	svc     *service.Service
	reg     *prometheus.Registry
	stop    context.CancelFunc
	done    chan error
	once    sync.Once
	stopErr error
}

func startBridge(ctx context.Context, b *broker, dataDir string, log *zap.Logger) (*bridge, error) {
	cfg, err := bridgeConfig(b, dataDir)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dataDir, 0o755); err != nil {
		return nil, err
	}
	reg := prometheus.NewRegistry()
	ctx, cancel := context.WithCancel(ctx)
	svc, err := service.New(ctx, cfg, service.Options{Logger: log, Registry: reg})
	if err != nil {
		cancel()
		return nil, fmt.Errorf("benchrun: start bridge: %w", err)
	}
	br := &bridge{svc: svc, reg: reg, stop: cancel, done: make(chan error, 1)}
	go func() { br.done <- svc.Run(ctx) }()
	return br, nil
}

func (br *bridge) close() error {
	br.once.Do(func() {
		br.stop()
		select {
		case br.stopErr = <-br.done:
		case <-time.After(time.Minute):
			br.stopErr = errors.New("benchrun: bridge did not stop within a minute")
		}
	})
	return br.stopErr
}

// counter sums a counter family of the bridge's registry.
func (br *bridge) counter(name string) float64 {
	mfs, err := br.reg.Gather()
	if err != nil {
		return 0
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if c := m.GetCounter(); c != nil {
				sum += c.GetValue()
			}
		}
	}
	return sum
}

// histogram returns the sample count and sum of a histogram family of the
// bridge's registry, for the series whose label has the given value.
func (br *bridge) histogram(name, label, value string) (count uint64, sum float64) {
	mfs, err := br.reg.Gather()
	if err != nil {
		return 0, 0
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if lp.GetName() == label && lp.GetValue() == value {
					if h := m.GetHistogram(); h != nil {
						count += h.GetSampleCount()
						sum += h.GetSampleSum()
					}
				}
			}
		}
	}
	return count, sum
}
