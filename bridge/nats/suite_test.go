package nats

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/delaybridge/delaybridge/bridge"
	"github.com/delaybridge/delaybridge/bridge/bridgetest"
	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/shard"
)

// natsBroker runs the shared adapter suite on an in-process nats-server.
// A delay source is a stream "DS<n>" on subjects "ds<n>.>"; a target is the
// subject "tg<n>.out" of a stream "TG<n>".
type natsBroker struct {
	s   *server.Server
	nc  *natsgo.Conn
	js  jetstream.JetStream
	seq atomic.Int64
}

var _ bridgetest.Broker = (*natsBroker)(nil)

func TestAdapterSuite(t *testing.T) {
	s := startServer(t, jsOptions(t))
	nc := connect(t, testConfig(t, serverURL(s)))
	bridgetest.Run(t, &natsBroker{s: s, nc: nc, js: newJS(t, nc)})
}

func (b *natsBroker) Transport() codec.Transport { return codec.TransportNATS }

func (b *natsBroker) stream(t testing.TB, prefix string) (name, subjects string) {
	t.Helper()
	n := b.seq.Add(1)
	name, subjects = fmt.Sprintf("%s%d", prefix, n), fmt.Sprintf("%s%d.>", lower(prefix), n)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// Limits retention: several consumers (groups) may read one stream.
	if _, err := b.js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{subjects}}); err != nil {
		t.Fatalf("create stream %s: %v", name, err)
	}
	return name, subjects
}

func lower(s string) string {
	out := []byte(s)
	for i, c := range out {
		if 'A' <= c && c <= 'Z' {
			out[i] = c + 'a' - 'A'
		}
	}
	return string(out)
}

func (b *natsBroker) NewDelaySource(t testing.TB) string {
	name, _ := b.stream(t, "DS")
	return name
}

func (b *natsBroker) NewTarget(t testing.TB) string {
	_, subjects := b.stream(t, "TG")
	return subjects[:len(subjects)-1] + "out"
}

func (b *natsBroker) sourceSubjects(stream string) string { return lower(stream) + ".>" }

func (b *natsBroker) Publish(t testing.TB, source string, m bridgetest.Msg) {
	t.Helper()
	msg := &natsgo.Msg{Subject: lower(source) + ".msg", Data: m.Value, Header: natsgo.Header{}}
	for _, h := range m.Headers {
		msg.Header.Add(h.Key, string(h.Value)) // NATS has no key: m.Key is not sent
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := b.js.PublishMsg(ctx, msg); err != nil {
		t.Fatalf("publish to %s: %v", source, err)
	}
}

func (b *natsBroker) NewSource(t testing.TB, source, group string, rules *codec.Rules) bridge.Source {
	t.Helper()
	cfg := testConfig(t, serverURL(b.s))
	cfg.Stream, cfg.Consumer, cfg.Create = source, group, true
	cfg.Sources = []SourceConfig{{Subject: b.sourceSubjects(source), Rules: rules}}
	s, err := NewSource(b.nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func (b *natsBroker) NewSink(t testing.TB) shard.Sink {
	t.Helper()
	s, err := NewSink(b.nc, testConfig(t, serverURL(b.s)))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func (b *natsBroker) Consume(t testing.TB, target string, n int) []bridgetest.Msg {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stream, err := b.js.StreamNameBySubject(ctx, target)
	if err != nil {
		t.Fatalf("stream of %s: %v", target, err)
	}
	c, err := b.js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{FilterSubjects: []string{target}})
	if err != nil {
		t.Fatal(err)
	}
	var out []bridgetest.Msg
	for len(out) < n {
		batch, err := c.Fetch(n-len(out), jetstream.FetchContext(ctx))
		if err != nil {
			t.Fatalf("fetch from %s: %v", target, err)
		}
		for m := range batch.Messages() {
			out = append(out, bridgetest.Msg{Value: m.Data(), Headers: headersIn(m.Headers())})
		}
		if err := batch.Error(); err != nil && ctx.Err() != nil {
			t.Fatalf("consumed %d of %d from %s: %v", len(out), n, target, err)
		}
	}
	return out
}
