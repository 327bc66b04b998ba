// Package bridgetest is the behaviour suite every transport adapter passes,
// run against a real in-process broker of that transport. An adapter test
// implements Broker for its broker and calls Run.
package bridgetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/bridge"
	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/shard"
)

// Msg is a raw broker message as a test publishes or consumes it.
type Msg struct {
	Key     []byte
	Value   []byte
	Headers []codec.Header
}

// Broker is a running in-process broker of one transport plus the adapter
// under test. Every call fails the test on error.
type Broker interface {
	Transport() codec.Transport
	// NewDelaySource prepares a fresh, empty delay source and returns its
	// name as it appears in codec.Message.Source (Kafka: the topic; NATS:
	// the stream).
	NewDelaySource(t testing.TB) string
	// Publish writes m to the delay source name.
	Publish(t testing.TB, source string, m Msg)
	// NewSource returns the adapter's bridge.Source reading the delay source
	// name as consumer/group `group`, applying rules to every message.
	NewSource(t testing.TB, source, group string, rules *codec.Rules) bridge.Source
	// NewTarget prepares a fresh target destination (topic / subject backed
	// by a stream) and returns its name as written after "kafka:"/"nats:".
	NewTarget(t testing.TB) string
	// NewSink returns the adapter's publisher.
	NewSink(t testing.TB) shard.Sink
	// Consume reads exactly n messages from a target in order, failing the
	// test if they do not arrive within a generous timeout.
	Consume(t testing.TB, target string, n int) []Msg
}

// Run runs the shared adapter behaviours against b.
func Run(t *testing.T, b Broker) {
	t.Run("HandleSeesMessagesInOrder", func(t *testing.T) { testInOrder(t, b) })
	t.Run("NoAckWithoutHandle", func(t *testing.T) { testNoAckOnError(t, b) })
	t.Run("CheckpointSkipsStored", func(t *testing.T) { testCheckpointSkip(t, b) })
	t.Run("SinkDeliversExactly", func(t *testing.T) { testSink(t, b) })
	t.Run("ContractRoundTrip", func(t *testing.T) { testContract(t, b) })
}

// recorder is a Handler that keeps what it was handed and can be told to
// fail, so the suite can check the ack contract.
type recorder struct {
	mu       sync.Mutex
	msgs     []codec.Message
	cps      []shard.Checkpoint
	failures int // remaining Handle calls to fail
	failed   int
	stored   map[string]int64
	got      chan struct{}
}

func newRecorder() *recorder {
	return &recorder{got: make(chan struct{}, 1), stored: map[string]int64{}}
}

var errInjected = errors.New("bridgetest: injected handler failure")

func (r *recorder) Handle(_ context.Context, b *bridge.Batch) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.failures != 0 {
		if r.failures > 0 {
			r.failures--
		}
		r.failed++
		return errInjected
	}
	for _, it := range b.Items {
		m := it.Msg
		m.Key = bytes.Clone(m.Key)
		m.Value = bytes.Clone(m.Value)
		r.msgs = append(r.msgs, m)
	}
	if len(b.Checkpoints) > 0 {
		r.cps = append(r.cps, b.Checkpoints[0]) // the position (bridge.Batch)
	}
	select {
	case r.got <- struct{}{}:
	default:
	}
	return nil
}

func (r *recorder) Checkpoint(key string) (int64, bool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	off, ok := r.stored[key]
	return off, ok, nil
}

func (r *recorder) snapshot() ([]codec.Message, []shard.Checkpoint, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.msgs), slices.Clone(r.cps), r.failed
}

// waitFor runs the source until cond holds on the recorder or the deadline
// passes; it then stops the source and waits for Run to return.
func runUntil(t testing.TB, src bridge.Source, r *recorder, cond func(msgs []codec.Message, failed int) bool) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx, r) }()
	deadline := time.NewTimer(30 * time.Second)
	defer deadline.Stop()
	poll := time.NewTicker(5 * time.Millisecond)
	defer poll.Stop()
	for {
		msgs, _, failed := r.snapshot()
		if cond(msgs, failed) {
			break
		}
		select {
		case err := <-done:
			cancel()
			t.Fatalf("source stopped early: %v", err)
		case <-deadline.C:
			cancel()
			<-done
			t.Fatalf("condition not met in 30s: %d messages, %d failed handles", len(msgs), failed)
		case <-r.got:
		case <-poll.C:
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("source Run: %v", err)
	}
	if err := src.Close(); err != nil {
		t.Fatalf("source Close: %v", err)
	}
}

func rules() *codec.Rules { return &codec.Rules{DLQ: "dlq", DefaultTarget: "t"} }

