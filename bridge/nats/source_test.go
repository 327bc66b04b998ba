package nats

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/bridge"
	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/shard"
)

func TestNewSourceStreamAndConsumer(t *testing.T) {
	s := startServer(t, jsOptions(t))
	cfg := testConfig(t, serverURL(s))
	nc := connect(t, cfg)
	js := newJS(t, nc)

	_, err := NewSource(nc, cfg)
	if !errors.Is(err, ErrNoStream) || !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Fatalf("missing stream: err = %v, want ErrNoStream", err)
	}
	if want := `"DELAY"`; err == nil || !bytes.Contains([]byte(err.Error()), []byte(want)) {
		t.Errorf("error %q does not name the stream", err)
	}
	if want := "nats.create: true"; !bytes.Contains([]byte(err.Error()), []byte(want)) {
		t.Errorf("error %q does not name the config key (%s)", err, want)
	}

	if _, err := js.CreateStream(ctxT(t), jetstream.StreamConfig{Name: "DELAY", Subjects: []string{"delay.>"}}); err != nil {
		t.Fatal(err)
	}
	_, err = NewSource(nc, cfg)
	if !errors.Is(err, ErrNoConsumer) {
		t.Fatalf("missing consumer: err = %v, want ErrNoConsumer", err)
	}
	if want := "nats.create: true"; !bytes.Contains([]byte(err.Error()), []byte(want)) {
		t.Errorf("error %q does not name the config key (%s)", err, want)
	}

	// A consumer with the wrong ack policy is refused rather than used.
	if _, err := js.CreateOrUpdateConsumer(ctxT(t), "DELAY", jetstream.ConsumerConfig{Durable: "bridge", AckPolicy: jetstream.AckNonePolicy}); err != nil {
		t.Fatal(err)
	}
	if _, err = NewSource(nc, cfg); !errors.Is(err, ErrConfig) {
		t.Fatalf("ack none consumer: err = %v, want ErrConfig", err)
	}
	if err := js.DeleteConsumer(ctxT(t), "DELAY", "bridge"); err != nil {
		t.Fatal(err)
	}

	// Create: the consumer is made; an extra subject is added to the stream.
	cfg.Create = true
	cfg.Sources = append(cfg.Sources, SourceConfig{Subject: "later.*"})
	src, err := NewSource(nc, cfg)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	if src.Health() != nil {
		t.Errorf("health = %v", src.Health())
	}
	st, err := js.Stream(ctxT(t), "DELAY")
	if err != nil {
		t.Fatal(err)
	}
	if got := st.CachedInfo().Config.Subjects; !reflect.DeepEqual(got, []string{"delay.>", "later.*"}) {
		t.Errorf("stream subjects = %v", got)
	}
	ci := consumerInfo(t, js, "DELAY", "bridge")
	if ci.Config.AckPolicy != jetstream.AckExplicitPolicy || ci.Config.MaxAckPending != 20000 ||
		!reflect.DeepEqual(ci.Config.FilterSubjects, []string{"delay.>", "later.*"}) || ci.Config.MaxDeliver != -1 {
		t.Errorf("consumer config = %+v", ci.Config)
	}

	// Create on a fresh server makes the stream too.
	s2 := startServer(t, jsOptions(t))
	cfg2 := testConfig(t, serverURL(s2))
	cfg2.Create = true
	nc2 := connect(t, cfg2)
	if _, err := NewSource(nc2, cfg2); err != nil {
		t.Fatalf("create stream: %v", err)
	}
	st2, err := newJS(t, nc2).Stream(ctxT(t), "DELAY")
	if err != nil {
		t.Fatal(err)
	}
	if c := st2.CachedInfo().Config; c.Retention != jetstream.WorkQueuePolicy || !reflect.DeepEqual(c.Subjects, []string{"delay.>"}) ||
		c.Duplicates != MinDuplicateWindow {
		t.Errorf("created stream config = %+v", c)
	}
}

// TestSourceMessages pins the conversion of a JetStream message: origin,
// stored time, headers (multi-valued), value and the rules of the first
// matching source.
func TestSourceMessages(t *testing.T) {
	s := startServer(t, jsOptions(t))
	cfg := testConfig(t, serverURL(s))
	special, general := &codec.Rules{DLQ: "dlq.special"}, &codec.Rules{DLQ: "dlq.general"}
	cfg.Sources = []SourceConfig{{Subject: "delay.special.>", Rules: special}, {Subject: "delay.>", Rules: general}}
	cfg.Create = true
	nc := connect(t, cfg)
	js := newJS(t, nc)
	// A limits stream keeps acked messages, so the stored time can be read back.
	if _, err := js.CreateStream(ctxT(t), jetstream.StreamConfig{Name: "DELAY", Subjects: []string{"delay.>"}}); err != nil {
		t.Fatal(err)
	}
	src, err := NewSource(nc, cfg)
	if err != nil {
		t.Fatal(err)
	}

	h := natsgo.Header{}
	h.Add("delay-after", "1h")
	h.Add("x-multi", "one")
	h.Add("x-multi", "two")
	h.Add("Nats-Msg-Id", "order-1")
	ack1 := publish(t, js, "delay.special.orders", "v1", h)
	ack2 := publish(t, js, "delay.other", "v2", nil)

	rec := newRecorder()
	stop := runSource(t, src, rec)
	eventually(t, "two messages", func() bool { return len(rec.seqs()) == 2 })
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}

	stream, _ := js.Stream(ctxT(t), "DELAY")
	raw1, err := stream.GetMsg(ctxT(t), ack1.Sequence)
	if err != nil {
		t.Fatal(err)
	}
	it1, it2 := rec.items[0], rec.items[1]
	want1 := codec.Message{
		Transport: codec.TransportNATS, Source: "DELAY", Partition: 0, Offset: int64(ack1.Sequence),
		Value: []byte("v1"),
		Headers: []codec.Header{
			{Key: "Nats-Msg-Id", Value: []byte("order-1")},
			{Key: "delay-after", Value: []byte("1h")},
			{Key: "x-multi", Value: []byte("one")},
			{Key: "x-multi", Value: []byte("two")},
		},
		Time: raw1.Time,
	}
	if !it1.Msg.Time.Equal(raw1.Time) {
		t.Errorf("time = %v, want stored time %v", it1.Msg.Time, raw1.Time)
	}
	it1.Msg.Time = raw1.Time
	if !reflect.DeepEqual(it1.Msg, want1) {
		t.Errorf("message 1 =\n%+v\nwant\n%+v", it1.Msg, want1)
	}
	if it1.Msg.Key != nil {
		t.Error("NATS messages have no key")
	}
	if it1.Rules != special || it2.Rules != general {
		t.Errorf("rules = %v, %v; want special, general", it1.Rules, it2.Rules)
	}
	if it2.Msg.Offset != int64(ack2.Sequence) || it2.Msg.Headers != nil || string(it2.Msg.Value) != "v2" {
		t.Errorf("message 2 = %+v", it2.Msg)
	}
	if got := it1.Msg.Origin(); got != fmt.Sprintf("nats:DELAY#%d", ack1.Sequence) {
		t.Errorf("origin = %q", got)
	}
	last := rec.batches[len(rec.batches)-1].Checkpoints
	// The position in this stream: its creation time is in the key; and
	// the stream's incarnation (the first), tied to that creation time.
	created := src.created.Load()
	want := []shard.Checkpoint{
		{Key: fmt.Sprintf("nats|DELAY|delay.>|%d", created), Offset: int64(ack2.Sequence)},
		{Key: "nats-incarnation|DELAY", Offset: 0, Fingerprint: uint64(created)},
	}
	if created == 0 || !slices.Equal(last, want) {
		t.Errorf("checkpoints = %+v, want %+v", last, want)
	}
}

