package nats

import (
	"bytes"
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/shard"
)

func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

func task(id, target, value string, due int64, hs ...codec.Header) *codec.Task {
	return &codec.Task{
		Kind: codec.KindSchedule, ID: id, Source: "DELAY", Origin: "nats:DELAY#1", Due: due,
		Transport: codec.TransportNATS, Target: target, Value: []byte(value), Headers: hs,
		DLQTransport: codec.TransportNATS, DLQ: "dlq.delay",
	}
}

func hdr(k, v string) codec.Header { return codec.Header{Key: k, Value: []byte(v)} }

func newSink(t *testing.T, nc *natsgo.Conn, cfg Config) *Sink {
	t.Helper()
	s, err := NewSink(nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// outServer starts a JetStream server holding the stream OUT (out.>) and
// connects to it.
func outServer(t *testing.T, subjects ...string) (Config, *natsgo.Conn, jetstream.Stream) {
	t.Helper()
	if len(subjects) == 0 {
		subjects = []string{"out.>"}
	}
	s := startServer(t, jsOptions(t))
	cfg := testConfig(t, serverURL(s))
	nc := connect(t, cfg)
	stream, err := newJS(t, nc).CreateStream(ctxT(t), jetstream.StreamConfig{Name: "OUT", Subjects: subjects})
	if err != nil {
		t.Fatal(err)
	}
	return cfg, nc, stream
}

// TestSinkDeliverTraceOnly: a Kafka record's Nats-Trace-Only header (with a
// Nats-Trace-Dest) is not forwarded, else the server traces the delivery,
// stores nothing and sends no PubAck, and the task waits as if JetStream
// were down, forever.
func TestSinkDeliverTraceOnly(t *testing.T) {
	cfg, nc, stream := outServer(t)
	tk := task("id-1", "out.orders", "v", 1795359845123, hdr("Nats-Trace-Dest", "trace.events"), hdr("Nats-Trace-Only", "true"))
	tk.Source, tk.DLQTransport = "delay", codec.TransportKafka
	if errs := newSink(t, nc, cfg).Deliver(ctxT(t), []*codec.Task{tk}); errs != nil {
		t.Fatalf("deliver: %v", errors.Join(errs...))
	}
	info, err := stream.Info(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 1 {
		t.Fatalf("target stream holds %d messages, want 1", info.State.Msgs)
	}
}

// TestSinkDeliver: every task is stored by the target stream when Deliver
// returns (it waited for the PubAcks), headers keep repeated keys, and a
// second delivery of the same firing is dropped as a duplicate.
func TestSinkDeliver(t *testing.T) {
	cfg, nc, stream := outServer(t)
	cfg.PublishWindow = 16 // several windows per batch
	sink := newSink(t, nc, cfg)
	if sink.Health() != nil {
		t.Fatalf("health = %v", sink.Health())
	}

	const n = 500
	batch := make([]*codec.Task, n)
	for i := range batch {
		batch[i] = task(fmt.Sprintf("id-%d", i), "out.orders", fmt.Sprint(i), 1795359845123,
			hdr("x-multi", "a"), hdr("delay-id", fmt.Sprintf("id-%d", i)), hdr("x-multi", "b"),
			hdr("delay-due", "2026-11-22T15:04:05.123Z"),
			hdr("Nats-Msg-Id", "source-id"), hdr("Nats-Expected-Last-Sequence", "99"))
	}
	if errs := sink.Deliver(ctxT(t), batch); errs != nil {
		t.Fatalf("deliver: %v", errors.Join(errs...))
	}
	// No polling: Deliver returned after the PubAcks, so the stream has them.
	info, err := stream.Info(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != n {
		t.Fatalf("stream holds %d messages, want %d", info.State.Msgs, n)
	}
	m, err := stream.GetMsg(ctxT(t), 1)
	if err != nil {
		t.Fatal(err)
	}
	if string(m.Data) != "0" {
		t.Errorf("data = %q", m.Data)
	}
	if got := m.Header.Values("x-multi"); !reflect.DeepEqual(got, []string{"a", "b"}) {
		t.Errorf("x-multi = %v", got)
	}
	if got := m.Header.Get("Nats-Msg-Id"); got != "nats:DELAY|id-0|2026-11-22T15:04:05.123Z" {
		t.Errorf("Nats-Msg-Id = %q", got)
	}
	if m.Header.Get("Nats-Expected-Last-Sequence") != "" {
		t.Error("publish directive forwarded")
	}

	// A crash before the store deleted the tasks: the same firings again.
	if errs := sink.Deliver(ctxT(t), batch[:10]); errs != nil {
		t.Fatalf("redeliver: %v", errors.Join(errs...))
	}
	info, _ = stream.Info(ctxT(t))
	if info.State.Msgs != n {
		t.Errorf("duplicates stored: %d messages", info.State.Msgs)
	}
}

// TestSinkPerTaskErrors: one refused or misdirected task fails alone.
func TestSinkPerTaskErrors(t *testing.T) {
	s := startServer(t, jsOptions(t))
	cfg := testConfig(t, serverURL(s))
	nc := connect(t, cfg)
	js := newJS(t, nc)
	if _, err := js.CreateStream(ctxT(t), jetstream.StreamConfig{Name: "SMALL", Subjects: []string{"small.>"}, MaxMsgSize: 512}); err != nil {
		t.Fatal(err)
	}
	sink := newSink(t, nc, cfg)
	kafka := task("k", "topic", "v", 0)
	kafka.Transport = codec.TransportKafka
	batch := []*codec.Task{
		task("a", "small.x", "ok", 0),
		task("b", "small.x", string(bytes.Repeat([]byte("x"), 4096)), 0),
		kafka,
		task("c", "small.x", "ok", 0),
	}
	errs := sink.Deliver(ctxT(t), batch)
	if len(errs) != 4 || errs[0] != nil || errs[1] == nil || !errors.Is(errs[2], ErrWrongTransport) || errs[3] != nil {
		t.Fatalf("errs = %v", errs)
	}
	// A stream's refusal and a wrong transport are the task's own
	// failures, not an outage: the engine charges them an attempt.
	for _, i := range []int{1, 2} {
		if errors.Is(errs[i], shard.ErrUnavailable) {
			t.Fatalf("errs[%d] = %v, marked unavailable", i, errs[i])
		}
	}
}

// TestSinkCoreFallback: with CoreTargets (nats.core_targets) a subject
// without a stream is delivered with core NATS (a subscriber gets it,
// BestEffort counts it): the JetStream publish gets no PubAck (the
// subscriber does not answer) and the server confirms that no stream
// captures the subject. The finding is cached and re-checked after
// NoStreamTTL.
func TestSinkCoreFallback(t *testing.T) {
	s := startServer(t, jsOptions(t))
	cfg := testConfig(t, serverURL(s))
	cfg.CoreTargets = true
	nc := connect(t, cfg)
	js := newJS(t, nc)
	sink := newSink(t, nc, cfg)
	now := time.Unix(1000, 0)
	sink.now = func() time.Time { return now }
	sink.probeWait = 100 * time.Millisecond // no PubAck is coming

	subNC := connect(t, testConfig(t, serverURL(s)))
	sub, err := subNC.SubscribeSync("plain.>")
	if err != nil {
		t.Fatal(err)
	}
	if err := subNC.Flush(); err != nil {
		t.Fatal(err)
	}
	best := cfg.Metrics.BestEffort.WithLabelValues("nats")

	if errs := sink.Deliver(ctxT(t), []*codec.Task{task("a", "plain.x", "v1", 0, hdr("x-h", "1"), hdr("x-h", "2"))}); errs != nil {
		t.Fatalf("deliver: %v", errs)
	}
	m, err := sub.NextMsg(10 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if string(m.Data) != "v1" || !reflect.DeepEqual(m.Header.Values("x-h"), []string{"1", "2"}) || m.Header.Get("Nats-Msg-Id") == "" {
		t.Errorf("core message = %q %v", m.Data, m.Header)
	}
	if got := counterValue(t, best); got != 1 {
		t.Errorf("best effort = %v, want 1", got)
	}

	// Cached: goes to core NATS directly. A stream created meanwhile still
	// captures core publishes, only without an acknowledgement.
	stream, err := js.CreateStream(ctxT(t), jetstream.StreamConfig{Name: "PLAIN", Subjects: []string{"plain.>"}})
	if err != nil {
		t.Fatal(err)
	}
	if errs := sink.Deliver(ctxT(t), []*codec.Task{task("b", "plain.x", "v2", 0)}); errs != nil {
		t.Fatalf("deliver: %v", errs)
	}
	if got := counterValue(t, best); got != 2 {
		t.Errorf("best effort = %v, want 2", got)
	}

	// After the TTL JetStream is tried again and acknowledges.
	now = now.Add(sink.cfg.NoStreamTTL + time.Second)
	if errs := sink.Deliver(ctxT(t), []*codec.Task{task("c", "plain.x", "v3", 0)}); errs != nil {
		t.Fatalf("deliver: %v", errs)
	}
	if got := counterValue(t, best); got != 2 {
		t.Errorf("best effort = %v after the stream appeared, want 2", got)
	}
	eventually(t, "v2 and v3 in the stream", func() bool {
		info, err := stream.Info(ctxT(t))
		return err == nil && info.State.Msgs == 2
	})
}

// TestSinkDisconnected: while the connection is down every task fails at
// once (the engine retries with backoff) and Health says why.
func TestSinkDisconnected(t *testing.T) {
	opts := jsOptions(t)
	s := startServer(t, opts)
	cfg := testConfig(t, serverURL(s))
	nc := connect(t, cfg)
	sink := newSink(t, nc, cfg)
	s.Shutdown()
	s.WaitForShutdown()
	eventually(t, "unhealthy", func() bool { return sink.Health() != nil })
	if !errors.Is(sink.Health(), ErrDisconnected) {
		t.Errorf("health = %v", sink.Health())
	}
	errs := sink.Deliver(ctxT(t), []*codec.Task{task("a", "out.x", "v", 0)})
	if len(errs) != 1 || !errors.Is(errs[0], ErrDisconnected) || !errors.Is(errs[0], shard.ErrUnavailable) {
		t.Errorf("errs = %v, want ErrDisconnected and shard.ErrUnavailable", errs)
	}
}

func TestSinkUnavailable(t *testing.T) {
	for _, c := range []struct {
		name string
		err  error
		want bool
	}{
		{"disconnected", ErrDisconnected, true},
		{"no PubAck in time", ErrPublishTimeout, true},
		{"connection closed", natsgo.ErrConnectionClosed, true},
		{"reconnecting", natsgo.ErrConnectionReconnecting, true},
		{"no responders for a stream subject", jetstream.ErrNoStreamResponse, true},
		{"jetstream 503", &jetstream.APIError{Code: 503, Description: "JetStream system temporarily unavailable"}, true},
		{"draining", natsgo.ErrConnectionDraining, true},
		{"nats.go disconnected", natsgo.ErrDisconnected, true},
		{"library PubAck timeout", jetstream.ErrAsyncPublishTimeout, true},
		{"jetstream cluster unavailable", &jetstream.APIError{Code: 503, ErrorCode: 10008, Description: "JetStream system temporarily unavailable"}, true},
		{"store closed (stream restarting)", &jetstream.APIError{Code: 503, ErrorCode: 10077, Description: "store is closed"}, true},
		// The previous publish of this Nats-Msg-Id is still proposed (a
		// leader without its quorum): it may yet be stored.
		{"duplicate message id in process", &jetstream.APIError{Code: 409, ErrorCode: 10158, Description: "duplicate message id is in process"}, true},
		// The server answers these refusals with 503 as well.
		{"stream full (DiscardNew)", &jetstream.APIError{Code: 503, ErrorCode: 10077, Description: "maximum messages exceeded"}, false},
		{"stream bytes full", &jetstream.APIError{Code: 503, ErrorCode: 10077, Description: "maximum bytes exceeded"}, false},
		{"subject full", &jetstream.APIError{Code: 503, ErrorCode: 10077, Description: "maximum messages per subject exceeded"}, false},
		{"expected sequence", &jetstream.APIError{Code: 503, ErrorCode: 10063, Description: "expected stream sequence does not match"}, false},
		{"account storage limit", &jetstream.APIError{Code: 503, ErrorCode: 10023, Description: "insufficient resources"}, false},
		{"wrong last sequence", &jetstream.APIError{Code: 400, ErrorCode: 10071, Description: "wrong last sequence: 3"}, false},
		{"message too large", &jetstream.APIError{Code: 400, ErrorCode: 10054, Description: "message size exceeds maximum allowed"}, false},
		{"header block over 64 KiB", &jetstream.APIError{Code: 400, ErrorCode: 10097, Description: "header size exceeds maximum allowed of 64k"}, false},
		{"wrong transport", ErrWrongTransport, false},
		{"bad header", natsgo.ErrBadHeaderMsg, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := unavailable(fmt.Errorf("nats sink: publish to %q: %w", "out.x", c.err)); got != c.want {
				t.Fatalf("unavailable(%v) = %v, want %v", c.err, got, c.want)
			}
		})
	}
}

// TestSinkRefused: a publish failure is a refusal of the message itself
// (shard.ErrRefused: its subject will never take it as is, so a dead
// letter its DLQ refuses so may be parked) only when it is too large: the
// server's max_payload, the stream's max_msg_size, the file store's limit.
// A full stream, an account out of resources, an outage are not: a dead
// letter to such a DLQ holds its source.
func TestSinkRefused(t *testing.T) {
	for _, c := range []struct {
		name string
		err  error
		want bool
	}{
		{"over max_payload", natsgo.ErrMaxPayload, true},
		{"over max_msg_size", &jetstream.APIError{Code: 400, ErrorCode: 10054, Description: "message size exceeds maximum allowed"}, true},
		{"over the file store's limit", &jetstream.APIError{Code: 503, ErrorCode: 10077, Description: "message too large"}, true},
		{"header block over 64 KiB", &jetstream.APIError{Code: 400, ErrorCode: 10097, Description: "header size exceeds maximum allowed of 64k"}, true},
		{"stream full (DiscardNew)", &jetstream.APIError{Code: 503, ErrorCode: 10077, Description: "maximum messages exceeded"}, false},
		{"stream bytes full", &jetstream.APIError{Code: 503, ErrorCode: 10077, Description: "maximum bytes exceeded"}, false},
		{"subject full", &jetstream.APIError{Code: 503, ErrorCode: 10077, Description: "maximum messages per subject exceeded"}, false},
		{"account storage limit", &jetstream.APIError{Code: 503, ErrorCode: 10023, Description: "insufficient resources"}, false},
		{"store closed", &jetstream.APIError{Code: 503, ErrorCode: 10077, Description: "store is closed"}, false},
		{"no stream for the subject", ErrNoTargetStream, false},
		{"no PubAck in time", ErrPublishTimeout, false},
		{"disconnected", ErrDisconnected, false},
		{"wrong transport", ErrWrongTransport, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := refused(fmt.Errorf("nats sink: publish to %q: %w", "dlq.x", c.err)); got != c.want {
				t.Fatalf("refused(%v) = %v, want %v", c.err, got, c.want)
			}
		})
	}
}

// TestSinkRefusalsDelivered: through a server, a dead letter over its
// stream's max_msg_size or the server's max_payload fails with
// shard.ErrRefused; one to a full stream (DiscardNew) or to a subject no
// stream captures fails with neither ErrRefused nor ErrUnavailable: the
// engine holds its source until the operator fixes the stream.
func TestSinkRefusalsDelivered(t *testing.T) {
	opts := jsOptions(t)
	opts.MaxPayload = 8 << 10
	s := startServer(t, opts)
	cfg := testConfig(t, serverURL(s))
	nc := connect(t, cfg)
	js := newJS(t, nc)
	for _, sc := range []jetstream.StreamConfig{
		{Name: "SMALL", Subjects: []string{"dlq.small"}, MaxMsgSize: 512},
		{Name: "FULL", Subjects: []string{"dlq.full"}, MaxMsgs: 1, Discard: jetstream.DiscardNew},
		{Name: "WIDE", Subjects: []string{"dlq.wide"}},
	} {
		if _, err := js.CreateStream(ctxT(t), sc); err != nil {
			t.Fatal(err)
		}
	}
	sink := newSink(t, nc, cfg)
	seq := 0
	dead := func(id, target string, size int) *codec.Task {
		dl := task(id, target, string(bytes.Repeat([]byte("x"), size)), 0)
		// Each dead letter is another source message's: its origin
		// (in its Nats-Msg-Id) tells it from the others.
		seq++
		dl.Kind, dl.Code, dl.Origin = codec.KindDeadLetter, codec.CodeBadDue, "nats:DELAY#"+strconv.Itoa(seq)
		return dl
	}
	if errs := sink.Deliver(ctxT(t), []*codec.Task{dead("first", "dlq.full", 1)}); errs != nil {
		t.Fatalf("filling dlq.full: %v", errs)
	}
	batch := []*codec.Task{
		dead("a", "dlq.small", 4096),  // over max_msg_size
		dead("b", "dlq.wide", 16<<10), // over max_payload
		dead("c", "dlq.full", 1),      // the stream is full
		dead("d", "dlq.nostream", 1),  // no stream captures it
		dead("e", "dlq.small", 1),     // fine
	}
	errs := sink.Deliver(ctxT(t), batch)
	if len(errs) != len(batch) || errs[4] != nil {
		t.Fatalf("errs = %v", errs)
	}
	for i, want := range []bool{true, true, false, false} {
		if errs[i] == nil {
			t.Fatalf("errs[%d] = nil", i)
		}
		if got := errors.Is(errs[i], shard.ErrRefused); got != want {
			t.Errorf("errs[%d] = %v: refused %v, want %v", i, errs[i], got, want)
		}
		if errors.Is(errs[i], shard.ErrUnavailable) {
			t.Errorf("errs[%d] = %v: unavailable", i, errs[i])
		}
	}
	if !errors.Is(errs[3], ErrNoTargetStream) {
		t.Errorf("errs[3] = %v, want ErrNoTargetStream", errs[3])
	}
}

// TestSinkKafkaHeaderNames: a task from Kafka whose header names NATS
// cannot carry is delivered (names percent-encoded), not refused forever.
func TestSinkKafkaHeaderNames(t *testing.T) {
	s := startServer(t, jsOptions(t))
	cfg := testConfig(t, serverURL(s))
	nc := connect(t, cfg)
	js := newJS(t, nc)
	if _, err := js.CreateStream(ctxT(t), jetstream.StreamConfig{Name: "OUT", Subjects: []string{"out.>"}}); err != nil {
		t.Fatal(err)
	}
	sink := newSink(t, nc, cfg)
	tk := task("k1", "out.x", "v", 0)
	tk.Headers = append(tk.Headers, codec.Header{Key: "trace id", Value: []byte("t")}, codec.Header{Key: "a:b", Value: []byte("c")},
		codec.Header{Key: "", Value: []byte("empty")})
	if errs := sink.Deliver(ctxT(t), []*codec.Task{tk}); errs != nil {
		t.Fatalf("Deliver: %v", errs)
	}
	stream, err := js.Stream(ctxT(t), "OUT")
	if err != nil {
		t.Fatal(err)
	}
	msg, err := stream.GetLastMsgForSubject(ctxT(t), "out.x")
	if err != nil {
		t.Fatal(err)
	}
	if msg.Header.Get("trace%20id") != "t" || msg.Header.Get("a%3Ab") != "c" {
		t.Fatalf("headers %v", msg.Header)
	}
}

// TestSinkVerdictCacheBounded: with more distinct target subjects within
// NoStreamTTL than the verdict cache holds (per-entity subjects such as
// user.<id>.reminder), the cache stays within maxVerdicts; it grew without
// bound, and every new subject walked it all under the sink's lock.
func TestSinkVerdictCacheBounded(t *testing.T) {
	cfg, nc, _ := outServer(t, "user.>")
	sink := newSink(t, nc, cfg)
	const n, batch = maxVerdicts + 1000, 512
	for from := 0; from < n; from += batch {
		var b []*codec.Task
		for i := from; i < min(from+batch, n); i++ {
			b = append(b, task(fmt.Sprint("id-", i), fmt.Sprintf("user.%d.reminder", i), "v", 1795359845123))
		}
		if errs := sink.Deliver(ctxT(t), b); errs != nil {
			t.Fatalf("deliver: %v", errors.Join(errs...))
		}
		sink.mu.Lock()
		got := len(sink.verdicts)
		sink.mu.Unlock()
		if got > maxVerdicts {
			t.Fatalf("verdict cache holds %d subjects after %d deliveries, maxVerdicts is %d", got, from+len(b), maxVerdicts)
		}
	}
}

// TestSinkVerdictEvictionKeepsCore: when the verdict cache is full of live
// verdicts, the stream ones go first: a subject with a stream finds out
// again from its next PubAck at no cost, a core one (no stream) would cost
// a probeWait or a stream lookup on its next delivery.
func TestSinkVerdictEvictionKeepsCore(t *testing.T) {
	for _, tc := range []struct {
		name      string
		core      int // live core verdicts among maxVerdicts
		wantCore  bool
		wantBelow int
	}{
		{"mostly stream verdicts: the core ones stay", 10, true, maxVerdicts / 2},
		{"mostly core verdicts: start over", maxVerdicts - 10, false, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := &Sink{cfg: Config{NoStreamTTL: time.Minute}, verdicts: map[string]verdict{}}
			now := time.Unix(1000, 0)
			s.now = func() time.Time { return now }
			for i := range maxVerdicts {
				s.verdicts[fmt.Sprint("s.", i)] = verdict{core: i < tc.core, until: now.Add(time.Minute)}
			}
			s.setVerdict("new", false)
			_, kept := s.verdicts["s.0"] // a core one
			if kept != tc.wantCore || len(s.verdicts) >= tc.wantBelow {
				t.Fatalf("after eviction: core verdict kept %v (want %v), %d verdicts (want < %d)", kept, tc.wantCore, len(s.verdicts), tc.wantBelow)
			}
			if _, ok := s.verdicts["new"]; !ok {
				t.Fatal("the new verdict is not recorded")
			}
		})
	}
}
