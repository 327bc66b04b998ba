package nats

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

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
