package bridge

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/clock"
	"github.com/delaybridge/delaybridge/shard"
)

func openEngine(t *testing.T, clk clock.Clock) *shard.Engine {
	t.Helper()
	eng, err := shard.Open(shard.Options{Dir: t.TempDir(), Shards: 2, Clock: clk})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = eng.Close() })
	return eng
}

func TestPipelineHandle(t *testing.T) {
	now := time.Date(2026, 11, 22, 12, 0, 0, 0, time.UTC)
	rules := &codec.Rules{DLQ: "delay.dlq"}
	msg := func(off int64, key string, hs ...string) Item {
		m := codec.Message{Transport: codec.TransportKafka, Source: "delay", Offset: off, Key: []byte(key), Value: []byte("v"), Time: now}
		for i := 0; i+1 < len(hs); i += 2 {
			m.Headers = append(m.Headers, codec.Header{Key: hs[i], Value: []byte(hs[i+1])})
		}
		return Item{Msg: m, Rules: rules}
	}
	tests := []struct {
		name        string
		items       []Item
		wantPending int64
		wantDLQLogs []string // codes logged, in order
		wantErr     bool
	}{
		{"schedules", []Item{msg(0, "a", "delay-after", "1m", "delay-target", "t"), msg(1, "b", "delay-after", "2m", "delay-target", "t")}, 2, nil, false},
		{"replace by key", []Item{msg(0, "a", "delay-after", "1m", "delay-target", "t"), msg(1, "a", "delay-after", "2m", "delay-target", "t")}, 1, nil, false},
		{"cancel in the same batch", []Item{msg(0, "a", "delay-after", "1m", "delay-target", "t"), msg(1, "a", "delay-cancel", "true")}, 0, nil, false},
		{"bad input is a dead letter in the same commit", []Item{msg(0, "a", "delay-target", "t"), msg(1, "b", "delay-after", "x", "delay-target", "t")}, 2,
			[]string{"missing-due", "bad-due"}, false},
		{"message without rules is refused whole", []Item{msg(0, "a", "delay-after", "1m", "delay-target", "t"), {Msg: codec.Message{Source: "delay"}}}, 0, nil, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			eng := openEngine(t, clock.NewFake(now))
			core, logs := observer.New(zap.WarnLevel)
			p := NewPipeline(eng, zap.New(core))
			p.stopGrace = 0
			ctx := context.Background()
			if tc.wantDLQLogs != nil {
				// The engine does not run, so no DLQ acknowledges the
				// dead letters: Handle waits until ctx ends, with them
				// durable (TestPipelineWaitsForDLQ runs the engine).
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, 50*time.Millisecond)
				defer cancel()
			}
			err := p.Handle(ctx, &Batch{Items: tc.items, Checkpoints: []shard.Checkpoint{{Key: "kafka|delay|0", Offset: 41}}})
			if tc.wantDLQLogs != nil {
				if err == nil || !strings.Contains(err.Error(), "not yet acknowledged by their DLQ") {
					t.Fatalf("Handle error = %v, want the wait for the DLQ to end with ctx", err)
				}
			} else if (err != nil) != tc.wantErr {
				t.Fatalf("Handle error = %v, want error %v", err, tc.wantErr)
			}
			if got := eng.Stats().Pending; got != tc.wantPending {
				t.Errorf("pending = %d, want %d", got, tc.wantPending)
			}
			var codes []string
			for _, e := range logs.All() {
				codes = append(codes, e.ContextMap()["code"].(string))
			}
			if !slices.Equal(codes, tc.wantDLQLogs) {
				t.Errorf("dead-letter log codes %v, want %v", codes, tc.wantDLQLogs)
			}
			off, ok, err := p.Checkpoint("kafka|delay|0")
			if err != nil {
				t.Fatal(err)
			}
			if stored := ok && off == 41; stored == tc.wantErr {
				t.Errorf("checkpoint stored = %v (offset %d), want %v: it must be in the same commit as the batch", stored, off, !tc.wantErr)
			}
		})
	}
}

