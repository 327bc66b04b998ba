package nats

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/shard"
)

// fakeJS answers the Sink's JetStream publishes and stream lookups as the
// test says; core publishes go to the real connection.
type fakeJS struct {
	jetstream.JetStream // other methods are not used by the Sink

	mu      sync.Mutex
	answer  func(subject string) (*jetstream.PubAck, error) // nil, nil: no answer ever
	lookup  func(subject string) (string, error)
	pubs    int
	lookups int
}

type fakeFuture struct {
	ok  chan *jetstream.PubAck
	err chan error
	msg *natsgo.Msg
}

func (f *fakeFuture) Ok() <-chan *jetstream.PubAck { return f.ok }
func (f *fakeFuture) Err() <-chan error            { return f.err }
func (f *fakeFuture) Msg() *natsgo.Msg             { return f.msg }

func (f *fakeJS) PublishMsgAsync(m *natsgo.Msg, _ ...jetstream.PublishOpt) (jetstream.PubAckFuture, error) {
	f.mu.Lock()
	f.pubs++
	f.mu.Unlock()
	pa, err := f.answer(m.Subject)
	if errors.Is(err, natsgo.ErrConnectionReconnecting) {
		return nil, err // refused by the library at once
	}
	fut := &fakeFuture{ok: make(chan *jetstream.PubAck, 1), err: make(chan error, 1), msg: m}
	switch {
	case err != nil:
		fut.err <- err
	case pa != nil:
		fut.ok <- pa
	}
	return fut, nil
}

// Stream: the fake knows streams by name only (StreamNameBySubject), not
// their configuration, so none is no_ack.
func (f *fakeJS) Stream(context.Context, string) (jetstream.Stream, error) {
	return nil, jetstream.ErrStreamNotFound
}

func (f *fakeJS) StreamNameBySubject(_ context.Context, subject string) (string, error) {
	f.mu.Lock()
	f.lookups++
	f.mu.Unlock()
	return f.lookup(subject)
}

func (f *fakeJS) counts() (pubs, lookups int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.pubs, f.lookups
}

var (
	errStreamFull   = &jetstream.APIError{Code: 503, ErrorCode: 10077, Description: "maximum messages exceeded"}
	errWrongLastSeq = &jetstream.APIError{Code: 400, ErrorCode: jetstream.JSErrCodeStreamWrongLastSequence, Description: "wrong last sequence: 4"}
	errJS503        = &jetstream.APIError{Code: 503, ErrorCode: 10008, Description: "JetStream system temporarily unavailable"}
	errNoPermission = errors.New("nats: timeout") // what a denied request looks like
)

