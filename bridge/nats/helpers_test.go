package nats

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/delaybridge/delaybridge/bridge"
	"github.com/delaybridge/delaybridge/internal/testlog"
	"github.com/delaybridge/delaybridge/metrics"
	"github.com/delaybridge/delaybridge/shard"
)

// jsOptions are the options of an in-process JetStream server on a free port.
func jsOptions(t testing.TB) *server.Options {
	return &server.Options{
		Host:      "127.0.0.1",
		Port:      -1,
		JetStream: true,
		StoreDir:  t.TempDir(),
		NoLog:     true,
		NoSigs:    true,
	}
}

// startServer starts a server and shuts it down at the end of the test.
func startServer(t testing.TB, opts *server.Options) *server.Server {
	t.Helper()
	s, err := server.NewServer(opts)
	if err != nil {
		t.Fatalf("new server: %v", err)
	}
	go s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		t.Fatal("server not ready")
	}
	t.Cleanup(func() {
		s.Shutdown()
		s.WaitForShutdown()
	})
	return s
}

func serverURL(s *server.Server) string { return s.ClientURL() }

// testConfig is a Config for tests: quick reconnects, a test logger and
// fresh metrics.
func testConfig(t testing.TB, url string) Config {
	return Config{
		URL:           url,
		Stream:        "DELAY",
		Consumer:      "bridge",
		Sources:       []SourceConfig{{Subject: "delay.>"}},
		ReconnectWait: 20 * time.Millisecond,
		Logger:        testlog.New(t),
		Metrics:       metrics.New(prometheus.NewRegistry()),
	}
}

func connect(t testing.TB, cfg Config) *natsgo.Conn {
	t.Helper()
	nc, err := Connect(cfg)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(nc.Close)
	return nc
}

func newJS(t testing.TB, nc *natsgo.Conn) jetstream.JetStream {
	t.Helper()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// createdSource starts a JetStream server and a Source that creates its
// stream and consumer (Config.Create); mod, if not nil, adjusts the
// config first.
func createdSource(t testing.TB, mod func(*Config)) (Config, *natsgo.Conn, jetstream.JetStream, *Source) {
	t.Helper()
	return createdSourceOn(t, jsOptions(t), mod)
}

// createdSourceOn is createdSource on a server started with opts.
func createdSourceOn(t testing.TB, opts *server.Options, mod func(*Config)) (Config, *natsgo.Conn, jetstream.JetStream, *Source) {
	t.Helper()
	s := startServer(t, opts)
	cfg := testConfig(t, serverURL(s))
	cfg.Create = true
	if mod != nil {
		mod(&cfg)
	}
	nc := connect(t, cfg)
	js := newJS(t, nc)
	src, err := NewSource(nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return cfg, nc, js, src
}

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// eventually polls cond until it holds or 15 s passed (broker effects).
func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

var errHandle = errors.New("test: handle failed")

// recorder is a bridge.Handler that keeps what it was handed and a
// checkpoint store, and can be told to fail.
type recorder struct {
	mu      sync.Mutex
	items   []bridge.Item
	batches []bridge.Batch
	cps     map[string]int64
	fps     map[string]uint64 // fingerprints of cps
	fail    bool
	calls   int
	// failCpOnly fails that many checkpoint-only writes (the stream's
	// incarnation at start); cpOnly counts their attempts.
	failCpOnly, cpOnly int
	// itemsBeforeInc: a message batch came while no incarnation was stored.
	itemsBeforeInc bool
}

func newRecorder() *recorder { return &recorder{cps: map[string]int64{}, fps: map[string]uint64{}} }

var _ bridge.CheckpointLoader = (*recorder)(nil)

func (r *recorder) Handle(_ context.Context, b *bridge.Batch) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	// fail and calls are about message batches: the source's
	// checkpoint-only writes (the stream's incarnation at start) pass.
	if len(b.Items) > 0 {
		r.calls++
		if r.fail {
			return errHandle
		}
		if !r.incStoredLocked() {
			r.itemsBeforeInc = true
		}
	} else if len(b.Checkpoints) > 0 {
		r.cpOnly++
		if r.failCpOnly > 0 {
			r.failCpOnly--
			return errHandle
		}
	}
	r.items = append(r.items, slices.Clone(b.Items)...)
	if len(b.Items) > 0 {
		// Message batches only, not the source's checkpoint-only writes.
		r.batches = append(r.batches, bridge.Batch{Items: slices.Clone(b.Items), Checkpoints: slices.Clone(b.Checkpoints)})
	}
	for _, c := range b.Checkpoints {
		r.cps[c.Key] = c.Offset // as the store: the last write wins
		r.fps[c.Key] = c.Fingerprint
	}
	return nil
}

func (r *recorder) incStoredLocked() bool {
	for k := range r.cps {
		if strings.HasPrefix(k, IncarnationKey("")) {
			return true
		}
	}
	return false
}

func (r *recorder) Checkpoint(key string) (int64, bool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	off, ok := r.cps[key]
	return off, ok, nil
}

func (r *recorder) LoadCheckpoint(key string) (shard.Checkpoint, bool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	off, ok := r.cps[key]
	return shard.Checkpoint{Key: key, Offset: off, Fingerprint: r.fps[key]}, ok, nil
}

// incarnations returns the incarnations of the handled messages, one
// entry per run of equal values.
func (r *recorder) incarnations() []uint32 {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []uint32
	for _, it := range r.items {
		if len(out) == 0 || out[len(out)-1] != it.Msg.Incarnation {
			out = append(out, it.Msg.Incarnation)
		}
	}
	return out
}

func (r *recorder) setFail(f bool) {
	r.mu.Lock()
	r.fail = f
	r.mu.Unlock()
}

func (r *recorder) numCalls() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.calls
}

