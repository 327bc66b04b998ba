package service

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/delaybridge/delaybridge/bridge/kafka"
	"github.com/delaybridge/delaybridge/bridge/nats"
	"github.com/delaybridge/delaybridge/config"
	"github.com/delaybridge/delaybridge/internal/natstest"
)

// muteJS is a relay in front of the nats-server at upstream that drops
// the client's JetStream API requests to subjects beginning with prefix
// until unmuted (mute.Drop("", 0)): a JetStream that does not answer (a
// server recovering its streams, a cluster without a meta leader), which a
// real server cannot be made to be on demand.
func muteJS(t *testing.T, upstream, prefix string) *natstest.Relay {
	t.Helper()
	r := natstest.NewRelay(t, upstream)
	r.Drop(prefix, math.MaxInt)
	return r
}

// A JetStream that does not answer the delay stream's lookup at start is
// retried like a broker that does not answer, and the bridge delivers once
// it answers; the start used to end with "look up stream: context deadline
// exceeded" (found by a model-based soak: a crash loop under a supervisor
// while JetStream recovers).
func TestStartJetStreamSilent(t *testing.T) {
	e := newEnv(t, "")
	m := muteJS(t, e.ns.Addr().String(), "$JS.API.")
	e.mutate = func(c *config.Config) { c.NATS.URL = m.URL() }
	svc, _, done := e.runWith(Options{NATS: func(c *nats.Config) { fastNATS(c); c.ConnectTimeout = 200 * time.Millisecond }})
	eventually(t, "a failed stream lookup reported", func() bool {
		select {
		case err := <-done:
			t.Fatalf("bridge Run returned while JetStream did not answer at start (%d API requests unanswered): %v", m.Dropped(), err)
		default:
		}
		err := svc.Ready()
		return m.Dropped() > 0 && err != nil && strings.Contains(err.Error(), "look up stream")
	})
	m.Drop("", 0)
	// The next try finds (or creates) the stream.
	eventually(t, "ready once JetStream answers", func() bool { return svc.Ready() == nil })
	e.publishNATS("delay.js", []byte("after-silence"), "delay-after", "0", "delay-target", "orders.js")
	e.advanceUntil("the delivery once JetStream answers", func(ds []delivery) bool {
		select {
		case err := <-done:
			t.Fatalf("bridge Run returned: %v", err)
		default:
		}
		return len(byValue(ds, "orders.js")["after-silence"]) > 0
	})
}

// TestNotReadyWhileConsumerUnanswered: the delay consumer stops answering
// while its stream still does (a NATS cluster that lost its quorum: a
// replica answers stream info, the consumer's requests get 503) — the
// source consumes nothing, so the bridge is not ready, and says why; it is
// ready again, and delivers, once the consumer answers. It used to stay
// ready throughout (found by a clustered-NATS hunt).
func TestNotReadyWhileConsumerUnanswered(t *testing.T) {
	e := newEnv(t, "")
	m := muteJS(t, e.ns.Addr().String(), "$JS.API.CONSUMER.")
	m.Drop("", 0)
	e.mutate = func(c *config.Config) { c.NATS.URL = m.URL() }
	svc, _, done := e.runWith(Options{NATS: func(c *nats.Config) { fastNATS(c); c.PullExpiry = time.Second }})
	alive := func() {
		select {
		case err := <-done:
			t.Fatalf("bridge Run returned: %v", err)
		default:
		}
	}
	eventually(t, "ready", func() bool { alive(); return svc.Ready() == nil })
	m.Drop("$JS.API.CONSUMER.", math.MaxInt)
	eventually(t, "not ready while the consumer does not answer", func() bool {
		alive()
		err := svc.Ready()
		return err != nil && strings.Contains(err.Error(), "consumer info")
	})
	m.Drop("", 0)
	eventually(t, "ready once the consumer answers", func() bool { alive(); return svc.Ready() == nil })
	e.publishNATS("delay.js", []byte("after-quorum"), "delay-after", "0", "delay-target", "orders.js")
	e.advanceUntil("the delivery once the consumer answers", func(ds []delivery) bool {
		alive()
		return len(byValue(ds, "orders.js")["after-quorum"]) > 0
	})
}