// TestPipelineWarnsMisspelledHeader: a message taken in with a header
// that looks like a control header but is not one (delay_id: the task
// gets its key as id instead) is warned of, once per source and header
// name within 30 s, naming the control header; a dead letter's detail
// names it already, and correct headers are not warned of.
func TestPipelineWarnsMisspelledHeader(t *testing.T) {
	now := time.Date(2026, 11, 22, 12, 0, 0, 0, time.UTC)
	rules := &codec.Rules{DLQ: "delay.dlq"}
	msg := func(off int64, hs ...string) Item {
		m := codec.Message{Transport: codec.TransportKafka, Source: "delay", Offset: off, Key: []byte(fmt.Sprint("k", off)), Value: []byte("v"), Time: now}
		for i := 0; i+1 < len(hs); i += 2 {
			m.Headers = append(m.Headers, codec.Header{Key: hs[i], Value: []byte(hs[i+1])})
		}
		return Item{Msg: m, Rules: rules}
	}
	eng := openEngine(t, clock.NewFake(now))
	core, logs := observer.New(zap.WarnLevel)
	p := NewPipeline(eng, zap.New(core))
	items := []Item{
		msg(0, "delay-after", "1m", "delay-target", "t", "delay_id", "order-1"),
		msg(1, "delay-after", "1m", "delay-target", "t", "delay_id", "order-2"), // same source and name: held back
		msg(2, "delay-after", "1m", "delay-target", "t", "X-Delay-Key", "k"),
		msg(3, "delay-after", "1m", "delay-target", "t", "Delay-Id", "order-3", "trace-id", "x"),
	}
	if err := p.Handle(context.Background(), &Batch{Items: items}); err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range logs.FilterMessageSnippet("looks like a control header").All() {
		got = append(got, e.ContextMap()["header"].(string)+">"+e.ContextMap()["control_header"].(string)+" "+e.ContextMap()["task_id"].(string))
	}
	if want := []string{"delay_id>delay-id k0", "X-Delay-Key>delay-key k2"}; !slices.Equal(got, want) {
		t.Fatalf("warned %q, want %q", got, want)
	}
	if n := logs.FilterMessageSnippet("dead-lettered").Len(); n != 0 {
		t.Fatalf("%d dead letters, want none", n)
	}
}

// sinkFunc is an in-memory shard.Sink for routing tests.
type sinkFunc func(ctx context.Context, batch []*codec.Task) []error

func (f sinkFunc) Deliver(ctx context.Context, batch []*codec.Task) []error { return f(ctx, batch) }

func TestSinksRouting(t *testing.T) {
	errDown := errors.New("down")
	var gotKafka, gotNATS []string
	kafka := sinkFunc(func(_ context.Context, b []*codec.Task) []error {
		errs := make([]error, len(b))
		for i, t := range b {
			gotKafka = append(gotKafka, t.Target)
			if t.Target == "fail" {
				errs[i] = errDown
			}
		}
		return errs
	})
	nats := sinkFunc(func(_ context.Context, b []*codec.Task) []error {
		for _, t := range b {
			gotNATS = append(gotNATS, t.Target)
		}
		return nil
	})
	task := func(tr codec.Transport, target string) *codec.Task { return &codec.Task{Transport: tr, Target: target} }
	batch := []*codec.Task{
		task(codec.TransportKafka, "k1"), task(codec.TransportNATS, "n1"), task(codec.TransportKafka, "fail"),
		task(codec.TransportNATS, "n2"), task(codec.TransportKafka, "k2"),
	}
	tests := []struct {
		name      string
		sinks     Sinks
		wantErrAt map[int]error
		wantKafka []string
		wantNATS  []string
	}{
		{"both transports", Sinks{Kafka: kafka, NATS: nats}, map[int]error{2: errDown}, []string{"k1", "fail", "k2"}, []string{"n1", "n2"}},
		{"no NATS publisher", Sinks{Kafka: kafka}, map[int]error{1: ErrNoTransport, 2: errDown, 3: ErrNoTransport}, []string{"k1", "fail", "k2"}, nil},
		// The transport is missing, not the broker down: still an outage
		// to the engine, no attempt charged.
		{"no NATS publisher is an outage", Sinks{Kafka: kafka}, map[int]error{1: shard.ErrUnavailable, 2: errDown, 3: shard.ErrUnavailable}, []string{"k1", "fail", "k2"}, nil},
		{"check refuses one", Sinks{Kafka: kafka, NATS: nats, Check: refuse("n1", "k2")}, map[int]error{1: errRevoked, 2: errDown, 4: errRevoked}, []string{"k1", "fail"}, []string{"n2"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			gotKafka, gotNATS = nil, nil
			errs := tc.sinks.Deliver(context.Background(), batch)
			for i := range batch {
				var err error
				if errs != nil {
					err = errs[i]
				}
				if want := tc.wantErrAt[i]; !errors.Is(err, want) || (want == nil) != (err == nil) {
					t.Errorf("task %d: error %v, want %v", i, err, want)
				}
			}
			if !slices.Equal(gotKafka, tc.wantKafka) || !slices.Equal(gotNATS, tc.wantNATS) {
				t.Errorf("routed kafka %v nats %v, want %v %v (order kept per transport)", gotKafka, gotNATS, tc.wantKafka, tc.wantNATS)
			}
		})
	}
}

