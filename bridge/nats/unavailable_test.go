package nats

import (
	"context"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestConsumerGoneRetriesCountedLogThrottled (hunt H150): with create
// false, a consumer an operator deleted fails every retry for as long as
// it is missing. Each failure counts in delaybridge_source_errors_total
// (it moved once, then stayed: a dashboard saw a healthy source reading
// nothing), and the reason is logged once per 30 s, not at every retry.
func TestConsumerGoneRetriesCountedLogThrottled(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	srv := startServer(t, jsOptions(t))
	cfg := testConfig(t, serverURL(srv))
	cfg.Logger = zap.New(zapcore.NewTee(cfg.Logger.Core(), core))
	nc := connect(t, cfg)
	js := newJS(t, nc)
	if _, err := js.CreateStream(ctxT(t), jetstream.StreamConfig{Name: "DELAY", Subjects: []string{"delay.>"}, Retention: jetstream.WorkQueuePolicy}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateOrUpdateConsumer(ctxT(t), "DELAY", jetstream.ConsumerConfig{Durable: "bridge", AckPolicy: jetstream.AckExplicitPolicy}); err != nil {
		t.Fatal(err)
	}
	src, err := NewSource(nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	runSource(t, src, newRecorder())
	eventually(t, "the source pulling", func() bool {
		return consumerInfo(t, js, "DELAY", "bridge").NumWaiting > 0
	})
	if err := js.DeleteConsumer(context.Background(), "DELAY", "bridge"); err != nil {
		t.Fatal(err)
	}
	errs := cfg.Metrics.SourceErrors.WithLabelValues("DELAY")
	eventually(t, "five failed retries counted", func() bool { return testutil.ToFloat64(errs) >= 5 })
	if n := logs.FilterMessageSnippet("stream or consumer unavailable").Len(); n != 1 {
		t.Fatalf("%d \"stream or consumer unavailable\" lines over %v failed retries, want 1 (then one per 30 s)", n, testutil.ToFloat64(errs))
	}
}

// TestIncarnationRetriesCountedLogThrottled: a stream created again whose
// incarnation cannot be stored (the store refusing writes) fails every
// retry the same way: each counts in delaybridge_source_errors_total and
// the reason is logged once per 30 s, not once per retry.
func TestIncarnationRetriesCountedLogThrottled(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	cfg, _, js, src := createdSource(t, func(c *Config) {
		c.Logger = zap.New(zapcore.NewTee(c.Logger.Core(), core))
	})
	rec := newRecorder()
	runSource(t, src, rec)
	eventually(t, "the source pulling", func() bool {
		return consumerInfo(t, js, "DELAY", "bridge").NumWaiting > 0
	})
	rec.mu.Lock()
	rec.failCpOnly = 1 << 30 // every checkpoint-only write from now on
	rec.mu.Unlock()
	if err := js.DeleteStream(context.Background(), "DELAY"); err != nil {
		t.Fatal(err)
	}
	const msg = "reading its incarnation failed"
	eventually(t, "five failed incarnation writes", func() bool {
		rec.mu.Lock()
		defer rec.mu.Unlock()
		return rec.cpOnly >= 5
	})
	errs := cfg.Metrics.SourceErrors.WithLabelValues("DELAY")
	eventually(t, "the failed retries counted", func() bool { return testutil.ToFloat64(errs) >= 5 })
	if n := logs.FilterMessageSnippet(msg).Len(); n != 1 {
		t.Fatalf("%d %q lines over %v failed retries, want 1 (then one per 30 s)", n, msg, testutil.ToFloat64(errs))
	}
}
