package kafka

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/bridge"
	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/testlog"
	"github.com/delaybridge/delaybridge/shard"
)

// newCluster starts an in-process kfake cluster closed with the test.
func newCluster(t testing.TB, opts ...kfake.Opt) *kfake.Cluster {
	t.Helper()
	opts = append([]kfake.Opt{kfake.NumBrokers(1)}, opts...)
	c, err := kfake.NewCluster(opts...)
	if err != nil {
		t.Fatalf("kfake: %v", err)
	}
	t.Cleanup(c.Close)
	return c
}

// testConfig is a Config with timings fit for an in-process broker.
func testConfig(t testing.TB, brokers []string, group string, topics ...string) Config {
	cfg := Config{
		Brokers:           brokers,
		Group:             group,
		HeartbeatInterval: 100 * time.Millisecond,
		SessionTimeout:    6 * time.Second, // kfake's minimum
		RebalanceTimeout:  5 * time.Second,
		JoinBackoff:       50 * time.Millisecond,
		RetryMin:          5 * time.Millisecond,
		RetryMax:          50 * time.Millisecond,
		MaxWait:           200 * time.Millisecond,
		IdentityWait:      600 * time.Millisecond, // three long polls
		DialTimeout:       5 * time.Second,
		Logger:            testlog.New(t, zaptest.Level(zapcore.InfoLevel)),
	}
	for _, tp := range topics {
		cfg.Sources = append(cfg.Sources, SourceConfig{Topic: tp, Rules: &codec.Rules{DLQ: tp + ".dlq"}})
	}
	return cfg
}

// producer is a franz-go client that writes to explicit partitions; unlike
// kafka-go it tells a null value from an empty one.
func producer(t testing.TB, c *kfake.Cluster, opts ...kgo.Opt) *kgo.Client {
	t.Helper()
	opts = append([]kgo.Opt{kgo.SeedBrokers(c.ListenAddrs()...), kgo.RecordPartitioner(kgo.ManualPartitioner())}, opts...)
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		t.Fatalf("kgo: %v", err)
	}
	t.Cleanup(cl.Close)
	return cl
}

func produce(t testing.TB, cl *kgo.Client, rs ...*kgo.Record) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := cl.ProduceSync(ctx, rs...).FirstErr(); err != nil {
		t.Fatalf("produce: %v", err)
	}
}

// produceN writes n records round-robin over partitions, key "k<i>".
func produceN(t testing.TB, cl *kgo.Client, topic string, partitions int32, from, n int) {
	t.Helper()
	rs := make([]*kgo.Record, 0, n)
	for i := from; i < from+n; i++ {
		rs = append(rs, &kgo.Record{
			Topic: topic, Partition: int32(i) % partitions,
			Key: fmt.Appendf(nil, "k%d", i), Value: fmt.Appendf(nil, "v%d", i),
		})
	}
	produce(t, cl, rs...)
}

// memHandler is a bridge.Handler backed by memory: it records every handled
// message and keeps checkpoints like the store does (the last one written,
// with its fingerprint).
type memHandler struct {
	mu      sync.Mutex
	msgs    []codec.Message
	rules   []*codec.Rules
	batches []*bridge.Batch
	cps     map[string]int64
	// stored are the checkpoints as handed over; cps holds their
	// offsets (tests set it to fake a stored offset without the rest).
	stored   map[string]shard.Checkpoint
	attempts int
	// fail, when set, decides per Handle call whether it fails.
	fail func(ctx context.Context, b *bridge.Batch) error
}

func newMemHandler() *memHandler {
	return &memHandler{cps: make(map[string]int64), stored: make(map[string]shard.Checkpoint)}
}

var _ bridge.CheckpointLoader = (*memHandler)(nil)

func (h *memHandler) Handle(ctx context.Context, b *bridge.Batch) error {
	h.mu.Lock()
	h.attempts++
	fail := h.fail
	h.mu.Unlock()
	if fail != nil {
		if err := fail(ctx, b); err != nil {
			return err
		}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.batches = append(h.batches, b)
	for _, it := range b.Items {
		h.msgs = append(h.msgs, it.Msg)
		h.rules = append(h.rules, it.Rules)
	}
	for _, cp := range b.Checkpoints {
		h.cps[cp.Key] = cp.Offset
		h.stored[cp.Key] = cp
	}
	return nil
}

func (h *memHandler) Checkpoint(key string) (int64, bool, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	o, ok := h.cps[key]
	return o, ok, nil
}

func (h *memHandler) LoadCheckpoint(key string) (shard.Checkpoint, bool, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	o, ok := h.cps[key]
	if !ok {
		return shard.Checkpoint{}, false, nil
	}
	cp := h.stored[key]
	return shard.Checkpoint{Key: key, Offset: o, Fingerprint: cp.Fingerprint, Incarnation: cp.Incarnation}, true, nil
}

// checkpoint returns the stored checkpoint of key.
func (h *memHandler) checkpoint(key string) shard.Checkpoint {
	cp, _, _ := h.LoadCheckpoint(key)
	return cp
}

func (h *memHandler) setFail(f func(context.Context, *bridge.Batch) error) {
	h.mu.Lock()
	h.fail = f
	h.mu.Unlock()
}

func (h *memHandler) count() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.msgs)
}

func (h *memHandler) snapshot() []codec.Message {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.msgs)
}

// offsets returns the handled offsets per partition of topic.
func (h *memHandler) offsets(topic string) map[int32][]int64 {
	out := make(map[int32][]int64)
	for _, m := range h.snapshot() {
		if m.Source == topic {
			out[m.Partition] = append(out[m.Partition], m.Offset)
		}
	}
	return out
}

// waitFor polls cond until it holds or the deadline passes. It is for
// broker-side effects only; nothing asserts on timing.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// runSource starts s.Run in the background; the returned stop cancels it
// and returns Run's error.
func runSource(t testing.TB, s *Source, h bridge.Handler) (stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- s.Run(ctx, h) }()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case err = <-errc:
			case <-time.After(30 * time.Second):
				err = fmt.Errorf("Run did not return after cancel")
			}
			_ = s.Close()
		})
		return err
	}
	t.Cleanup(func() { _ = stop() })
	return stop
}

// committed returns the group's committed offsets of topic (kfake's view).
func committed(c *kfake.Cluster, group, topic string) map[int32]int64 {
	out := make(map[int32]int64)
	gi := c.GroupInfo(group)
	if gi == nil {
		return out
	}
	for p, gc := range gi.Commits[topic] {
		out[p] = gc.Offset
	}
	return out
}

// observedSource is a source of group g on topic, on c, whose log (Info
// and above) is observed.
func observedSource(t testing.TB, c *kfake.Cluster, topic string) (*Source, *observer.ObservedLogs) {
	t.Helper()
	core, logs := observer.New(zap.InfoLevel)
	cfg := testConfig(t, c.ListenAddrs(), "g", topic)
	cfg.Logger = zap.New(core)
	s, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s, logs
}