// TestNATSPublisherUpBeforeItsSource: the NATS server answers publishes,
// but not (yet) the delay stream's lookup (a cluster that lost quorum
// serves a target stream before the delay stream's consumer; here the
// lookup is dropped). Deliveries to NATS targets go out meanwhile; the
// bridge is not ready until the source is set up, and then consumes. Before,
// the whole transport waited for the source, then for the connect
// backoff (up to 30 s, whatever retry.max said: found by a hunt of a
// bridge restarted during a quorum loss, its held tasks 10-30 s late).
func TestNATSPublisherUpBeforeItsSource(t *testing.T) {
	e := newEnv(t, "")
	m := muteJS(t, e.ns.Addr().String(), "$JS.API.STREAM.INFO.DELAY")
	e.mutate = func(c *config.Config) { c.NATS.URL = m.URL() }
	svc, _, done := e.runWith(Options{NATS: func(c *nats.Config) { fastNATS(c); c.ConnectTimeout = 200 * time.Millisecond }})
	alive := func() {
		select {
		case err := <-done:
			t.Fatalf("bridge Run returned: %v", err)
		default:
		}
	}
	e.publishKafka(0, e.clk.Now(), []byte("k"), []byte("cross"), "delay-after", "0", "delay-target", "nats:orders.x")
	e.advanceUntil("the NATS delivery while the NATS source cannot be set up", func(ds []delivery) bool {
		alive()
		return len(byValue(ds, "orders.x")["cross"]) > 0
	})
	if m.Dropped() == 0 {
		t.Fatal("the delay stream's lookup was never dropped")
	}
	if err := svc.Ready(); err == nil || !strings.Contains(err.Error(), "connecting to brokers") {
		t.Fatalf("ready = %v while the NATS source is not set up", err)
	}
	m.Drop("", 0)
	eventually(t, "ready once the delay stream answers", func() bool { alive(); return svc.Ready() == nil })
	e.publishNATS("delay.js", []byte("after-lookup"), "delay-after", "0", "delay-target", "orders.js")
	e.advanceUntil("the NATS source consuming", func(ds []delivery) bool {
		alive()
		return len(byValue(ds, "orders.js")["after-lookup"]) > 0
	})
}