// TestSinkVerdicts: how Deliver classifies what JetStream answered. Every
// subject is published with JetStream first; core NATS only where the
// server confirms no stream captures it, and only for targets with
// CoreTargets (otherwise ErrNoTargetStream, the task's own failure). What a
// working server would do later is an outage (shard.ErrUnavailable: the
// engine retries without charging an attempt); what the stream refuses is
// the task's own failure.
func TestSinkVerdicts(t *testing.T) {
	ack := &jetstream.PubAck{Stream: "OUT", Sequence: 1}
	noStream := func(string) (string, error) { return "", jetstream.ErrStreamNotFound }
	stream := func(string) (string, error) { return "OUT", nil }
	for _, c := range []struct {
		name    string
		answer  func(deliver int) (*jetstream.PubAck, error) // deliver counts from 0
		lookup  func(string) (string, error)
		deliver int  // Deliver calls, one task each
		core    bool // Config.CoreTargets
		dead    bool // the tasks are dead letters

		wantErr         error // of the last Deliver; nil: delivered
		wantUnavailable bool
		wantBestEffort  float64
		wantPubs        int // JetStream publishes, all Delivers
		wantLookups     int
	}{
		{name: "PubAck", answer: func(int) (*jetstream.PubAck, error) { return ack, nil }, lookup: stream,
			deliver: 2, wantPubs: 2},
		{name: "no responders, no stream, core_targets: core NATS, then directly for NoStreamTTL",
			answer: func(int) (*jetstream.PubAck, error) { return nil, jetstream.ErrNoStreamResponse }, lookup: noStream,
			deliver: 3, core: true, wantBestEffort: 3, wantPubs: 1, wantLookups: 1},
		{name: "no responders, no stream: the task's failure, then at once for NoStreamTTL",
			answer: func(int) (*jetstream.PubAck, error) { return nil, jetstream.ErrNoStreamResponse }, lookup: noStream,
			deliver: 3, wantErr: ErrNoTargetStream, wantPubs: 1, wantLookups: 1},
		{name: "dead letter, no responders, no stream, core_targets: never core NATS",
			answer: func(int) (*jetstream.PubAck, error) { return nil, jetstream.ErrNoStreamResponse }, lookup: noStream,
			deliver: 3, core: true, dead: true, wantErr: ErrNoTargetStream, wantPubs: 1, wantLookups: 1},
		{name: "no responders, a stream captures the subject (leader election)",
			answer: func(int) (*jetstream.PubAck, error) { return nil, jetstream.ErrNoStreamResponse }, lookup: stream,
			deliver: 1, wantErr: jetstream.ErrNoStreamResponse, wantUnavailable: true, wantPubs: 1, wantLookups: 1},
		{name: "no responders, lookup fails (no permission): waits; the failure is kept",
			answer:  func(int) (*jetstream.PubAck, error) { return nil, jetstream.ErrNoStreamResponse },
			lookup:  func(string) (string, error) { return "", errNoPermission },
			deliver: 3, wantErr: errNoPermission, wantUnavailable: true, wantPubs: 3, wantLookups: 1},
		{name: "no responders right after a stream acknowledged the subject",
			answer: func(d int) (*jetstream.PubAck, error) {
				if d == 0 {
					return ack, nil
				}
				return nil, jetstream.ErrNoStreamResponse
			}, lookup: noStream, // a mapped subject: the lookup cannot see its stream
			deliver: 2, wantErr: jetstream.ErrNoStreamResponse, wantUnavailable: true, wantPubs: 2},
		{name: "no PubAck, no stream, core_targets: core subscribers got it",
			answer: func(int) (*jetstream.PubAck, error) { return nil, nil }, lookup: noStream,
			deliver: 2, core: true, wantBestEffort: 2, wantPubs: 1, wantLookups: 1},
		{name: "no PubAck, no stream: the task's failure",
			answer: func(int) (*jetstream.PubAck, error) { return nil, nil }, lookup: noStream,
			deliver: 2, wantErr: ErrNoTargetStream, wantPubs: 1, wantLookups: 1},
		{name: "dead letter, no PubAck, no stream, core_targets: never core NATS",
			answer: func(int) (*jetstream.PubAck, error) { return nil, nil }, lookup: noStream,
			deliver: 2, core: true, dead: true, wantErr: ErrNoTargetStream, wantPubs: 1, wantLookups: 1},
		{name: "a core service answered, no stream, core_targets",
			answer: func(int) (*jetstream.PubAck, error) { return nil, jetstream.ErrInvalidJSAck }, lookup: noStream,
			deliver: 1, core: true, wantBestEffort: 1, wantPubs: 1, wantLookups: 1},
		{name: "a core service answered, no stream",
			answer: func(int) (*jetstream.PubAck, error) { return nil, jetstream.ErrInvalidJSAck }, lookup: noStream,
			deliver: 1, wantErr: ErrNoTargetStream, wantPubs: 1, wantLookups: 1},
		{name: "no PubAck in time from a stream",
			answer: func(int) (*jetstream.PubAck, error) { return nil, nil }, lookup: stream,
			deliver: 1, wantErr: ErrPublishTimeout, wantUnavailable: true, wantPubs: 1, wantLookups: 1},
		{name: "no PubAck in time, lookup fails",
			answer:  func(int) (*jetstream.PubAck, error) { return nil, nil },
			lookup:  func(string) (string, error) { return "", errNoPermission },
			deliver: 1, wantErr: ErrPublishTimeout, wantUnavailable: true, wantPubs: 1, wantLookups: 1},
		// A stream acknowledged the subject: later timeouts are an outage
		// (a no_ack stream never acknowledges), with no lookups.
		{name: "PubAck timeouts right after a stream acknowledged the subject",
			answer: func(d int) (*jetstream.PubAck, error) {
				if d == 0 {
					return ack, nil
				}
				return nil, jetstream.ErrAsyncPublishTimeout
			}, lookup: stream,
			deliver: 3, wantErr: jetstream.ErrAsyncPublishTimeout, wantUnavailable: true, wantPubs: 3},
		// A PubAck timeout asks which stream captures the subject, to
		// tell a no_ack stream (never acknowledges) from an outage.
		{name: "library publish timeout",
			answer: func(int) (*jetstream.PubAck, error) { return nil, jetstream.ErrAsyncPublishTimeout }, lookup: stream,
			deliver: 1, wantErr: jetstream.ErrAsyncPublishTimeout, wantUnavailable: true, wantPubs: 1, wantLookups: 1},
		{name: "connection reconnecting",
			answer: func(int) (*jetstream.PubAck, error) { return nil, natsgo.ErrConnectionReconnecting }, lookup: stream,
			deliver: 1, wantErr: natsgo.ErrConnectionReconnecting, wantUnavailable: true, wantPubs: 1},
		{name: "JetStream 503",
			answer: func(int) (*jetstream.PubAck, error) { return nil, errJS503 }, lookup: stream,
			deliver: 1, wantErr: errJS503, wantUnavailable: true, wantPubs: 1},
		{name: "stream full (DiscardNew)",
			answer: func(int) (*jetstream.PubAck, error) { return nil, errStreamFull }, lookup: stream,
			deliver: 1, wantErr: errStreamFull, wantPubs: 1},
		{name: "wrong expected last sequence",
			answer: func(int) (*jetstream.PubAck, error) { return nil, errWrongLastSeq }, lookup: stream,
			deliver: 1, wantErr: errWrongLastSeq, wantPubs: 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := startServer(t, jsOptions(t))
			cfg := testConfig(t, serverURL(s))
			cfg.PublishTimeout = 300 * time.Millisecond
			cfg.CoreTargets = c.core
			nc := connect(t, cfg)
			sink := newSink(t, nc, cfg)
			now := time.Unix(1000, 0)
			sink.now = func() time.Time { return now }
			sink.probeWait = 20 * time.Millisecond
			d := 0
			fake := &fakeJS{answer: func(string) (*jetstream.PubAck, error) { return c.answer(d) }, lookup: c.lookup}
			sink.js = fake
			var errs []error
			for ; d < c.deliver; d++ {
				tk := task(fmt.Sprint("id-", d), "out.x", "v", 0)
				if c.dead {
					tk.Kind = codec.KindDeadLetter
				}
				errs = sink.Deliver(ctxT(t), []*codec.Task{tk})
				now = now.Add(time.Second) // well within NoStreamTTL
			}
			switch {
			case c.wantErr == nil && errs != nil:
				t.Fatalf("errs = %v, want delivered", errs)
			case c.wantErr != nil && (len(errs) != 1 || !errors.Is(errs[0], c.wantErr)):
				t.Fatalf("errs = %v, want %v", errs, c.wantErr)
			case c.wantErr != nil && errors.Is(errs[0], shard.ErrUnavailable) != c.wantUnavailable:
				t.Fatalf("errs = %v, unavailable %v, want %v", errs, !c.wantUnavailable, c.wantUnavailable)
			}
			if got := counterValue(t, cfg.Metrics.BestEffort.WithLabelValues("nats")); got != c.wantBestEffort {
				t.Errorf("best effort = %v, want %v", got, c.wantBestEffort)
			}
			if pubs, lookups := fake.counts(); pubs != c.wantPubs || lookups != c.wantLookups {
				t.Errorf("%d JetStream publishes, %d stream lookups; want %d, %d", pubs, lookups, c.wantPubs, c.wantLookups)
			}
		})
	}
}

