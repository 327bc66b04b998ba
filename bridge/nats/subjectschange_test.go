package nats

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// handledValues are the values of the messages r was handed.
func (r *recorder) handledValues() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, it := range r.items {
		out = append(out, string(it.Msg.Value))
	}
	return out
}

// The source subjects narrowed and then widened again across restarts,
// with nats.create: the bridge adds subjects to the stream and never takes
// any away, so a message published on a subject dropped from the sources
// is stored (and acknowledged to its publisher) but not read. JetStream
// does not rewind a consumer whose filters change: once the subject is a
// source again, the updated consumer had passed that message and never
// delivered it, with nothing logged. Now the narrowed start warns that the
// stream captures subjects no source reads, and the widened one creates
// the work-queue consumer again so it delivers what the stream held.
func TestSourcesWidenedReadWhatTheStreamHeld(t *testing.T) {
	s := startServer(t, jsOptions(t))
	core, logs := observer.New(zap.WarnLevel)
	newSrc := func(subject string) *Source { return subjectSource(t, s, core, subject) }
	r := newRecorder()
	stop := runSource(t, newSrc("delay.>"), r)
	js := newJS(t, connect(t, testConfig(t, serverURL(s))))
	publish(t, js, "delay.a.1", "a1", nil)
	eventually(t, "a1 handled", func() bool { return len(r.handledValues()) == 1 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}

	// Narrowed: the stream still captures delay.>.
	stop = runSource(t, newSrc("delay.a.>"), r)
	if n := logs.FilterMessageSnippet("the stream captures subjects that no source reads").Len(); n != 1 {
		t.Fatalf("%d warnings about the stream's unread subjects, want 1", n)
	}
	publish(t, js, "delay.b.1", "b1", nil) // stored, acknowledged, not read
	publish(t, js, "delay.a.2", "a2", nil)
	eventually(t, "a2 handled", func() bool { return len(r.handledValues()) == 2 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}

	// Widened again: b1 is read.
	stop = runSource(t, newSrc("delay.>"), r)
	eventually(t, "b1 handled", func() bool { return slices.Contains(r.handledValues(), "b1") })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if got, want := r.handledValues(), []string{"a1", "a2", "b1"}; !slices.Equal(got, want) {
		t.Fatalf("handled %v, want %v", got, want)
	}
	if n := logs.FilterMessageSnippet("created it again from the start of the work queue").Len(); n != 1 {
		t.Fatalf("%d logs of the consumer created again, want 1", n)
	}
}

// nats.consumer renamed with nats.create on the work-queue stream the
// bridge made: JetStream refuses a second consumer on the same subjects.
// The start fails as before, but the error names the consumer in the way
// and the remedy, not only the server's "filtered consumer not unique".
func TestConsumerRenamedOnWorkQueue(t *testing.T) {
	_, nc, _, _ := createdSource(t, nil) // stream DELAY, consumer "bridge"
	cfg := testConfig(t, nc.ConnectedUrl())
	cfg.Create, cfg.Consumer = true, "bridge2"
	_, err := NewSource(connect(t, cfg), cfg)
	if !errors.Is(err, ErrConfig) {
		t.Fatalf("renamed consumer: %v, want ErrConfig", err)
	}
	for _, want := range []string{`nats.consumer "bridge2"`, "[bridge]", "nats consumer rm DELAY bridge", "filtered consumer not unique"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	var api *jetstream.APIError
	if !errors.As(err, &api) {
		t.Errorf("error %v does not wrap the server's", err)
	}
}

// The same widening on a stream that is not a work queue (an operator's,
// with nats.create): a new consumer would deliver every message the
// stream keeps, so the consumer is only updated, and the range it passed
// on the gained subjects is logged as an error with the remedies.
func TestSourcesWidenedOnLimitsStreamLogged(t *testing.T) {
	s := startServer(t, jsOptions(t))
	js := newJS(t, connect(t, testConfig(t, serverURL(s))))
	if _, err := js.CreateStream(ctxT(t), jetstream.StreamConfig{Name: "DELAY", Subjects: []string{"delay.>"}}); err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.WarnLevel)
	newSrc := func(subject string) *Source { return subjectSource(t, s, core, subject) }
	r := newRecorder()
	stop := runSource(t, newSrc("delay.a.>"), r)
	publish(t, js, "delay.b.1", "b1", nil)
	publish(t, js, "delay.a.1", "a1", nil)
	eventually(t, "a1 handled", func() bool { return len(r.handledValues()) == 1 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	_ = newSrc("delay.>")
	l := logs.FilterMessageSnippet("JetStream does not rewind a consumer").All()
	if len(l) != 1 || l[0].Level != zap.ErrorLevel {
		t.Fatalf("logged %+v, want one error about the passed messages", l)
	}
	if ci := consumerInfo(t, js, "DELAY", "bridge"); !slices.Equal(ci.Config.FilterSubjects, []string{"delay.>"}) || ci.Delivered.Stream != 2 {
		t.Fatalf("consumer %v at %d, want it updated to delay.> and left at 2", ci.Config.FilterSubjects, ci.Delivered.Stream)
	}
}

// subjectSource is a create: true source on s reading subject, logging to
// core.
func subjectSource(t *testing.T, s *server.Server, core zapcore.Core, subject string) *Source {
	t.Helper()
	cfg := testConfig(t, serverURL(s))
	cfg.Create, cfg.Sources, cfg.Logger = true, []SourceConfig{{Subject: subject}}, zap.New(core)
	src, err := NewSource(connect(t, cfg), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return src
}

// TestStreamRenamedWithCreate: nats.stream renamed with nats.create while
// the old stream still captures the delay subjects. The server refuses
// the new stream ("subjects overlap with an existing stream"), and that
// text alone named neither the stream holding the subjects nor the key
// to change (hunt H157). The error now names both, and what to do.
func TestStreamRenamedWithCreate(t *testing.T) {
	_, nc, _, _ := createdSource(t, nil) // stream DELAY on delay.>
	cfg := testConfig(t, nc.ConnectedUrl())
	cfg.Create, cfg.Stream = true, "DELAY2"
	_, err := NewSource(connect(t, cfg), cfg)
	if !errors.Is(err, ErrConfig) {
		t.Fatalf("renamed stream: %v, want ErrConfig", err)
	}
	for _, want := range []string{`nats.stream "DELAY2"`, `stream "DELAY"`, "[delay.>]", "pending tasks are kept", "subjects overlap"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	var api *jetstream.APIError
	if !errors.As(err, &api) {
		t.Errorf("error %v does not wrap the server's", err)
	}
}
