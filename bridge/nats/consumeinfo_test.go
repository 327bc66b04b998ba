package nats

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/internal/natstest"
)

// TestConsumeInfoSentAgain: the consumer's info that starts consuming is
// answered by no server (a request sent just before the consumer's leader
// is elected, at a cluster's return from a quorum loss: natstest.Relay
// drops it here). It is sent again while unanswered, as the set-up's
// requests are, and consuming starts on the next one's answer. With one
// request it waited nats.go's 5 s default timeout, failed (counted in
// delaybridge_source_errors_total, logged "consuming stopped") and was
// tried again after the backoff.
func TestConsumeInfoSentAgain(t *testing.T) {
	srv := startServer(t, jsOptions(t))
	relay := natstest.NewRelay(t, srv.Addr().String())
	cfg := testConfig(t, relay.URL())
	cfg.Create = true
	cfg.ConnectTimeout = time.Second // sent again after 1 s, within 2 s
	src, err := NewSource(connect(t, cfg), cfg)
	if err != nil {
		t.Fatal(err)
	}
	pub := newJS(t, connect(t, testConfig(t, serverURL(srv))))
	publish(t, pub, "delay.a", "m", delayHeader())
	relay.Drop("$JS.API.CONSUMER.INFO."+cfg.Stream+"."+cfg.Consumer, 1)
	rec := newRecorder()
	runSource(t, src, rec)
	eventually(t, "the message taken", func() bool { return taken(rec, "m") })
	if n := relay.Dropped(); n != 1 {
		t.Fatalf("%d consumer infos dropped, want 1: not the unanswered request this test is about", n)
	}
	if n := testutil.ToFloat64(cfg.Metrics.SourceErrors.WithLabelValues(cfg.Stream)); n != 0 {
		t.Errorf("consuming failed %v times: its consumer info was not sent again while unanswered", n)
	}
	if n := src.resent.Load(); n < 1 {
		t.Errorf("%d requests sent again, want at least 1 (the consumer's info)", n)
	}
}

// TestConsumingStoppedLogThrottled: a consume that stops at every retry
// (here its consumer info unanswered each time; in a quorum loss a
// consumer without a leader answers it 503, every 2 s) is counted in
// delaybridge_source_errors_total each time and logged "consuming
// stopped" at the first stop, then once per 30 s for the same error; a
// batch taken in ends the run and logs "consuming again" once (hunt
// H204: the stop had no end).
func TestConsumingStoppedLogThrottled(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	srv := startServer(t, jsOptions(t))
	relay := natstest.NewRelay(t, srv.Addr().String())
	cfg := testConfig(t, relay.URL())
	cfg.Logger = zap.New(zapcore.NewTee(cfg.Logger.Core(), core))
	cfg.Create = true
	cfg.ConnectTimeout = 50 * time.Millisecond // the consumer info given up after 100 ms
	src, err := NewSource(connect(t, cfg), cfg)
	if err != nil {
		t.Fatal(err)
	}
	relay.Drop("$JS.API.CONSUMER.INFO."+cfg.Stream+"."+cfg.Consumer, 1<<30)
	rec := newRecorder()
	runSource(t, src, rec)
	errs := cfg.Metrics.SourceErrors.WithLabelValues(cfg.Stream)
	eventually(t, "four stops", func() bool { return testutil.ToFloat64(errs) >= 4 })
	const msg = "consuming stopped"
	stops := logs.FilterMessageSnippet(msg).All()
	if len(stops) != 1 {
		t.Fatalf("%d %q lines over %v stops, want 1 (then one per 30 s)", len(stops), msg, testutil.ToFloat64(errs))
	}
	key, _ := stops[0].ContextMap()["error"].(string)
	if key == "" {
		t.Fatalf("%q logged without its error: %v", msg, stops[0].ContextMap())
	}
	relay.Drop("", 0)
	pub := newJS(t, connect(t, testConfig(t, serverURL(srv))))
	publish(t, pub, "delay.a", "m", delayHeader())
	eventually(t, "the message taken", func() bool { return taken(rec, "m") })
	eventually(t, "the end of the stops logged", func() bool { return logs.FilterMessageSnippet("consuming again").Len() > 0 })
	publish(t, pub, "delay.a", "m2", delayHeader())
	eventually(t, "the next message taken", func() bool { return taken(rec, "m2") })
	if n := logs.FilterMessageSnippet("consuming again").Len(); n != 1 {
		t.Fatalf("the end of the stops logged %d times, want once", n)
	}
	// The end does not restart the throttle (review R210: a consume
	// stopping and going on by turns logged two lines a turn); see
	// TestConsumingStopFlappingThrottled.
}

// TestConsumingAgainOnIdleStream (review F211): on an idle stream, the
// end of a run of stops ("consuming again") waited for the next message,
// maybe hours after the consume went on. A pull the server answers (its
// idle heartbeat, its expiry) ends the run as a batch does.
func TestConsumingAgainOnIdleStream(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	srv := startServer(t, jsOptions(t))
	relay := natstest.NewRelay(t, srv.Addr().String())
	cfg := testConfig(t, relay.URL())
	cfg.Logger = zap.New(zapcore.NewTee(cfg.Logger.Core(), core))
	cfg.Create = true
	cfg.ConnectTimeout = 50 * time.Millisecond // the consumer info given up after 100 ms
	cfg.PullExpiry = time.Second               // a heartbeat every 500 ms
	src, err := NewSource(connect(t, cfg), cfg)
	if err != nil {
		t.Fatal(err)
	}
	relay.Drop("$JS.API.CONSUMER.INFO."+cfg.Stream+"."+cfg.Consumer, 1<<30)
	rec := newRecorder()
	runSource(t, src, rec)
	errs := cfg.Metrics.SourceErrors.WithLabelValues(cfg.Stream)
	eventually(t, "two stops", func() bool { return testutil.ToFloat64(errs) >= 2 })
	if n := logs.FilterMessageSnippet("consuming stopped").Len(); n != 1 {
		t.Fatalf("%d stop lines, want 1", n)
	}
	relay.Drop("", 0)
	eventually(t, "the end of the stops logged with no message", func() bool {
		return logs.FilterMessageSnippet("consuming again").Len() > 0
	})
	if n := logs.FilterMessageSnippet("consuming again").Len(); n != 1 {
		t.Fatalf("the end of the stops logged %d times, want once", n)
	}
	if got := logs.FilterMessageSnippet("consuming again").All()[0].Message; !strings.Contains(got, "answered a pull") {
		t.Fatalf("end line %q, want the pull answered named", got)
	}
}