func publishN(t testing.TB, b Broker, source string, n int) []Msg {
	out := make([]Msg, n)
	for i := range out {
		out[i] = Msg{
			Key:   []byte("k" + strconv.Itoa(i)),
			Value: []byte("v" + strconv.Itoa(i)),
			Headers: []codec.Header{
				{Key: "delay-after", Value: []byte(strconv.Itoa(i) + "ms")},
				{Key: "x-multi", Value: []byte("a")},
				{Key: "x-multi", Value: []byte("b")},
			},
		}
		b.Publish(t, source, out[i])
	}
	return out
}

func testInOrder(t *testing.T, b Broker) {
	source := b.NewDelaySource(t)
	before := time.Now().Add(-time.Minute)
	sent := publishN(t, b, source, 20)
	r := newRecorder()
	runUntil(t, b.NewSource(t, source, "g-order", rules()), r, func(m []codec.Message, _ int) bool { return len(m) >= len(sent) })
	got, cps, _ := r.snapshot()
	if len(got) != len(sent) {
		t.Fatalf("handled %d messages, want %d", len(got), len(sent))
	}
	for i, m := range got {
		if m.Transport != b.Transport() || m.Source != source {
			t.Fatalf("message %d: transport/source = %v/%q, want %v/%q", i, m.Transport, m.Source, b.Transport(), source)
		}
		if !bytes.Equal(m.Value, sent[i].Value) {
			t.Fatalf("message %d: value %q, want %q (order broken?)", i, m.Value, sent[i].Value)
		}
		if i > 0 && m.Offset <= got[i-1].Offset {
			t.Fatalf("message %d: offset %d not after %d", i, m.Offset, got[i-1].Offset)
		}
		if m.Time.Before(before) || m.Time.After(time.Now().Add(time.Minute)) {
			t.Fatalf("message %d: broker time %v is not the publish time", i, m.Time)
		}
		var multi []string
		for _, h := range m.Headers {
			if h.Key == "x-multi" {
				multi = append(multi, string(h.Value))
			}
		}
		if !slices.Equal(multi, []string{"a", "b"}) {
			t.Fatalf("message %d: repeated header values %q, want [a b]", i, multi)
		}
	}
	if len(cps) == 0 {
		t.Fatal("no checkpoints handed over")
	}
	if last := cps[len(cps)-1]; last.Offset != got[len(got)-1].Offset {
		t.Fatalf("last checkpoint offset %d, want the last message's %d", last.Offset, got[len(got)-1].Offset)
	}
}

func testNoAckOnError(t *testing.T, b Broker) {
	source := b.NewDelaySource(t)
	sent := publishN(t, b, source, 5)
	// First run: every Handle fails; the source must retry, not skip.
	r1 := newRecorder()
	r1.failures = -1
	runUntil(t, b.NewSource(t, source, "g-noack", rules()), r1, func(_ []codec.Message, failed int) bool { return failed >= 2 })
	if msgs, _, _ := r1.snapshot(); len(msgs) != 0 {
		t.Fatalf("failing handler recorded %d messages", len(msgs))
	}
	// Second run, same group: nothing was acked, so everything comes again.
	r2 := newRecorder()
	r2.failures = 1 // one more failure first: the same batch must be retried
	runUntil(t, b.NewSource(t, source, "g-noack", rules()), r2, func(m []codec.Message, _ int) bool { return len(m) >= len(sent) })
	got, _, _ := r2.snapshot()
	if len(got) != len(sent) {
		t.Fatalf("after restart handled %d, want %d", len(got), len(sent))
	}
	for i := range got {
		if !bytes.Equal(got[i].Value, sent[i].Value) {
			t.Fatalf("message %d: %q, want %q", i, got[i].Value, sent[i].Value)
		}
	}
	// Third run, same group: all were acked after the successful Handle.
	b.Publish(t, source, Msg{Value: []byte("marker"), Headers: []codec.Header{{Key: "delay-after", Value: []byte("0")}}})
	r3 := newRecorder()
	runUntil(t, b.NewSource(t, source, "g-noack", rules()), r3, func(m []codec.Message, _ int) bool { return len(m) >= 1 })
	got3, _, _ := r3.snapshot()
	if len(got3) != 1 || string(got3[0].Value) != "marker" {
		t.Fatalf("after ack, a new member saw %d messages (first %q), want only the marker", len(got3), firstValue(got3))
	}
}

func firstValue(m []codec.Message) string {
	if len(m) == 0 {
		return ""
	}
	return string(m[0].Value)
}

