package fault

import (
	"context"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/delaybridge/delaybridge/bridge/kafka"
	"github.com/delaybridge/delaybridge/bridge/nats"
	"github.com/delaybridge/delaybridge/bridge/service"
	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/config"
	"github.com/delaybridge/delaybridge/internal/clock"
	"github.com/delaybridge/delaybridge/internal/testlog"
)

// inproc runs bridge processes inside the test (bridge/service, the code
// `delaybridge run` runs), where a clock and a file system can be injected.
type inproc struct {
	t       *testing.T
	b       *brokers
	cfg     *config.Config
	clk     clock.Clock
	fs      vfs.FS
	dataDir string
}

func newInproc(t *testing.T, b *brokers, clk clock.Clock, fs vfs.FS) *inproc {
	t.Helper()
	dir := t.TempDir()
	yml := b.config(bridgeConfig{dataDir: filepath.Join(dir, "store"), adminPort: freePort(t)})
	cfg, err := config.LoadBytes([]byte(yml), nil)
	if err != nil {
		t.Fatal(err)
	}
	return &inproc{t: t, b: b, cfg: cfg, clk: clk, fs: fs, dataDir: cfg.DataDir}
}

// running is one started service.
type running struct {
	svc  *service.Service
	stop func() error
	done chan struct{}
	err  error // of Run, valid after done is closed
}

func (ip *inproc) start() *running {
	ip.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	svc, err := service.New(ctx, ip.cfg, service.Options{
		Logger: testlog.New(ip.t, zaptest.Level(zap.WarnLevel)),
		Clock:  ip.clk,
		FS:     ip.fs,
		Kafka: func(c *kafka.Config) {
			c.HeartbeatInterval = 100 * time.Millisecond
			c.SessionTimeout = 6 * time.Second
			c.RebalanceTimeout = 2 * time.Second
			c.JoinBackoff = 100 * time.Millisecond
			c.MaxWait = 50 * time.Millisecond
		},
		NATS: func(c *nats.Config) { c.ReconnectWait = 50 * time.Millisecond },
	})
	if err != nil {
		cancel()
		ip.t.Fatalf("start bridge: %v", err)
	}
	r := &running{svc: svc, done: make(chan struct{})}
	go func() {
		r.err = svc.Run(ctx)
		close(r.done)
	}()
	var once sync.Once
	r.stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case <-r.done:
			case <-time.After(30 * time.Second):
				ip.t.Error("bridge did not stop within 30s")
			}
		})
		return r.err
	}
	ip.t.Cleanup(func() { _ = r.stop() })
	return r
}

func (r *running) exited() bool {
	select {
	case <-r.done:
		return true
	default:
		return false
	}
}

// publisher sends test messages to both delay sources and remembers where
// each landed (Kafka partition and offset, JetStream sequence).
type publisher struct {
	t   *testing.T
	kcl *kgo.Client
	js  jetstream.JetStream
	// first position of each batch, to check what a source committed
	kafkaMin map[int32]int64
	natsMin  uint64
}

func newPublisher(t *testing.T, b *brokers) *publisher {
	t.Helper()
	kcl := b.kafkaClient()
	nc := b.natsConn()
	t.Cleanup(func() { kcl.Close(); nc.Close() })
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return &publisher{t: t, kcl: kcl, js: js}
}

// send publishes n messages per transport named prefix-k-i / prefix-n-i,
// with the headers hs(i) (delay headers) and cross-transport targets for
// odd i; it returns the values and resets the recorded first positions.
func (p *publisher) send(prefix string, n int, hs func(i int) []string) []string {
	p.t.Helper()
	ctx := context.Background()
	p.kafkaMin, p.natsMin = map[int32]int64{}, 0
	var vals []string
	var recs []*kgo.Record
	for i := range n {
		v := prefix + "-k-" + strconv.Itoa(i)
		target := kafkaTarget
		if i%2 == 1 {
			target = "nats:orders.cross"
		}
		recs = append(recs, kafkaRecord(int32(i%3), []byte(v), []byte(v), hdr(append(hs(i), codec.HeaderTarget, target)...)))
		vals = append(vals, v)
	}
	res := p.kcl.ProduceSync(ctx, recs...)
	if err := res.FirstErr(); err != nil {
		p.t.Fatalf("produce: %v", err)
	}
	for _, r := range res {
		if m, ok := p.kafkaMin[r.Record.Partition]; !ok || r.Record.Offset < m {
			p.kafkaMin[r.Record.Partition] = r.Record.Offset
		}
	}
	for i := range n {
		v := prefix + "-n-" + strconv.Itoa(i)
		target := "orders.n"
		if i%2 == 1 {
			target = "kafka:" + kafkaTarget
		}
		ack, err := p.js.PublishMsg(ctx, natsMsg("delay.fault", []byte(v), hdr(append(hs(i), codec.HeaderTarget, target)...)))
		if err != nil {
			p.t.Fatalf("publish: %v", err)
		}
		if p.natsMin == 0 || ack.Sequence < p.natsMin {
			p.natsMin = ack.Sequence
		}
		vals = append(vals, v)
	}
	return vals
}

// lostAndDups reports which of vals have not reached a target and how many
// extra copies arrived.
func lostAndDups(col *collector, vals []string) (lost []string, dups int) {
	got := col.byValue(isTarget)
	for _, v := range vals {
		switch n := len(got[v]); {
		case n == 0:
			lost = append(lost, v)
		case n > 1:
			dups += n - 1
		}
	}
	return lost, dups
}

func waitDelivered(t *testing.T, col *collector, vals []string, what string) {
	t.Helper()
	var lost []string
	if !waitFor(drainWait, func() bool { lost, _ = lostAndDups(col, vals); return len(lost) == 0 }) {
		t.Fatalf("%s: %d of %d never delivered (e.g. %v)", what, len(lost), len(vals), lost[:min(5, len(lost))])
	}
}