var errRevoked = errors.New("revoked")

// refuse is a Sinks.Check refusing the targets named.
func refuse(targets ...string) func(*codec.Task) error {
	return func(t *codec.Task) error {
		if slices.Contains(targets, t.Target) {
			return errRevoked
		}
		return nil
	}
}

// A dead letter is not checked: its DLQ is the operator's, not a
// publisher's choice.
func TestSinksCheckSkipsDeadLetters(t *testing.T) {
	var got []string
	kafka := sinkFunc(func(_ context.Context, b []*codec.Task) []error {
		for _, t := range b {
			got = append(got, t.Target)
		}
		return nil
	})
	s := Sinks{Kafka: kafka, Check: refuse("dlq", "out")}
	errs := s.Deliver(context.Background(), []*codec.Task{
		{Kind: codec.KindDeadLetter, Transport: codec.TransportKafka, Target: "dlq"},
		{Kind: codec.KindSchedule, Transport: codec.TransportKafka, Target: "out"},
	})
	if len(errs) != 2 || errs[0] != nil || !errors.Is(errs[1], errRevoked) || !slices.Equal(got, []string{"dlq"}) {
		t.Fatalf("errs %v, published %v: want the dead letter published and the task refused", errs, got)
	}
}

// The fingerprint a source puts on its checkpoint is stored in the batch's
// commit and read back with LoadCheckpoint; a checkpoint without one (NATS,
// or an older version's) reads back with 0.
func TestPipelineLoadCheckpoint(t *testing.T) {
	eng := openEngine(t, clock.NewFake(time.Now()))
	p := NewPipeline(eng, nil)
	var _ CheckpointLoader = p
	if err := p.Handle(context.Background(), &Batch{Checkpoints: []shard.Checkpoint{
		{Key: "kafka|delay|0", Offset: 41, Fingerprint: 0xfeed},
		{Key: "nats|DELAY|c", Offset: 7},
	}}); err != nil {
		t.Fatal(err)
	}
	for _, want := range []shard.Checkpoint{{Key: "kafka|delay|0", Offset: 41, Fingerprint: 0xfeed}, {Key: "nats|DELAY|c", Offset: 7}} {
		got, ok, err := p.LoadCheckpoint(want.Key)
		if err != nil || !ok || got != want {
			t.Fatalf("LoadCheckpoint(%s) = %+v, %v, %v; want %+v", want.Key, got, ok, err, want)
		}
		if off, ok, err := p.Checkpoint(want.Key); err != nil || !ok || off != want.Offset {
			t.Fatalf("Checkpoint(%s) = %d, %v, %v", want.Key, off, ok, err)
		}
	}
}

// dlqSink fails every delivery until ok is closed, then acknowledges them;
// it records what it acknowledged.
type dlqSink struct {
	ok    chan struct{}
	tries chan struct{} // one value per failed delivery
	mu    sync.Mutex
	acked []string
}

func (s *dlqSink) Deliver(_ context.Context, batch []*codec.Task) []error {
	errs := make([]error, len(batch))
	select {
	case <-s.ok:
		s.mu.Lock()
		for _, t := range batch {
			s.acked = append(s.acked, string(t.Code))
		}
		s.mu.Unlock()
		return nil
	default:
	}
	for i := range errs {
		errs[i] = errors.New("dlq down")
	}
	select {
	case s.tries <- struct{}{}:
	default:
	}
	return errs
}

// runDLQEngine runs a 2-shard engine on a fake clock (retries a second
// apart) against a dlqSink, until the test ends.
func runDLQEngine(t *testing.T) (*clock.Fake, *shard.Engine, *dlqSink) {
	t.Helper()
	clk := clock.NewFake(time.Date(2026, 11, 22, 12, 0, 0, 0, time.UTC))
	eng, err := shard.Open(shard.Options{Dir: t.TempDir(), Shards: 2, Clock: clk,
		Retry: shard.RetryPolicy{Initial: time.Second, Max: time.Second, Jitter: -1}})
	if err != nil {
		t.Fatal(err)
	}
	sink := &dlqSink{ok: make(chan struct{}), tries: make(chan struct{}, 1)}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- eng.Run(ctx, sink) }()
	t.Cleanup(func() {
		cancel()
		<-ran
		_ = eng.Close()
	})
	return clk, eng, sink
}

