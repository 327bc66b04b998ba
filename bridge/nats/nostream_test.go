package nats

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/shard"
)

// parsed is what the pipeline makes of a message on the delay stream:
// hs are header key/value pairs.
func parsed(seq int64, dlq string, hs ...string) codec.Task {
	m := codec.Message{Transport: codec.TransportNATS, Source: "DELAY", Offset: seq, Value: []byte("payload"), Time: time.Now()}
	for i := 0; i+1 < len(hs); i += 2 {
		m.Headers = append(m.Headers, codec.Header{Key: hs[i], Value: []byte(hs[i+1])})
	}
	return codec.Parse(&m, &codec.Rules{DLQ: dlq})
}

// runEngine opens an engine with quick retries and runs its fire loop
// with sink until the end of the test.
func runEngine(t *testing.T, cfg Config, sink *Sink) *shard.Engine {
	t.Helper()
	eng, err := shard.Open(shard.Options{
		Dir: t.TempDir(), Shards: 1, Logger: cfg.Logger, Metrics: cfg.Metrics,
		Retry: shard.RetryPolicy{Initial: 10 * time.Millisecond, Max: 40 * time.Millisecond, Multiplier: 2, Jitter: -1, MaxAttempts: 3},
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- eng.Run(ctx, sink) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			t.Error("engine Run did not return")
		}
		_ = eng.Close()
	})
	return eng
}

func ingest(t *testing.T, eng *shard.Engine, tasks ...codec.Task) {
	t.Helper()
	if err := eng.Ingest(ctxT(t), tasks, nil); err != nil {
		t.Fatal(err)
	}
}