func testCheckpointSkip(t *testing.T, b Broker) {
	source := b.NewDelaySource(t)
	sent := publishN(t, b, source, 6)
	// Learn the checkpoint key and offsets without acking anything.
	r1 := newRecorder()
	runUntil(t, b.NewSource(t, source, "g-probe", rules()), r1, func(m []codec.Message, _ int) bool { return len(m) >= len(sent) })
	msgs, cps, _ := r1.snapshot()
	if len(cps) == 0 {
		t.Fatal("no checkpoint key seen")
	}
	// A new group whose store already holds the first three messages (a
	// crash after the store commit, before the broker commit) must start
	// after them.
	r2 := newRecorder()
	r2.stored[cps[0].Key] = msgs[2].Offset
	runUntil(t, b.NewSource(t, source, "g-skip", rules()), r2, func(m []codec.Message, _ int) bool { return len(m) >= 3 })
	got, _, _ := r2.snapshot()
	if len(got) != 3 {
		t.Fatalf("handled %d messages, want the 3 after the checkpoint", len(got))
	}
	for i, m := range got {
		if m.Offset <= msgs[2].Offset || !bytes.Equal(m.Value, sent[3+i].Value) {
			t.Fatalf("message %d: offset %d value %q, want after offset %d value %q", i, m.Offset, m.Value, msgs[2].Offset, sent[3+i].Value)
		}
	}
}

func testSink(t *testing.T, b Broker) {
	target := b.NewTarget(t)
	sink := b.NewSink(t)
	var batch []*codec.Task
	for i := range 50 {
		batch = append(batch, &codec.Task{
			Kind:      codec.KindSchedule,
			ID:        "id-" + strconv.Itoa(i%7),
			Transport: b.Transport(),
			Target:    target,
			Key:       []byte("key-" + strconv.Itoa(i%7)),
			Value:     []byte("value-" + strconv.Itoa(i)),
			Headers: []codec.Header{
				{Key: "app", Value: []byte("x")},
				{Key: codec.HeaderID, Value: []byte("id-" + strconv.Itoa(i%7))},
				{Key: codec.HeaderOrigin, Value: []byte("test#" + strconv.Itoa(i))},
				{Key: codec.HeaderDue, Value: []byte(codec.FormatDue(int64(1_700_000_000_000 + i)))},
			},
		})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if errs := sink.Deliver(ctx, batch); errs != nil {
		for i, err := range errs {
			if err != nil {
				t.Fatalf("Deliver task %d: %v", i, err)
			}
		}
	}
	got := b.Consume(t, target, len(batch))
	// Order is kept per key (Kafka partitions by key; NATS keeps all).
	next := map[string]int{}
	for _, m := range got {
		i, err := strconv.Atoi(string(bytes.TrimPrefix(m.Value, []byte("value-"))))
		if err != nil || i < 0 || i >= len(batch) {
			t.Fatalf("unexpected value %q", m.Value)
		}
		want := batch[i]
		if b.Transport() == codec.TransportKafka && !bytes.Equal(m.Key, want.Key) {
			t.Fatalf("value %q: key %q, want %q", m.Value, m.Key, want.Key)
		}
		k := string(want.Key)
		if i < next[k] {
			t.Fatalf("key %s: value %d delivered after a later one", k, i)
		}
		next[k] = i + 1
		for _, h := range want.Headers {
			if v, ok := Header(m.Headers, h.Key); !ok || !bytes.Equal(v, h.Value) {
				t.Fatalf("value %q: header %s = %q (present %v), want %q", m.Value, h.Key, v, ok, h.Value)
			}
		}
	}
}

// Header returns the value of the first header named key.
func Header(hs []codec.Header, key string) ([]byte, bool) {
	for _, h := range hs {
		if h.Key == key {
			return h.Value, true
		}
	}
	return nil, false
}

// String helps failure messages.
func (m Msg) String() string {
	return fmt.Sprintf("key=%q value=%q headers=%d", m.Key, m.Value, len(m.Headers))
}

// Stored returns task as the engine holds it: through the store's
// envelope, encoded and decoded.
func Stored(t testing.TB, task codec.Task) *codec.Task {
	t.Helper()
	var tk codec.Task
	if err := codec.DecodeTask(codec.AppendTask(nil, &task), &tk); err != nil {
		t.Fatalf("envelope of %s: %v", task.Origin, err)
	}
	return &tk
}

// DeliverAll delivers tasks through sink within 30 s and fails the test
// if the broker refused any of them.
func DeliverAll(t testing.TB, sink shard.Sink, tasks []*codec.Task) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for i, err := range sink.Deliver(ctx, tasks) {
		if err != nil {
			t.Fatalf("deliver task %d (origin %s, %d value bytes): %v", i, tasks[i].Origin, len(tasks[i].Value), err)
		}
	}
}