// CONTRACT §3: Handle, and so the source's commit, waits until the DLQ
// acknowledged the batch's dead letters; while the DLQ fails, it waits. A
// source stopping meanwhile (its ctx cancelled) still gets the commit if
// the DLQ takes them within the stop grace.
func TestPipelineWaitsForDLQ(t *testing.T) {
	clk, eng, sink := runDLQEngine(t)
	p := NewPipeline(eng, nil)
	p.stopGrace = time.Hour
	rules := &codec.Rules{DLQ: "delay.dlq"}
	bad := Item{Msg: codec.Message{Transport: codec.TransportKafka, Source: "delay", Offset: 7, Value: []byte("v"), Time: clk.Now(),
		Headers: []codec.Header{{Key: "delay-after", Value: []byte("soon")}, {Key: "delay-target", Value: []byte("t")}}}, Rules: rules}
	handled := make(chan error, 1)
	hctx, stopSource := context.WithCancel(context.Background())
	defer stopSource()
	go func() {
		handled <- p.Handle(hctx, &Batch{Items: []Item{bad}, Checkpoints: []shard.Checkpoint{{Key: "kafka|delay|0", Offset: 7}}})
	}()
	// Two failed deliveries (the second after the retry's backoff) and
	// Handle has not returned. The clock moves a second at a time until the
	// next try: the sink signals a try before it returns the failure, so
	// one move right after the signal may come before the engine scheduled
	// the retry (for a second after the moved clock), and an armed timer
	// says nothing here (the idle shards' park timers are fake timers too).
	deadline := time.After(30 * time.Second)
	for range 2 {
	wait:
		for {
			select {
			case <-sink.tries:
				break wait
			case err := <-handled:
				t.Fatalf("Handle returned %v while the DLQ failed", err)
			case <-deadline:
				t.Fatal("no delivery of the dead letter")
			case <-time.After(10 * time.Millisecond):
				clk.Advance(time.Second)
			}
		}
	}
	select {
	case err := <-handled:
		t.Fatalf("Handle returned %v while the DLQ failed", err)
	default:
	}
	stopSource() // the source stops; the DLQ recovers within the grace
	close(sink.ok)
	for {
		select {
		case err := <-handled:
			if err != nil {
				t.Fatalf("Handle = %v after the DLQ took the dead letter", err)
			}
			sink.mu.Lock()
			defer sink.mu.Unlock()
			if !slices.Equal(sink.acked, []string{"bad-due"}) {
				t.Fatalf("DLQ acknowledged %v, want [bad-due]", sink.acked)
			}
			return
		case <-time.After(10 * time.Millisecond):
			clk.Advance(time.Second) // the retry after the last failure
		}
	}
}

// TestPipelineMisspelledForgottenCounted (review R210): the throttle of
// the misspelled-header line remembers 64 source and header names; past
// them, names not logged within 30 s are forgotten, and with AllowEach
// their held-back lines went with them. The next line counts them in
// held_back_forgotten.
func TestPipelineMisspelledForgottenCounted(t *testing.T) {
	core, logs := observer.New(zap.WarnLevel)
	p := NewPipeline(nil, zap.New(core))
	now := time.Date(2026, 11, 28, 12, 0, 0, 0, time.UTC)
	p.now = func() time.Time { return now }
	for i := range 64 {
		src := fmt.Sprint("delay", i)
		p.warnMisspelled(&codec.Task{Source: src, ID: "a"}, "delay_id", "delay-id")
		p.warnMisspelled(&codec.Task{Source: src, ID: "b"}, "delay_id", "delay-id") // held back
	}
	now = now.Add(31 * time.Second)
	p.warnMisspelled(&codec.Task{Source: "other", ID: "c"}, "delay_id", "delay-id")
	lines := logs.FilterMessageSnippet("looks like a control header").All()
	if len(lines) != 65 {
		t.Fatalf("%d lines, want 65 (one per source)", len(lines))
	}
	m := lines[64].ContextMap()
	if m["held_back_forgotten"] != int64(64) || m["held_back"] != int64(0) {
		t.Fatalf("the new source's line: held_back %v, held_back_forgotten %v, want 0 and 64", m["held_back"], m["held_back_forgotten"])
	}
}