// configServer starts a server from a configuration file's text.
func configServer(t *testing.T, conf string) *server.Server {
	t.Helper()
	dir := t.TempDir()
	path := dir + "/server.conf"
	conf = "listen: 127.0.0.1:-1\njetstream { store_dir: \"" + dir + "/js\" }\n" + conf
	if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	opts, err := server.ProcessConfigFile(path)
	if err != nil {
		t.Fatal(err)
	}
	opts.NoLog, opts.NoSigs = true, true
	return startServer(t, opts)
}

// TestSinkStreamBehindMapping: a stream the account's stream subjects do
// not show (a subject mapping, a stream of another account imported as a
// service) still gets JetStream publishes: a PubAck is waited for and a
// refusal is the task's failure, not a silent core publish.
func TestSinkStreamBehindMapping(t *testing.T) {
	for _, c := range []struct {
		name           string
		conf           string
		user, password string // the bridge's
		streamUser     string // the account of the stream
		target         string
		streamSubject  string
	}{
		{
			name:   "subject mapping",
			conf:   `mappings { "orders.*": "orders.v2.{{wildcard(1)}}" }`,
			target: "orders.a", streamSubject: "orders.v2.>",
		},
		{
			name: "stream of another account",
			conf: `accounts {
  STORE: { jetstream: enabled, users: [{user: store, password: s}], exports: [{service: "ev.>"}] }
  BRIDGE: { jetstream: enabled, users: [{user: bridge, password: b}], imports: [{service: {account: STORE, subject: "ev.>"}}] }
}`,
			user: "bridge", password: "b", streamUser: "store",
			target: "ev.a", streamSubject: "ev.>",
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := configServer(t, c.conf)
			scfg := testConfig(t, serverURL(s))
			if c.streamUser != "" {
				scfg.User, scfg.Password = c.streamUser, "s"
			}
			st, err := newJS(t, connect(t, scfg)).CreateStream(ctxT(t), jetstream.StreamConfig{
				Name: "STORE", Subjects: []string{c.streamSubject}, MaxMsgs: 1, Discard: jetstream.DiscardNew})
			if err != nil {
				t.Fatal(err)
			}
			cfg := testConfig(t, serverURL(s))
			cfg.User, cfg.Password = c.user, c.password
			sink := newSink(t, connect(t, cfg), cfg)
			if errs := sink.Deliver(ctxT(t), []*codec.Task{task("id-1", c.target, "v", 0)}); errs != nil {
				t.Fatalf("deliver: %v", errs)
			}
			// The stream is full now: it refuses the next one.
			errs := sink.Deliver(ctxT(t), []*codec.Task{task("id-2", c.target, "v", 0)})
			if len(errs) != 1 || errs[0] == nil || errors.Is(errs[0], shard.ErrUnavailable) {
				t.Fatalf("errs = %v, want the stream's refusal", errs)
			}
			info, err := st.Info(ctxT(t))
			if err != nil {
				t.Fatal(err)
			}
			if got := counterValue(t, cfg.Metrics.BestEffort.WithLabelValues("nats")); info.State.Msgs != 1 || got != 0 {
				t.Errorf("stream holds %d, best effort %v; want 1, 0", info.State.Msgs, got)
			}
		})
	}
}

