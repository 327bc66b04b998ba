package nats

import (
	"slices"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// TestSourceWarnsSourcedStreamTime: delay-after counts from the JetStream
// stored time (CONTRACT §1), and a delay stream that sources other streams
// (a hub) stores each sourced message at the time it sources it, not at
// its publish time, while a mirror keeps the origin's time. So a sourcing
// lag (an edge cut off from the hub) delays the tasks of every message it
// held by as much, with nothing at the bridge to tell: the Source says so
// at start, naming the streams sourced; a mirror or a plain stream gets no
// warning. The first part shows the server's behaviour the warning is
// about.
func TestSourceWarnsSourcedStreamTime(t *testing.T) {
	s := startServer(t, jsOptions(t))
	cfg := testConfig(t, serverURL(s))
	cfg.Create = true
	nc := connect(t, cfg)
	js := newJS(t, nc)
	if _, err := js.CreateStream(ctxT(t), jetstream.StreamConfig{Name: "EDGE", Subjects: []string{"edge.>"}}); err != nil {
		t.Fatal(err)
	}
	pub, err := js.PublishMsg(ctxT(t), &natsgo.Msg{Subject: "edge.x", Data: []byte("v"), Header: natsgo.Header{"delay-after": {"10s"}}})
	if err != nil {
		t.Fatal(err)
	}
	edge, err := js.Stream(ctxT(t), "EDGE")
	if err != nil {
		t.Fatal(err)
	}
	orig, err := edge.GetMsg(ctxT(t), pub.Sequence)
	if err != nil {
		t.Fatal(err)
	}
	// The edge cut off from the hub for a while: a lower bound, waited
	// for, not a timed assertion.
	for time.Since(orig.Time) < 300*time.Millisecond {
		time.Sleep(20 * time.Millisecond)
	}
	stored := map[string]time.Time{}
	for _, sc := range []jetstream.StreamConfig{
		{Name: "DELAY", Subjects: []string{"delay.>"}, Sources: []*jetstream.StreamSource{{Name: "EDGE"}}},
		{Name: "MIRROR", Mirror: &jetstream.StreamSource{Name: "EDGE"}},
	} {
		st, err := js.CreateStream(ctxT(t), sc)
		if err != nil {
			t.Fatal(err)
		}
		for deadline := time.Now().Add(10 * time.Second); ; {
			if m, err := st.GetMsg(ctxT(t), 1); err == nil {
				stored[sc.Name] = m.Time
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s holds no message", sc.Name)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	if lag := stored["DELAY"].Sub(orig.Time); lag < 300*time.Millisecond {
		t.Fatalf("the sourcing stream stored the message %v after the edge: JetStream no longer restamps sourced messages, drop the warning", lag)
	}
	if !stored["MIRROR"].Equal(orig.Time) {
		t.Fatalf("the mirror stored the message at %v, the edge at %v", stored["MIRROR"], orig.Time)
	}

	for _, tc := range []struct {
		stream string
		warn   bool
	}{{"DELAY", true}, {"MIRROR", false}, {"EDGE", false}} {
		t.Run(tc.stream, func(t *testing.T) {
			c := cfg
			core, logs := observer.New(zap.WarnLevel)
			c.Logger = zap.New(core)
			c.Stream, c.Consumer, c.Create = tc.stream, "bridge-"+tc.stream, tc.stream != "MIRROR"
			if tc.stream == "EDGE" {
				c.Sources = []SourceConfig{{Subject: "edge.>", Rules: c.Sources[0].Rules}}
			}
			if tc.stream == "MIRROR" {
				// A mirror takes no subjects; the bridge reads it through
				// a consumer of the operator's, filtered on the sources.
				if _, err := js.CreateOrUpdateConsumer(ctxT(t), "MIRROR", jetstream.ConsumerConfig{
					Durable: c.Consumer, AckPolicy: jetstream.AckExplicitPolicy, FilterSubject: c.Sources[0].Subject}); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := NewSource(nc, c); err != nil {
				t.Fatal(err)
			}
			warned := logs.FilterMessageSnippet("sources other streams").All()
			if got := len(warned) > 0; got != tc.warn {
				t.Fatalf("warned = %v, want %v (%v)", got, tc.warn, logs.All())
			}
			if tc.warn {
				if got, _ := warned[0].ContextMap()["sourced_streams"].([]any); !slices.Equal(got, []any{"EDGE"}) {
					t.Errorf("sourced_streams = %v, want [EDGE]", warned[0].ContextMap()["sourced_streams"])
				}
			}
		})
	}
}