// TestStartAccountWithoutJetStreamEnds: the bridge's NATS account has no
// JetStream (the server answers the delay stream's lookup with 503, err
// 10039). That is a configuration the broker rejects, so the start ends
// with it rather than retrying it as an outage (found by a review: the
// rule making a JetStream 503 an outage caught it too).
func TestStartAccountWithoutJetStreamEnds(t *testing.T) {
	dir := t.TempDir()
	conf := filepath.Join(dir, "nats.conf")
	if err := os.WriteFile(conf, []byte(`
listen: "127.0.0.1:-1"
jetstream { store_dir: "`+filepath.Join(dir, "js")+`" }
accounts {
  JS { jetstream: enabled, users: [{user: js, password: js}] }
  NOJS { users: [{user: nojs, password: nojs}] }
}
`), 0o600); err != nil {
		t.Fatal(err)
	}
	o, err := natsserver.ProcessConfigFile(conf)
	if err != nil {
		t.Fatal(err)
	}
	ns := startNATSServer(t, o) // JetStream on for the server, not the account

	e := newEnv(t, "")
	e.mutate = func(c *config.Config) { c.NATS.URL = ns.ClientURL(); c.NATS.User = "nojs"; c.NATS.Password = "nojs" }
	_, _, done := e.runWith(Options{NATS: func(c *nats.Config) { fastNATS(c); c.ConnectTimeout = 500 * time.Millisecond }})
	select {
	case err := <-done:
		var api *jetstream.APIError
		if !errors.As(err, &api) || api.ErrorCode != jetstream.JSErrCodeJetStreamNotEnabledForAccount {
			t.Fatalf("Run ended with %v, want the account's missing JetStream", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not end although the NATS account has no JetStream: retried as an outage")
	}
}

func TestUnreachable(t *testing.T) {
	tests := []struct {
		err  error
		want bool
	}{
		{fmt.Errorf("connect: %w", natsgo.ErrNoServers), true},
		{fmt.Errorf("connect: %w", natsgo.ErrTimeout), true},
		{fmt.Errorf("dial: %w", os.ErrDeadlineExceeded), true},
		{fmt.Errorf("nats source: look up stream %q: %w", "DELAY", context.DeadlineExceeded), true},
		{&net.DNSError{Err: "no such host", Name: "nats", IsNotFound: true}, true},
		{fmt.Errorf("check: %w", kafka.ErrUnreachable), true},
		// A refusal decides, even next to a silent broker.
		{errors.Join(kafka.ErrUnreachable, kafka.ErrAuth), false},
		{errors.Join(kafka.ErrUnreachable, kafka.ErrTLS), false},
		{natsgo.ErrAuthorization, false},
		{errors.New("nats source: stream DELAY does not capture delay.>"), false},
		// JetStream answering for itself: a cluster without quorum (the
		// start used to end there: a crash loop until quorum came back).
		{fmt.Errorf("nats source: create consumer: %w", &jetstream.APIError{Code: 503, ErrorCode: 10008, Description: "JetStream system temporarily unavailable"}), true},
		{fmt.Errorf("nats source: create stream: %w", &jetstream.APIError{Code: 500, ErrorCode: 10074, Description: "replicas > 1 not supported in non-clustered mode"}), false},
		// 503 too, but the account (or server) has no JetStream: the
		// operator must see it, retrying does not help.
		{fmt.Errorf("nats source: look up stream: %w", jetstream.ErrJetStreamNotEnabledForAccount), false},
		{fmt.Errorf("nats source: look up stream: %w", jetstream.ErrJetStreamNotEnabled), false},
		{context.Canceled, false},
	}
	for _, tt := range tests {
		if got := unreachable(tt.err); got != tt.want {
			t.Errorf("unreachable(%v) = %v, want %v", tt.err, got, tt.want)
		}
	}
}

// TestConnectPause: the connector's wait after a failed attempt is its
// backoff, capped at 2 s while firing is paused at start and after a NATS
// set-up answered 503 10008 (a quorum loss, hunt H192), not after another
// 503 (insufficient resources may be max_ha_assets reached, review R194).
func TestConnectPause(t *testing.T) {
	leaderless := fmt.Errorf("nats source: create consumer: %w", &jetstream.APIError{Code: 503, ErrorCode: 10008, Description: "JetStream system temporarily unavailable"})
	resources := fmt.Errorf("nats source: create consumer: %w", &jetstream.APIError{Code: 503, ErrorCode: 10023, Description: "insufficient resources"})
	tests := []struct {
		name    string
		backoff time.Duration
		paused  bool
		err     error
		want    time.Duration
	}{
		{"backoff", 30 * time.Second, false, errors.New("dial tcp: connection refused"), 30 * time.Second},
		{"paused", 30 * time.Second, true, errors.New("dial tcp: connection refused"), pausedConnectBackoff},
		{"leaderless", 30 * time.Second, false, leaderless, pausedConnectBackoff},
		{"leaderless, short backoff", time.Second, false, leaderless, time.Second},
		{"insufficient resources", 30 * time.Second, false, resources, 30 * time.Second},
	}
	for _, tc := range tests {
		if got := connectPause(tc.backoff, tc.paused, tc.err); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}