// TestSinkWithoutStreamLookupPermission: a least-privilege user that may
// publish to its targets but not list or look up streams. Stream targets
// are delivered without any lookup (so within the PubAck budget, and
// without asking again at every Deliver). A subject no stream answers
// cannot be told from a stream in a leader election: it waits (an outage,
// no attempt charged) with an error naming the permission, and the failed
// lookup is not repeated for NoStreamTTL.
func TestSinkWithoutStreamLookupPermission(t *testing.T) {
	s := configServer(t, `accounts { A { jetstream: enabled, users: [
  {user: admin, password: a},
  {user: bridge, password: b, permissions: { publish: { allow: [">"], deny: ["$JS.API.STREAM.LIST", "$JS.API.STREAM.NAMES"] } } }
] } }`)
	acfg := testConfig(t, serverURL(s))
	acfg.User, acfg.Password = "admin", "a"
	st, err := newJS(t, connect(t, acfg)).CreateStream(ctxT(t), jetstream.StreamConfig{Name: "OUT", Subjects: []string{"out.>"}})
	if err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(t, serverURL(s))
	cfg.User, cfg.Password = "bridge", "b"
	cfg.PublishTimeout = time.Second
	nc := connect(t, cfg)
	sink := newSink(t, nc, cfg)
	out := func() uint64 { return nc.Stats().OutMsgs }

	for i := range 3 {
		before := out()
		if errs := sink.Deliver(ctxT(t), []*codec.Task{task(fmt.Sprint("id-", i), "out.x", "v", 0)}); errs != nil {
			t.Fatalf("deliver %d to a stream: %v", i, errs)
		}
		if n := out() - before; n != 1 {
			t.Fatalf("deliver %d sent %d messages; want the publish only, no stream listing", i, n)
		}
	}
	if info, err := st.Info(ctxT(t)); err != nil || info.State.Msgs != 3 {
		t.Fatalf("stream: %v %v", info, err)
	}

	for i, subj := range []string{"nostream.a", "nostream.b"} {
		before := out()
		errs := sink.Deliver(ctxT(t), []*codec.Task{task("core", subj, "v", 0)})
		if len(errs) != 1 || !errors.Is(errs[0], shard.ErrUnavailable) || !strings.Contains(errs[0].Error(), "$JS.API.STREAM.NAMES") {
			t.Fatalf("deliver to %s: %v; want unavailable, naming the permission", subj, errs)
		}
		if want := uint64(2 - i); out()-before != want { // the second has the failed lookup kept
			t.Fatalf("deliver to %s sent %d messages, want %d", subj, out()-before, want)
		}
	}
	if got := counterValue(t, cfg.Metrics.BestEffort.WithLabelValues("nats")); got != 0 {
		t.Errorf("best effort = %v", got)
	}
}