func streamMsgs(t *testing.T, st jetstream.Stream) uint64 {
	t.Helper()
	info, err := st.Info(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	return info.State.Msgs
}

// TestSinkNoStream: by default a subject that no stream captures is not
// delivered with core NATS: the publish fails with ErrNoTargetStream,
// naming the subject and the remedy, as the task's own failure (not an
// outage). That holds whether or not a core subscriber got the JetStream
// publish. With CoreTargets a target goes out with core NATS, a dead
// letter never.
func TestSinkNoStream(t *testing.T) {
	s := startServer(t, jsOptions(t))
	cfg := testConfig(t, serverURL(s))
	nc := connect(t, cfg)
	sink := newSink(t, nc, cfg)
	sink.probeWait = 100 * time.Millisecond
	best := cfg.Metrics.BestEffort.WithLabelValues("nats")

	subNC := connect(t, testConfig(t, serverURL(s)))
	sub, err := subNC.SubscribeSync("listened.>")
	if err != nil {
		t.Fatal(err)
	}
	if err := subNC.Flush(); err != nil {
		t.Fatal(err)
	}
	for _, subj := range []string{"plain.x", "listened.x"} {
		for try := range 2 { // the second from the cached finding
			errs := sink.Deliver(ctxT(t), []*codec.Task{task("a", subj, "v", 0)})
			if len(errs) != 1 || !errors.Is(errs[0], ErrNoTargetStream) || errors.Is(errs[0], shard.ErrUnavailable) {
				t.Fatalf("%s, try %d: errs = %v; want ErrNoTargetStream, not unavailable", subj, try, errs)
			}
			want := `no JetStream stream captures subject "` + subj + `"; create one or set nats.core_targets`
			if !strings.Contains(errs[0].Error(), want) {
				t.Fatalf("%s: error %q does not say %q", subj, errs[0], want)
			}
		}
	}
	if got := counterValue(t, best); got != 0 {
		t.Errorf("best effort = %v, want 0", got)
	}
	// The subscriber saw the first (JetStream) publish, nothing after it.
	if _, err := sub.NextMsg(time.Second); err != nil {
		t.Fatalf("subscriber: %v", err)
	}
	if m, err := sub.NextMsg(100 * time.Millisecond); err == nil {
		t.Fatalf("subscriber got a second message %v", m.Header)
	}

	// core_targets: the target goes out with core NATS, the dead letter
	// to the same subject does not.
	cfg.CoreTargets = true
	sink = newSink(t, nc, cfg)
	dl := task("dl", "plain.y", "v", 0)
	dl.Kind = codec.KindDeadLetter
	errs := sink.Deliver(ctxT(t), []*codec.Task{task("a", "plain.y", "v", 0), dl})
	if len(errs) != 2 || errs[0] != nil || !errors.Is(errs[1], ErrNoTargetStream) || errors.Is(errs[1], shard.ErrUnavailable) {
		t.Fatalf("errs = %v; want the target delivered, the dead letter ErrNoTargetStream", errs)
	}
	if !strings.Contains(errs[1].Error(), `no JetStream stream captures subject "plain.y"; create one (dead letters are never published with core NATS)`) {
		t.Errorf("dead letter error %q", errs[1])
	}
	if got := counterValue(t, best); got != 1 {
		t.Errorf("best effort = %v, want 1", got)
	}
}

// TestEngineTargetWithoutStream: with nats.core_targets off (the default)
// a task whose target subject no stream captures is not lost to a core
// NATS publish nobody hears: the engine retries it with backoff and, with
// the retry policy exhausted, dead-letters it as publish-failed to the
// source's DLQ subject, which has a stream.
func TestEngineTargetWithoutStream(t *testing.T) {
	s := startServer(t, jsOptions(t))
	cfg := testConfig(t, serverURL(s))
	nc := connect(t, cfg)
	dlq, err := newJS(t, nc).CreateStream(ctxT(t), jetstream.StreamConfig{Name: "DLQ", Subjects: []string{"dlq.>"}})
	if err != nil {
		t.Fatal(err)
	}
	eng := runEngine(t, cfg, newSink(t, nc, cfg))
	ingest(t, eng, parsed(1, "dlq.delay", "delay-after", "0", "delay-target", "plain.x", "delay-id", "order-1"))

	eventually(t, "the publish-failed dead letter in the DLQ stream", func() bool { return streamMsgs(t, dlq) == 1 })
	m, err := dlq.GetMsg(ctxT(t), 1)
	if err != nil {
		t.Fatal(err)
	}
	detail := m.Header.Get(codec.HeaderErrorDetail)
	if m.Subject != "dlq.delay" || string(m.Data) != "payload" || m.Header.Get(codec.HeaderError) != string(codec.CodePublishFailed) ||
		!strings.Contains(detail, "after 3 attempts") ||
		!strings.Contains(detail, `no JetStream stream captures subject "plain.x"; create one or set nats.core_targets`) {
		t.Fatalf("dead letter on %s: %q, headers %v", m.Subject, m.Data, m.Header)
	}
	eventually(t, "nothing pending", func() bool { return eng.Stats().Pending == 0 })
	if got := counterValue(t, cfg.Metrics.BestEffort.WithLabelValues("nats")); got != 0 {
		t.Errorf("best effort = %v, want 0", got)
	}
	if err := eng.Err(); err != nil {
		t.Errorf("engine: %v", err)
	}
}

// TestEngineDeadLetterWithoutStream: a dead letter whose DLQ subject no
// stream captures never goes out with core NATS, whatever
// nats.core_targets says: the engine keeps it, retries it and reports why
// (not-ready) until a stream captures the subject, then delivers it.
func TestEngineDeadLetterWithoutStream(t *testing.T) {
	for _, core := range []bool{false, true} {
		name := "core_targets off"
		if core {
			name = "core_targets on"
		}
		t.Run(name, func(t *testing.T) {
			s := startServer(t, jsOptions(t))
			cfg := testConfig(t, serverURL(s))
			cfg.CoreTargets = core
			cfg.NoStreamTTL = 50 * time.Millisecond // JetStream is tried again soon
			nc := connect(t, cfg)
			eng := runEngine(t, cfg, newSink(t, nc, cfg))
			ingest(t, eng, parsed(1, "dlq.delay", "delay-target", "plain.x")) // no due: missing-due

			eventually(t, "the engine reporting the failing dead letter", func() bool {
				return errors.Is(eng.Err(), ErrNoTargetStream)
			})
			time.Sleep(300 * time.Millisecond) // several retries, and JetStream tried again
			if p := eng.Stats().Pending; p != 1 {
				t.Fatalf("pending = %d, want the dead letter kept", p)
			}
			if got := counterValue(t, cfg.Metrics.BestEffort.WithLabelValues("nats")); got != 0 {
				t.Fatalf("best effort = %v, want 0", got)
			}

			dlq, err := newJS(t, nc).CreateStream(ctxT(t), jetstream.StreamConfig{Name: "DLQ", Subjects: []string{"dlq.>"}})
			if err != nil {
				t.Fatal(err)
			}
			eventually(t, "the dead letter in the new DLQ stream", func() bool { return streamMsgs(t, dlq) == 1 })
			m, err := dlq.GetMsg(ctxT(t), 1)
			if err != nil {
				t.Fatal(err)
			}
			if m.Header.Get(codec.HeaderError) != string(codec.CodeMissingDue) || string(m.Data) != "payload" {
				t.Fatalf("dead letter %q, headers %v", m.Data, m.Header)
			}
			eventually(t, "nothing pending and ready again", func() bool { return eng.Stats().Pending == 0 && eng.Err() == nil })
		})
	}
}