func (r *recorder) seqs() []int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]int64, len(r.items))
	for i, it := range r.items {
		out[i] = it.Msg.Offset
	}
	return out
}

// setForTest sets the package variable *p to v until t ends. The old
// value comes back in a t.Cleanup, which runs after the cleanups
// registered later: sources started after the call (runSource) are
// stopped before it, so none reads the variable while it is restored. (A
// defer would restore it while they still run: a data race, CI at
// bbe0476.)
func setForTest[T any](t testing.TB, p *T, v T) {
	old := *p
	*p = v
	t.Cleanup(func() { *p = old })
}

// runSource runs src.Run in the background; the returned stop cancels it
// and returns Run's result.
func runSource(t testing.TB, src *Source, h bridge.Handler) (stop func() error) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx, h) }()
	var once sync.Once
	var res error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case res = <-done:
			case <-time.After(15 * time.Second):
				t.Error("Run did not return after cancel")
			}
		})
		return res
	}
	t.Cleanup(func() { _ = stop() })
	return stop
}

func consumerInfo(t testing.TB, js jetstream.JetStream, stream, name string) *jetstream.ConsumerInfo {
	t.Helper()
	c, err := js.Consumer(context.Background(), stream, name)
	if err != nil {
		t.Fatalf("consumer: %v", err)
	}
	info, err := c.Info(context.Background())
	if err != nil {
		t.Fatalf("consumer info: %v", err)
	}
	return info
}

func publish(t testing.TB, js jetstream.JetStream, subject string, data string, h natsgo.Header) *jetstream.PubAck {
	t.Helper()
	ack, err := js.PublishMsg(context.Background(), &natsgo.Msg{Subject: subject, Data: []byte(data), Header: h})
	if err != nil {
		t.Fatalf("publish %s: %v", subject, err)
	}
	return ack
}

// fetchUnacked takes n messages of the source's consumer on another
// client and never acknowledges them: a run that crashed with them in
// flight.
func fetchUnacked(t testing.TB, js jetstream.JetStream, cfg Config, n int) {
	t.Helper()
	cons, err := js.Consumer(ctxT(t), cfg.Stream, cfg.Consumer)
	if err != nil {
		t.Fatal(err)
	}
	got, err := cons.Fetch(n, jetstream.FetchMaxWait(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	k := 0
	for range got.Messages() {
		k++
	}
	if k != n {
		t.Fatalf("fetched %d of %d", k, n)
	}
}