// TestSourceAckAfterHandle: while the handler fails nothing is acked and
// the batch is handed over again; once it succeeds the batch is acked.
// A source stopped while failing leaves the messages for the next run.
func TestSourceAckAfterHandle(t *testing.T) {
	cfg, nc, js, src := createdSource(t, nil)
	for i := range 3 {
		publish(t, js, "delay.x", fmt.Sprint(i), nil)
	}

	rec := newRecorder()
	rec.setFail(true)
	stop := runSource(t, src, rec)
	eventually(t, "two failed attempts", func() bool { return rec.numCalls() >= 2 })
	ci := consumerInfo(t, js, "DELAY", "bridge")
	if ci.AckFloor.Stream != 0 || ci.NumAckPending != 3 {
		t.Fatalf("acked while the handler fails: ack floor %d, pending %d", ci.AckFloor.Stream, ci.NumAckPending)
	}
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if n := len(rec.seqs()); n != 0 {
		t.Fatalf("recorded %d items from failed batches", n)
	}
	ci = consumerInfo(t, js, "DELAY", "bridge")
	if ci.AckFloor.Stream != 0 {
		t.Fatalf("ack floor %d after an abandoned batch", ci.AckFloor.Stream)
	}

	// A new source (a restarted bridge) gets the messages again.
	src2, err := NewSource(nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	rec.setFail(false)
	runSource(t, src2, rec)
	eventually(t, "redelivered batch handled", func() bool { return len(rec.seqs()) == 3 })
	eventually(t, "acked", func() bool { return consumerInfo(t, js, "DELAY", "bridge").AckFloor.Stream == 3 })
	// Redelivery after a nak is in no particular order.
	if got := slices.Sorted(slices.Values(rec.seqs())); !reflect.DeepEqual(got, []int64{1, 2, 3}) {
		t.Errorf("seqs = %v", got)
	}
	assertFloors(t, rec)
}

// TestSourceRetriesUntilHandled: a failing handler is retried on the same
// batch without stopping the source; the batch is acked after success.
func TestSourceRetriesUntilHandled(t *testing.T) {
	_, _, js, src := createdSource(t, nil)
	publish(t, js, "delay.x", "a", nil)
	rec := newRecorder()
	rec.setFail(true)
	runSource(t, src, rec)
	eventually(t, "a failed attempt", func() bool { return rec.numCalls() >= 1 })
	rec.setFail(false)
	eventually(t, "handled", func() bool { return len(rec.seqs()) == 1 })
	eventually(t, "acked", func() bool { return consumerInfo(t, js, "DELAY", "bridge").AckFloor.Stream == 1 })
}

// crashedConsumer plays a bridge that received messages and died before
// acking them: it pulls n messages on the durable consumer and drops them.
func crashedConsumer(t *testing.T, js jetstream.JetStream, n int, nak bool) {
	t.Helper()
	c, err := js.Consumer(ctxT(t), "DELAY", "bridge")
	if err != nil {
		t.Fatal(err)
	}
	b, err := c.Fetch(n, jetstream.FetchMaxWait(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	got := 0
	for m := range b.Messages() {
		got++
		if nak {
			if err := m.Nak(); err != nil {
				t.Fatal(err)
			}
		}
	}
	if got != n {
		t.Fatalf("crashed consumer got %d of %d messages: %v", got, n, b.Error())
	}
}

// TestSourceCheckpointSkip: messages 1..3 were made durable by a bridge
// that crashed before acking them (checkpoint 3). On restart they are acked
// without being handed over again; 4 and 5 are handled. A checkpoint an
// older version stored without the stream's identity counts as well when
// the consumer has delivered past it (it is then this stream's), and is
// carried to the key with the identity.
func TestSourceCheckpointSkip(t *testing.T) {
	for _, c := range []struct {
		name string
		cps  func(base string, created int64) map[string]int64
	}{
		{"checkpoint of this stream", func(base string, created int64) map[string]int64 {
			return map[string]int64{fmt.Sprintf("%s|%d", base, created): 3}
		}},
		{"older version's checkpoint, the consumer delivered past it", func(base string, _ int64) map[string]int64 {
			return map[string]int64{base: 3}
		}},
		{"development version's checkpoint with this stream's identity", func(base string, created int64) map[string]int64 {
			return map[string]int64{base: 3, base + "|created": created}
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, _, js, src := createdSource(t, nil)
			for i := range 5 {
				publish(t, js, "delay.x", fmt.Sprint(i), nil)
			}
			crashedConsumer(t, js, 5, true)

			rec := newRecorder()
			rec.cps = c.cps("nats|DELAY|delay.>", src.created.Load())
			runSource(t, src, rec)
			eventually(t, "all acked", func() bool { return consumerInfo(t, js, "DELAY", "bridge").AckFloor.Stream == 5 })
			if got := rec.seqs(); !reflect.DeepEqual(got, []int64{4, 5}) {
				t.Fatalf("handled %v, want [4 5]", got)
			}
			// Messages delivered to the crashed run were not all acked when 4 and 5
			// were handled, so the checkpoint could not claim past 3 yet.
			key := CheckpointKey("DELAY", src.created.Load(), []string{"delay.>"})
			for _, b := range rec.batches {
				if b.Checkpoints[0].Key != key || b.Checkpoints[0].Offset > 5 || b.Checkpoints[0].Offset < 3 {
					t.Errorf("checkpoint %+v", b.Checkpoints[0])
				}
			}
		})
	}
}

// TestSourceRedeliveryBehindNewMessages: a crashed bridge took 1..3 and
// handled nothing. They come back only after AckWait, behind 4..5. The
// checkpoint handed over with 4..5 must not claim 1..3, or a second crash
// would skip them for good.
func TestSourceRedeliveryBehindNewMessages(t *testing.T) {
	_, _, js, src := createdSource(t, func(c *Config) {
		c.AckWait = 500 * time.Millisecond
	})
	for i := range 3 {
		publish(t, js, "delay.x", fmt.Sprint(i), nil)
	}
	crashedConsumer(t, js, 3, false)
	for i := 3; i < 5; i++ {
		publish(t, js, "delay.x", fmt.Sprint(i), nil)
	}

	rec := newRecorder()
	runSource(t, src, rec)
	eventually(t, "all handled", func() bool { return len(rec.seqs()) == 5 })
	got := rec.seqs()
	if !reflect.DeepEqual(slices.Sorted(slices.Values(got)), []int64{1, 2, 3, 4, 5}) {
		t.Fatalf("handled %v", got)
	}
	assertFloors(t, rec)
	eventually(t, "all acked", func() bool { return consumerInfo(t, js, "DELAY", "bridge").AckFloor.Stream == 5 })
}

// assertFloors checks that each checkpoint handed over is a floor: every
// sequence at or below it was handled in that batch or before (all stream
// sequences in these tests are delay messages).
func assertFloors(t *testing.T, rec *recorder) {
	t.Helper()
	held := map[int64]bool{}
	for i, b := range rec.batches {
		for _, it := range b.Items {
			held[it.Msg.Offset] = true
		}
		cp := b.Checkpoints[0].Offset
		for seq := int64(1); seq <= cp; seq++ {
			if !held[seq] {
				t.Errorf("batch %d: checkpoint %d claims sequence %d, which was not handled yet", i, cp, seq)
				break
			}
		}
	}
}

// TestSourceConsumerFilterNotCovered: an existing consumer that reads
// subjects no configured source covers is refused at start, since its
// messages would have no rules.
func TestSourceConsumerFilterNotCovered(t *testing.T) {
	s := startServer(t, jsOptions(t))
	cfg := testConfig(t, serverURL(s))
	cfg.Sources = []SourceConfig{{Subject: "delay.a.>"}}
	nc := connect(t, cfg)
	js := newJS(t, nc)
	if _, err := js.CreateStream(ctxT(t), jetstream.StreamConfig{Name: "DELAY", Subjects: []string{"delay.>"}}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		filters []string
		ok      bool
	}{
		{[]string{"delay.a.x"}, true},
		{[]string{"delay.a.>"}, true},
		{[]string{"delay.>"}, false},
		{nil, false}, // the whole stream
	} {
		if _, err := js.CreateOrUpdateConsumer(ctxT(t), "DELAY", jetstream.ConsumerConfig{
			Durable: "bridge", AckPolicy: jetstream.AckExplicitPolicy, FilterSubjects: tc.filters,
		}); err != nil {
			t.Fatal(err)
		}
		_, err := NewSource(nc, cfg)
		if (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrConfig)) {
			t.Errorf("consumer filters %v: err = %v, want ok=%v", tc.filters, err, tc.ok)
		}
		if err := js.DeleteConsumer(ctxT(t), "DELAY", "bridge"); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSourceConsumerOnMirrorOrSources: a delay stream that mirrors or
// sources other streams brings their subjects with it, which its own
// subjects do not show. An unfiltered consumer on it reads all of that, so
// it counts as reading ">" and is refused unless a source covers ">"
// (before, a mirror's empty subject list passed the check, and every
// message of the mirrored stream outside the delay subjects was
// dead-lettered missing-due). A filtered consumer is checked as usual; a
// mirror cannot be given subjects, so create: true on it says so.
func TestSourceConsumerOnMirrorOrSources(t *testing.T) {
	s := startServer(t, jsOptions(t))
	cfg := testConfig(t, serverURL(s))
	nc := connect(t, cfg)
	js := newJS(t, nc)
	if _, err := js.CreateStream(ctxT(t), jetstream.StreamConfig{Name: "EDGE", Subjects: []string{"delay.>", "other.>"}}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name    string
		stream  jetstream.StreamConfig
		filters []string
		ok      bool
	}{
		{"mirror, unfiltered", jetstream.StreamConfig{Mirror: &jetstream.StreamSource{Name: "EDGE"}}, nil, false},
		{"mirror, filtered", jetstream.StreamConfig{Mirror: &jetstream.StreamSource{Name: "EDGE"}}, []string{"delay.>"}, true},
		{"sources, unfiltered", jetstream.StreamConfig{Sources: []*jetstream.StreamSource{{Name: "EDGE"}}}, nil, false},
		{"sources and subjects, unfiltered", jetstream.StreamConfig{Subjects: []string{"hub.>"}, Sources: []*jetstream.StreamSource{{Name: "EDGE"}}}, nil, false},
		{"sources and subjects, filtered", jetstream.StreamConfig{Subjects: []string{"hub.>"}, Sources: []*jetstream.StreamSource{{Name: "EDGE"}}}, []string{"delay.>"}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sc := tc.stream
			sc.Name = "DELAY"
			if _, err := js.CreateStream(ctxT(t), sc); err != nil {
				t.Fatal(err)
			}
			defer func() {
				if err := js.DeleteStream(ctxT(t), "DELAY"); err != nil {
					t.Fatal(err)
				}
			}()
			if _, err := js.CreateOrUpdateConsumer(ctxT(t), "DELAY", jetstream.ConsumerConfig{
				Durable: "bridge", AckPolicy: jetstream.AckExplicitPolicy, FilterSubjects: tc.filters,
			}); err != nil {
				t.Fatal(err)
			}
			_, err := NewSource(nc, cfg)
			if (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrConfig)) {
				t.Errorf("err = %v, want ok=%v", err, tc.ok)
			}
			if sc.Mirror == nil {
				return
			}
			create := cfg
			create.Create = true
			if _, err := NewSource(nc, create); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "is a mirror of \"EDGE\"") {
				t.Errorf("create: true on a mirror: err = %v, want ErrConfig naming the mirror", err)
			}
		})
	}
}

// TestSourceConsumerDeleted: a consumer deleted under a running source makes
// Health report it; once it exists again the source resumes on its own.
func TestSourceConsumerDeleted(t *testing.T) {
	s := startServer(t, jsOptions(t))
	cfg := testConfig(t, serverURL(s))
	nc := connect(t, cfg)
	js := newJS(t, nc)
	if _, err := js.CreateStream(ctxT(t), jetstream.StreamConfig{Name: "DELAY", Subjects: []string{"delay.>"}}); err != nil {
		t.Fatal(err)
	}
	consumerCfg := jetstream.ConsumerConfig{Durable: "bridge", AckPolicy: jetstream.AckExplicitPolicy, FilterSubject: "delay.>"}
	if _, err := js.CreateOrUpdateConsumer(ctxT(t), "DELAY", consumerCfg); err != nil {
		t.Fatal(err)
	}
	src, err := NewSource(nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	runSource(t, src, rec)
	publish(t, js, "delay.x", "1", nil)
	eventually(t, "first message", func() bool { return len(rec.seqs()) == 1 })

	if err := js.DeleteConsumer(ctxT(t), "DELAY", "bridge"); err != nil {
		t.Fatal(err)
	}
	eventually(t, "unhealthy", func() bool { return src.Health() != nil })
	if err := src.Health(); !errors.Is(err, ErrNoConsumer) {
		t.Errorf("health = %v, want ErrNoConsumer", err)
	}
	consumerCfg.DeliverPolicy = jetstream.DeliverNewPolicy
	if _, err := js.CreateOrUpdateConsumer(ctxT(t), "DELAY", consumerCfg); err != nil {
		t.Fatal(err)
	}
	publish(t, js, "delay.x", "2", nil)
	eventually(t, "second message after the consumer came back", func() bool { return len(rec.seqs()) == 2 })
	eventually(t, "healthy", func() bool { return src.Health() == nil })
}

// TestSourceCreateKeepsExistingConsumer: with Create, an existing consumer
// that started elsewhere keeps its start; the bridge's settings are applied.
func TestSourceCreateKeepsExistingConsumer(t *testing.T) {
	s := startServer(t, jsOptions(t))
	cfg := testConfig(t, serverURL(s))
	cfg.Create = true
	nc := connect(t, cfg)
	js := newJS(t, nc)
	if _, err := js.CreateStream(ctxT(t), jetstream.StreamConfig{Name: "DELAY", Subjects: []string{"delay.>"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateOrUpdateConsumer(ctxT(t), "DELAY", jetstream.ConsumerConfig{
		Durable: "bridge", AckPolicy: jetstream.AckExplicitPolicy, DeliverPolicy: jetstream.DeliverNewPolicy, MaxAckPending: 10,
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := NewSource(nc, cfg); err != nil {
		t.Fatal(err)
	}
	ci := consumerInfo(t, js, "DELAY", "bridge")
	if ci.Config.DeliverPolicy != jetstream.DeliverNewPolicy || ci.Config.MaxAckPending != 20000 ||
		!reflect.DeepEqual(ci.Config.FilterSubjects, []string{"delay.>"}) {
		t.Errorf("consumer config = %+v", ci.Config)
	}
	// An ack-none consumer cannot be updated into what the bridge needs.
	if _, err := js.CreateOrUpdateConsumer(ctxT(t), "DELAY", jetstream.ConsumerConfig{Durable: "other", AckPolicy: jetstream.AckNonePolicy}); err != nil {
		t.Fatal(err)
	}
	cfg.Consumer = "other"
	if _, err := NewSource(nc, cfg); !errors.Is(err, ErrConfig) {
		t.Errorf("ack none consumer with create: err = %v, want ErrConfig", err)
	}
}

// blocker is a Handler whose first Handle of messages blocks until
// released, or fails when its context ends first (a batch in the handler
// at a stop).
type blocker struct {
	*recorder
	entered chan struct{}
	release chan struct{}
	once    sync.Once
}

func (b *blocker) Handle(ctx context.Context, batch *bridge.Batch) error {
	first := false
	if len(batch.Items) > 0 {
		b.once.Do(func() { first = true })
	}
	if first {
		close(b.entered)
		select {
		case <-b.release:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return b.recorder.Handle(ctx, batch)
}

// TestSourceSlowHandlerKeepsBatch: a handler slower than the consumer's
// AckWait does not get its batch redelivered meanwhile; the source keeps
// it in progress, at the pace of the AckWait the server has, also when an
// operator made the consumer with another one than Config.AckWait.
// (This test waits: it is about time passing without a redelivery.)
func TestSourceSlowHandlerKeepsBatch(t *testing.T) {
	for _, c := range []struct {
		name     string
		create   bool
		ackWait  time.Duration // Config.AckWait
		consumer *jetstream.ConsumerConfig
	}{
		{name: "consumer made by the bridge", create: true, ackWait: time.Second},
		{name: "operator's consumer with a shorter AckWait", consumer: &jetstream.ConsumerConfig{
			Durable: "bridge", AckPolicy: jetstream.AckExplicitPolicy, AckWait: time.Second, MaxDeliver: 3, FilterSubject: "delay.>"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := startServer(t, jsOptions(t))
			cfg := testConfig(t, serverURL(s))
			cfg.Create = c.create
			cfg.AckWait = c.ackWait
			nc := connect(t, cfg)
			js := newJS(t, nc)
			if c.consumer != nil {
				if _, err := js.CreateStream(ctxT(t), jetstream.StreamConfig{Name: "DELAY", Subjects: []string{"delay.>"}}); err != nil {
					t.Fatal(err)
				}
				if _, err := js.CreateConsumer(ctxT(t), "DELAY", *c.consumer); err != nil {
					t.Fatal(err)
				}
			}
			src, err := NewSource(nc, cfg)
			if err != nil {
				t.Fatal(err)
			}
			publish(t, js, "delay.x", "slow", nil)
			h := &blocker{recorder: newRecorder(), entered: make(chan struct{}), release: make(chan struct{})}
			runSource(t, src, h)
			<-h.entered
			time.Sleep(5 * time.Second / 2) // 2.5 times the consumer's AckWait
			if ci := consumerInfo(t, js, "DELAY", "bridge"); ci.NumRedelivered != 0 || ci.Delivered.Consumer != 1 {
				t.Errorf("redelivered %d (deliveries %d) while the handler was working", ci.NumRedelivered, ci.Delivered.Consumer)
			}
			close(h.release)
			eventually(t, "acked", func() bool { return consumerInfo(t, js, "DELAY", "bridge").AckFloor.Stream == 1 })
			if got := h.seqs(); !reflect.DeepEqual(got, []int64{1}) {
				t.Errorf("handled %v", got)
			}
		})
	}
}

// TestSourceKeepAlivePeriod: the in-progress period is a third of the
// shortest redelivery wait of the consumer as the server has it (AckWait,
// or a shorter BackOff step), whoever made the consumer.
func TestSourceKeepAlivePeriod(t *testing.T) {
	for _, c := range []struct {
		name     string
		ackWait  time.Duration // Config.AckWait
		consumer *jetstream.ConsumerConfig
		want     time.Duration
	}{
		{name: "consumer made by the bridge", ackWait: 6 * time.Second, want: 2 * time.Second},
		{name: "consumer made by the bridge, default AckWait", want: 10 * time.Second},
		{name: "operator's consumer: its AckWait, not Config's", ackWait: 30 * time.Second, consumer: &jetstream.ConsumerConfig{
			AckWait: 3 * time.Second}, want: time.Second},
		{name: "operator's consumer with BackOff", consumer: &jetstream.ConsumerConfig{
			AckWait: 9 * time.Second, BackOff: []time.Duration{1500 * time.Millisecond, 6 * time.Second}, MaxDeliver: 5}, want: 500 * time.Millisecond},
		{name: "operator's consumer with a BackOff step shorter than the first", consumer: &jetstream.ConsumerConfig{
			BackOff: []time.Duration{3 * time.Second, 600 * time.Millisecond, 6 * time.Second}, MaxDeliver: 5}, want: 200 * time.Millisecond},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := startServer(t, jsOptions(t))
			cfg := testConfig(t, serverURL(s))
			cfg.AckWait = c.ackWait
			cfg.Create = c.consumer == nil
			nc := connect(t, cfg)
			js := newJS(t, nc)
			if c.consumer != nil {
				if _, err := js.CreateStream(ctxT(t), jetstream.StreamConfig{Name: "DELAY", Subjects: []string{"delay.>"}}); err != nil {
					t.Fatal(err)
				}
				cc := *c.consumer
				cc.Durable, cc.AckPolicy, cc.FilterSubject = "bridge", jetstream.AckExplicitPolicy, "delay.>"
				if _, err := js.CreateConsumer(ctxT(t), "DELAY", cc); err != nil {
					t.Fatal(err)
				}
			}
			src, err := NewSource(nc, cfg)
			if err != nil {
				t.Fatal(err)
			}
			if got := src.keepAlivePeriod(); got != c.want {
				t.Fatalf("keep-alive period = %s, want %s", got, c.want)
			}
		})
	}
}

// TestSourceStreamCreatedAgain: a stream deleted and created again numbers
// its messages from 1. The store's floor (reached on the old stream) must
// not make the source ack the new stream's messages without handing them
// over: not after a restart (with the stream identity in the checkpoint
// key, or without it, as an older version stored it, even when the new
// stream is already longer than the old floor), and not while running.
func TestSourceStreamCreatedAgain(t *testing.T) {
	const base = "nats|DELAY|delay.>"
	for _, c := range []struct {
		name string
		live bool // delete the stream while the source runs
		// store turns the store's checkpoints into what an older version
		// would have written.
		store func(cps map[string]int64, oldKey string, oldCreated int64)
		n     int // messages on the new stream
	}{
		{name: "restart", n: 3},
		// Older versions stored no incarnation; a floor dropped as likely
		// another stream's makes the new stream the next one.
		{name: "restart, older version's checkpoint", n: 3, store: func(cps map[string]int64, oldKey string, _ int64) {
			cps[base] = cps[oldKey]
			delete(cps, oldKey)
			delete(cps, IncarnationKey("DELAY"))
		}},
		{name: "restart, older version's checkpoint, the new stream already past it", n: 8, store: func(cps map[string]int64, oldKey string, _ int64) {
			cps[base] = cps[oldKey]
			delete(cps, oldKey)
			delete(cps, IncarnationKey("DELAY"))
		}},
		{name: "restart, development version's checkpoint", n: 8, store: func(cps map[string]int64, oldKey string, oldCreated int64) {
			cps[base], cps[base+"|created"] = cps[oldKey], oldCreated
			delete(cps, oldKey)
			delete(cps, IncarnationKey("DELAY"))
		}},
		{name: "while running", live: true, n: 3},
		// A store that never had the incarnation (a version that stored
		// it only with a batch): the stream read before is incarnation 0.
		{name: "while running, no incarnation stored", live: true, n: 3, store: func(cps map[string]int64, _ string, _ int64) {
			delete(cps, IncarnationKey("DELAY"))
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := startServer(t, jsOptions(t))
			cfg := testConfig(t, serverURL(s))
			cfg.Create = true
			nc := connect(t, cfg)
			js := newJS(t, nc)
			rec := newRecorder()
			src, err := NewSource(nc, cfg)
			if err != nil {
				t.Fatal(err)
			}
			stop := runSource(t, src, rec)
			for i := range 5 {
				publish(t, js, "delay.a", fmt.Sprint("old", i), natsgo.Header{"delay-after": {"1s"}})
			}
			eventually(t, "5 handled", func() bool { return len(rec.seqs()) == 5 })
			oldCreated := src.created.Load()
			oldKey := CheckpointKey("DELAY", oldCreated, []string{"delay.>"})
			if !c.live {
				if err := stop(); err != nil {
					t.Fatal(err)
				}
			}
			// The store is edited before the stream goes, so a running
			// source sees the edited store whenever it notices.
			if c.store != nil {
				rec.mu.Lock()
				c.store(rec.cps, oldKey, oldCreated)
				rec.mu.Unlock()
			}
			if err := js.DeleteStream(ctxT(t), cfg.Stream); err != nil {
				t.Fatal(err)
			}
			if c.live {
				eventually(t, "the stream created again by the source", func() bool {
					_, err := js.Stream(ctxT(t), cfg.Stream)
					return err == nil
				})
			}
			var src2 *Source
			if !c.live {
				// Creates the stream again, once the server is done deleting
				// the old one's storage.
				eventually(t, "the stream created again", func() bool {
					src2, err = NewSource(nc, cfg)
					return err == nil
				})
			}
			for i := range c.n {
				publish(t, js, "delay.a", fmt.Sprint("new", i), natsgo.Header{"delay-after": {"1s"}})
			}
			if !c.live {
				runSource(t, src2, rec)
			}
			want := make([]int64, c.n)
			for i := range want {
				want[i] = int64(i + 1)
			}
			eventually(t, "the new stream's messages acked", func() bool {
				// While running, the source creates the consumer again
				// only after the stream: until then it is not found.
				cons, err := js.Consumer(ctxT(t), "DELAY", "bridge")
				if errors.Is(err, jetstream.ErrConsumerNotFound) {
					return false
				}
				if err != nil {
					t.Fatalf("consumer: %v", err)
				}
				info, err := cons.Info(ctxT(t))
				if err != nil {
					t.Fatalf("consumer info: %v", err)
				}
				return info.AckFloor.Stream == uint64(c.n)
			})
			if got := rec.seqs()[5:]; !slices.Equal(got, want) {
				t.Fatalf("new stream's sequences handled: %v, want %v", got, want)
			}
			// The new stream's messages are of another incarnation than
			// the old one's, so the store orders them by stored time, not
			// by their sequences, which started again at 1.
			wantInc := []uint32{0, 1}
			if got := rec.incarnations(); !slices.Equal(got, wantInc) {
				t.Fatalf("incarnations handled %v, want %v", got, wantInc)
			}
			cp, ok, _ := rec.LoadCheckpoint(IncarnationKey("DELAY"))
			created := src.created.Load()
			if src2 != nil {
				created = src2.created.Load()
			}
			if !ok || cp.Offset != 1 || cp.Fingerprint != uint64(created) {
				t.Fatalf("stored incarnation %+v (%v), want 1 of the stream created at %d", cp, ok, created)
			}
		})
	}
}

// TestSourceIncarnationStoredAtStart: the source stores the stream's
// incarnation before any message arrives, so a stream deleted and
// created again while the bridge is down, with nothing read in between,
// is still the next incarnation: its messages are not ordered by
// sequence against the old stream's pending tasks.
func TestSourceIncarnationStoredAtStart(t *testing.T) {
	s := startServer(t, jsOptions(t))
	cfg := testConfig(t, serverURL(s))
	cfg.Create = true
	nc := connect(t, cfg)
	js := newJS(t, nc)
	rec := newRecorder()
	stored := func(want int64, created int64) func() bool {
		return func() bool {
			cp, ok, _ := rec.LoadCheckpoint(IncarnationKey("DELAY"))
			return ok && cp.Offset == want && cp.Fingerprint == uint64(created)
		}
	}
	src, err := NewSource(nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop := runSource(t, src, rec)
	eventually(t, "incarnation 0 stored with no message", stored(0, src.created.Load()))
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if len(rec.seqs()) != 0 {
		t.Fatalf("handled %v, want nothing", rec.seqs())
	}
	if err := js.DeleteStream(ctxT(t), cfg.Stream); err != nil {
		t.Fatal(err)
	}
	var src2 *Source
	eventually(t, "the stream created again", func() bool {
		src2, err = NewSource(nc, cfg)
		return err == nil
	})
	runSource(t, src2, rec)
	eventually(t, "incarnation 1 stored with no message", stored(1, src2.created.Load()))
	publish(t, js, "delay.a", "new", natsgo.Header{"delay-after": {"1s"}})
	eventually(t, "1 handled", func() bool { return len(rec.seqs()) == 1 })
	if got := rec.incarnations(); !slices.Equal(got, []uint32{1}) {
		t.Fatalf("incarnations handled %v, want [1]", got)
	}
}

// The store refuses the incarnation's write at start: the source retries
// it and reads no message until it is stored (a message taken in before
// would carry an incarnation nothing records).
func TestSourceIncarnationStoreRetried(t *testing.T) {
	s := startServer(t, jsOptions(t))
	cfg := testConfig(t, serverURL(s))
	cfg.Create = true
	nc := connect(t, cfg)
	rec := newRecorder()
	rec.failCpOnly = 2
	src, err := NewSource(nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	js := newJS(t, nc)
	publish(t, js, "delay.a", "first", natsgo.Header{"delay-after": {"1s"}})
	stop := runSource(t, src, rec)
	eventually(t, "1 handled", func() bool { return len(rec.seqs()) == 1 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if rec.cpOnly < 3 || rec.failCpOnly != 0 {
		t.Fatalf("%d incarnation writes, %d refusals left; want the two refused ones retried", rec.cpOnly, rec.failCpOnly)
	}
	if rec.itemsBeforeInc {
		t.Fatal("a message was handed over before the incarnation was stored")
	}
	if off, ok := rec.cps[IncarnationKey(cfg.Stream)]; !ok || off != 0 {
		t.Fatalf("stored incarnation %d (%v), want 0", off, ok)
	}
}

func TestNextIncarnation(t *testing.T) {
	const a, b = 100, 200 // creation times
	for _, c := range []struct {
		name   string
		cp     shard.Checkpoint
		stored bool
		prev   uint32
		prevOf int64
		other  bool
		inc    uint32
		write  bool
	}{
		{name: "nothing stored, first stream", inc: 0, write: true},
		{name: "stored for this stream", cp: shard.Checkpoint{Offset: 3, Fingerprint: b}, stored: true, inc: 3},
		{name: "stored for this stream, floor of another", cp: shard.Checkpoint{Offset: 3, Fingerprint: b}, stored: true, other: true, inc: 3},
		{name: "stored for another stream", cp: shard.Checkpoint{Offset: 3, Fingerprint: a}, stored: true, inc: 4, write: true},
		{name: "stored 0 for another stream", cp: shard.Checkpoint{Offset: 0, Fingerprint: a}, stored: true, inc: 1, write: true},
		{name: "nothing stored, another stream read before", prev: 2, prevOf: a, inc: 3, write: true},
		{name: "nothing stored, this stream read before", prev: 2, prevOf: b, inc: 2, write: true},
		{name: "nothing stored, floor of another stream", other: true, inc: 1, write: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			inc, write := nextIncarnation(c.cp, c.stored, b, c.prev, c.prevOf, c.other)
			if inc != c.inc || write != c.write {
				t.Fatalf("got %d, write %v; want %d, write %v", inc, write, c.inc, c.write)
			}
		})
	}
}

// TestSourceStreamLostWithServer: the server comes back without its
// storage (or the bridge is pointed at a new cluster) and an operator has
// set up the stream and the consumer again, before the running source
// reconnects. The source must notice the new stream and read it from its
// start, not skip its first messages below the old floor.
func TestSourceStreamLostWithServer(t *testing.T) {
	setup := func(t *testing.T, js jetstream.JetStream) {
		t.Helper()
		if _, err := js.CreateStream(ctxT(t), jetstream.StreamConfig{Name: "DELAY", Subjects: []string{"delay.>"}}); err != nil {
			t.Fatal(err)
		}
		if _, err := js.CreateConsumer(ctxT(t), "DELAY", jetstream.ConsumerConfig{Durable: "bridge",
			AckPolicy: jetstream.AckExplicitPolicy, FilterSubject: "delay.>"}); err != nil {
			t.Fatal(err)
		}
	}
	opts := jsOptions(t)
	s := startServer(t, opts)
	cfg := testConfig(t, serverURL(s))
	nc := connect(t, cfg)
	setup(t, newJS(t, nc))
	src, err := NewSource(nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	runSource(t, src, rec)
	for i := range 5 {
		publish(t, newJS(t, nc), "delay.a", fmt.Sprint("old", i), nil)
	}
	eventually(t, "5 handled", func() bool { return len(rec.seqs()) == 5 })

	// The new server's storage is prepared on another port, so the
	// stream and consumer are there when the source reconnects.
	fresh := jsOptions(t)
	prep := startServer(t, fresh)
	pnc := connect(t, testConfig(t, serverURL(prep)))
	setup(t, newJS(t, pnc))
	pnc.Close()
	prep.Shutdown()
	prep.WaitForShutdown()
	port := s.Addr().(*net.TCPAddr).Port
	s.Shutdown()
	s.WaitForShutdown()
	fresh = fresh.Clone()
	fresh.Port = port
	startServer(t, fresh)

	js := newJS(t, connect(t, cfg))
	for i := range 3 {
		publishRetry(t, js, "delay.a", fmt.Sprint("new", i))
	}
	eventually(t, "the new stream's messages acked", func() bool {
		return consumerInfo(t, js, "DELAY", "bridge").AckFloor.Stream == 3
	})
	if got := rec.seqs()[5:]; !slices.Equal(got, []int64{1, 2, 3}) {
		t.Fatalf("new stream's sequences handled: %v, want [1 2 3]", got)
	}
}

// TestSourceStopNaksPrefetched: when a source stops with a batch in its
// handler, the messages its pull requests had prefetched but not handed
// out are given back at once with that batch, not after the consumer's
// AckWait (here an hour; 30 s by default, so after every restart or
// rolling update, messages due sooner fired that late), and before the
// messages the stream holds after them (README). It once handled
// "3 4 1 2 5" under CPU load: the server applies naks apart from pulls,
// and had served the restarted source's first pull before the naks; the
// source now pulls only once the server answered its last nak (see
// nakUnseen, TestUnseenRedeliveredFirst).
func TestSourceStopNaksPrefetched(t *testing.T) {
	cfg, nc, js, src := createdSource(t, func(c *Config) {
		c.BatchSize = 1
		c.AckWait = time.Hour
	})
	const n = 5
	for i := range n {
		publish(t, js, "delay.a", fmt.Sprint("m", i), nil)
	}
	first := &blocker{recorder: newRecorder(), entered: make(chan struct{}), release: make(chan struct{})}
	stop := runSource(t, src, first)
	<-first.entered
	// The pull requests ask for twice a batch: more were delivered than
	// the handler holds.
	eventually(t, "messages prefetched", func() bool {
		return consumerInfo(t, js, "DELAY", "bridge").NumAckPending > 1
	})
	if err := stop(); err != nil && !errors.Is(err, context.Canceled) {
		t.Fatalf("Run: %v", err)
	}

	again, err := NewSource(nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	second := newRecorder()
	runSource(t, again, second)
	eventually(t, "every message handled after the restart", func() bool { return len(second.seqs()) == n })
	if got := second.seqs(); !slices.Equal(got, []int64{1, 2, 3, 4, 5}) {
		t.Fatalf("handled %v after the restart, want 1..5", got)
	}
}

// TestSourceWarnsDuplicateWindow: a delay stream whose duplicate window is
// longer than MinDuplicateWindow drops replaces and cancels that repeat a
// schedule's Nats-Msg-Id (the default task id) before the bridge sees them,
// so the Source says so at start, with the window; a stream it created
// itself has the smallest window and no warning.
func TestSourceWarnsDuplicateWindow(t *testing.T) {
	for _, tc := range []struct {
		name   string
		window time.Duration // of a stream made beforehand; 0: made by the Source
		warn   bool
	}{
		{"server default", 0, false},
		{"operator stream, default window", -1, true},
		{"operator stream, 1s", time.Second, true},
		{"operator stream, 100ms", 100 * time.Millisecond, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := startServer(t, jsOptions(t))
			cfg := testConfig(t, serverURL(s))
			cfg.Create = true
			core, logs := observer.New(zap.WarnLevel)
			cfg.Logger = zap.New(core)
			nc := connect(t, cfg)
			if tc.window != 0 {
				sc := jetstream.StreamConfig{Name: "DELAY", Subjects: []string{"delay.>"}}
				if tc.window > 0 {
					sc.Duplicates = tc.window
				}
				if _, err := newJS(t, nc).CreateStream(ctxT(t), sc); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := NewSource(nc, cfg); err != nil {
				t.Fatal(err)
			}
			warned := logs.FilterMessageSnippet("duplicate window").All()
			if got := len(warned) > 0; got != tc.warn {
				t.Fatalf("warned = %v, want %v (%v)", got, tc.warn, warned)
			}
			if tc.warn {
				want := tc.window
				if want < 0 {
					want = 2 * time.Minute
				}
				if got := warned[0].ContextMap()["duplicate_window"]; got != want {
					t.Errorf("duplicate_window = %v, want %v", got, want)
				}
			}
		})
	}
}

// TestSourceCreateUnderMaxAckPendingLimit: with create, a stream, account
// or server that caps consumers' max ack pending below the bridge's
// (common on hosted NATS) still gets its consumer: the stream's cap is
// taken, and past a limit the bridge cannot read the server's default.
// Before, the server refused the consumer and the bridge did not start.
func TestSourceCreateUnderMaxAckPendingLimit(t *testing.T) {
	for _, tc := range []struct {
		name      string
		streamCap int // the stream's consumer limit; 0: the server's
		serverCap int
		want      int // the consumer's max ack pending
	}{
		{"stream limit", 700, 0, 700},
		{"server limit", 0, 500, 500},
		{"no limit", 0, 0, 20000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts := jsOptions(t)
			opts.JetStreamLimits.MaxAckPending = tc.serverCap
			s := startServer(t, opts)
			cfg := testConfig(t, serverURL(s))
			cfg.Create = true
			core, logs := observer.New(zap.WarnLevel)
			cfg.Logger = zap.New(core)
			nc := connect(t, cfg)
			js := newJS(t, nc)
			if tc.streamCap > 0 {
				if _, err := js.CreateStream(ctxT(t), jetstream.StreamConfig{
					Name: "DELAY", Subjects: []string{"delay.>"}, Retention: jetstream.WorkQueuePolicy,
					ConsumerLimits: jetstream.StreamConsumerLimits{MaxAckPending: tc.streamCap},
				}); err != nil {
					t.Fatal(err)
				}
			}
			src, err := NewSource(nc, cfg)
			if err != nil {
				t.Fatalf("NewSource: %v", err)
			}
			cons, err := js.Consumer(ctxT(t), "DELAY", cfg.Consumer)
			if err != nil {
				t.Fatal(err)
			}
			if got := cons.CachedInfo().Config.MaxAckPending; got != tc.want {
				t.Errorf("consumer max ack pending %d, want %d", got, tc.want)
			}
			// Only a limit the bridge cannot read is worth a warning.
			if got := len(logs.FilterMessageSnippet("caps max ack pending").All()) > 0; got != (tc.serverCap > 0) {
				t.Errorf("warned = %v, want %v", got, tc.serverCap > 0)
			}
			rec := newRecorder()
			runSource(t, src, rec)
			publish(t, js, "delay.a", "x", nil)
			eventually(t, "message handled", func() bool { return len(rec.seqs()) == 1 })
		})
	}
}

// TestSourceWarnsConsumerNarrowerThanSources: an operator's consumer that
// reads only part of a source subject is allowed, but what it leaves out
// the stream stores and acks to the publisher and nothing schedules, so
// the Source says so at start, naming the subjects.
func TestSourceWarnsConsumerNarrowerThanSources(t *testing.T) {
	for _, tc := range []struct {
		name   string
		filter string
		unread []string
	}{
		{"narrower", "delay.a", []string{"delay.>"}},
		{"same", "delay.>", nil},
		{"outside", "other.>", nil}, // refused: no source covers it
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := startServer(t, jsOptions(t))
			cfg := testConfig(t, serverURL(s))
			cfg.Sources = []SourceConfig{{Subject: "delay.>"}}
			core, logs := observer.New(zap.WarnLevel)
			cfg.Logger = zap.New(core)
			nc := connect(t, cfg)
			js := newJS(t, nc)
			if _, err := js.CreateStream(ctxT(t), jetstream.StreamConfig{Name: "DELAY", Subjects: []string{"delay.>", "other.>"}}); err != nil {
				t.Fatal(err)
			}
			if _, err := js.CreateOrUpdateConsumer(ctxT(t), "DELAY", jetstream.ConsumerConfig{
				Durable: cfg.Consumer, AckPolicy: jetstream.AckExplicitPolicy, FilterSubject: tc.filter,
			}); err != nil {
				t.Fatal(err)
			}
			_, err := NewSource(nc, cfg)
			if tc.filter == "other.>" {
				if !errors.Is(err, ErrConfig) {
					t.Fatalf("NewSource = %v, want ErrConfig", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("NewSource: %v", err)
			}
			warned := logs.FilterMessageSnippet("does not read all").All()
			if got := len(warned) > 0; got != (tc.unread != nil) {
				t.Fatalf("warned = %v, want %v", warned, tc.unread != nil)
			}
			if tc.unread != nil {
				if got := fmt.Sprint(warned[0].ContextMap()["source_subjects"]); got != fmt.Sprint(tc.unread) {
					t.Errorf("source_subjects = %s, want %v", got, tc.unread)
				}
			}
		})
	}
}