// deniedSecretConfig starts a server with streams SECRET (secret.>) and
// OPEN (open.>) and returns the config of a user who may publish to
// everything but secret.>.
func deniedSecretConfig(t *testing.T) Config {
	t.Helper()
	s := configServer(t, `accounts { A { jetstream: enabled, users: [
  {user: admin, password: a},
  {user: bridge, password: b, permissions: { publish: { allow: [">"], deny: ["secret.>"] } } }
] } }`)
	acfg := testConfig(t, serverURL(s))
	acfg.User, acfg.Password = "admin", "a"
	ajs := newJS(t, connect(t, acfg))
	for _, st := range []jetstream.StreamConfig{{Name: "SECRET", Subjects: []string{"secret.>"}}, {Name: "OPEN", Subjects: []string{"open.>"}}} {
		if _, err := ajs.CreateStream(ctxT(t), st); err != nil {
			t.Fatal(err)
		}
	}
	cfg := testConfig(t, serverURL(s))
	cfg.User, cfg.Password = "bridge", "b"
	return cfg
}

// TestSinkPublishDenied: a target subject the bridge's user may not publish
// to gets no PubAck (nats.go passes the server's permissions error to the
// async handler only). That is the task's failure, charged an attempt and
// publish-failed at the end of the retry policy, not an outage retried
// forever without one. A permitted subject in the same batch is delivered,
// and the connection's own async error handler still sees the error.
func TestSinkPublishDenied(t *testing.T) {
	cfg := deniedSecretConfig(t)
	cfg.PublishTimeout = time.Second
	nc := connect(t, cfg)
	var seen atomic.Int32
	nc.SetErrorHandler(func(_ *natsgo.Conn, _ *natsgo.Subscription, err error) {
		if errors.Is(err, natsgo.ErrPermissionViolation) {
			seen.Add(1)
		}
	})
	sink := newSink(t, nc, cfg)
	for try := range 2 {
		errs := sink.Deliver(ctxT(t), []*codec.Task{task("x", "secret.x", "v", 0), task("y", "open.y", "v", 0)})
		if errs == nil || errs[0] == nil {
			t.Fatalf("try %d: the denied publish succeeded", try)
		}
		if errors.Is(errs[0], shard.ErrUnavailable) || !errors.Is(errs[0], natsgo.ErrPermissionViolation) {
			t.Fatalf("try %d: %v, want a permissions failure, not an outage", try, errs[0])
		}
		if errs[1] != nil {
			t.Fatalf("try %d: the permitted subject failed too: %v", try, errs[1])
		}
	}
	if seen.Load() == 0 {
		t.Error("the connection's own async error handler no longer sees the error")
	}
}

