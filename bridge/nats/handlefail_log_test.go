package nats

import (
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// TestHandleFailLogThrottled (hunt H204): a store that refuses writes (a
// failed fsync, the volume's reserve) fails the source's batch at every
// retry. The NATS source logged each retry (10 lines a minute in the
// hunt, 6 a minute once the backoff reached 10 s, for as long as the
// store refuses) where the Kafka source logs once per 30 s; and neither
// said when the store took the batch. Now the line is logged once per
// 30 s per error shape, and the end once.
func TestHandleFailLogThrottled(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	_, _, js, src := createdSource(t, func(c *Config) { c.Logger = zap.New(core) })
	for range 3 {
		publish(t, js, "delay.a", "v", nil)
	}
	h := newRecorder()
	h.setFail(true)
	runSource(t, src, h)
	eventually(t, "the batch failed five times", func() bool { return h.numCalls() >= 5 })
	const msg = "nats source: handle batch failed; not acked, retrying"
	if n := logs.FilterMessage(msg).Len(); n != 1 {
		t.Fatalf("%d %q lines over %d failed attempts, want 1 (then one per 30 s)", n, msg, h.numCalls())
	}
	h.setFail(false)
	eventually(t, "the end logged", func() bool { return logs.FilterMessageSnippet("batches stored again").Len() > 0 })
	if n := logs.FilterMessageSnippet("batches stored again").Len(); n != 1 {
		t.Fatalf("the end of the failures logged %d times, want once", n)
	}
}