// TestNoteAsyncError reads the subject of the server's permissions error,
// which quotes it Go-style: subjects with quotes, backslashes or
// non-printable characters are escaped there.
func TestNoteAsyncError(t *testing.T) {
	at := time.Unix(1_800_000_000, 0)
	for _, c := range []struct {
		name, text, subject string
		denied              bool
	}{
		{"plain", `Permissions Violation for Publish to "secret.x"`, "secret.x", true},
		{"quote", `Permissions Violation for Publish to "secret.a\"b"`, `secret.a"b`, true},
		{"backslash", `Permissions Violation for Publish to "secret.a\\b"`, `secret.a\b`, true},
		{"no-break space", `Permissions Violation for Publish to "secret.a\u00a0b"`, "secret.a\u00a0b", true},
		{"subscribe", `Permissions Violation for Subscription to "secret.x"`, "secret.x", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := &Sink{denied: map[string]time.Time{}, now: func() time.Time { return at }}
			s.noteAsyncError(fmt.Errorf("%w: %s", natsgo.ErrPermissionViolation, c.text))
			if got := s.deniedSince(c.subject, at); got != c.denied {
				t.Fatalf("deniedSince(%q) = %v after %s, want %v", c.subject, got, c.text, c.denied)
			}
		})
	}
}

// TestSinkRefusesOverlongSubject: a task stored before Parse bounded NATS
// subjects fails alone, not as an outage, and is never published (the
// server would close the connection the source shares).
func TestSinkRefusesOverlongSubject(t *testing.T) {
	cfg, nc, _ := outServer(t)
	sink := newSink(t, nc, cfg)
	long := "out." + strings.Repeat("x", codec.MaxSubjectLen)
	errs := sink.Deliver(ctxT(t), []*codec.Task{task("x", long, "v", 0), task("y", "out.y", "v", 0)})
	if errs == nil || errs[0] == nil || errors.Is(errs[0], shard.ErrUnavailable) {
		t.Fatalf("overlong subject: %v, want a failure of its own", errs)
	}
	if errs[1] != nil {
		t.Fatalf("the other task failed too: %v", errs[1])
	}
	if !nc.IsConnected() {
		t.Fatal("the connection was closed")
	}
}

// TestSinkNoAckStream: a stream with no_ack stores publishes but never
// acknowledges them. A task aimed at it is the task's failure (charged an
// attempt, publish-failed at the end of the retries), not an outage
// retried, and stored again, forever.
func TestSinkNoAckStream(t *testing.T) {
	s := startServer(t, jsOptions(t))
	cfg := testConfig(t, serverURL(s))
	cfg.PublishTimeout = time.Second
	nc := connect(t, cfg)
	js := newJS(t, nc)
	for _, st := range []jetstream.StreamConfig{{Name: "QUIET", Subjects: []string{"quiet.>"}, NoAck: true}, {Name: "OUT", Subjects: []string{"out.>"}}} {
		if _, err := js.CreateStream(ctxT(t), st); err != nil {
			t.Fatal(err)
		}
	}
	sink := newSink(t, nc, cfg)
	for try := range 2 {
		errs := sink.Deliver(ctxT(t), []*codec.Task{task("x", "quiet.x", "v", 0), task("y", "out.y", "v", 0)})
		if errs == nil || errs[0] == nil || errors.Is(errs[0], shard.ErrUnavailable) || !strings.Contains(errs[0].Error(), `stream "QUIET" is configured with no_ack`) {
			t.Fatalf("try %d, no_ack stream: %v, want a failure of its own naming the stream", try, errs)
		}
		if errs[1] != nil {
			t.Fatalf("try %d: the other task failed too: %v", try, errs[1])
		}
	}
}
