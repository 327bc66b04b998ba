package nats

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/codec"
)

// TestAsyncErrorLogThrottled (hunt H204): the server answers every publish
// to a subject the bridge's user may not publish to with an -ERR, which
// nats.go passes to the async error handler. The handler logged each one:
// 1000 tasks due for a denied subject made 2846 Warn lines a minute (a
// line per task and retry) beside the engine's throttled "target refused
// a publish". Now each error text is logged once, then once per 30 s with
// the count held back.
func TestAsyncErrorLogThrottled(t *testing.T) {
	cfg := deniedSecretConfig(t)
	cfg.PublishTimeout = time.Second
	core, logs := observer.New(zap.InfoLevel)
	cfg.Logger = zap.New(core)
	nc := connect(t, cfg)
	sink := newSink(t, nc, cfg)
	var seen atomic.Int32
	prev := nc.ErrorHandler()
	nc.SetErrorHandler(func(c *natsgo.Conn, sub *natsgo.Subscription, err error) {
		prev(c, sub, err)
		if errors.Is(err, natsgo.ErrPermissionViolation) {
			seen.Add(1)
		}
	})
	const tries = 6
	for try := range tries {
		batch := []*codec.Task{task("x", "secret.x", "v", 0), task("y", "secret.y", "v", 0)}
		if errs := sink.Deliver(ctxT(t), batch); errs == nil || errs[0] == nil || errs[1] == nil {
			t.Fatalf("try %d: a denied publish succeeded: %v", try, errs)
		}
	}
	eventually(t, "every refusal seen", func() bool { return seen.Load() >= 2*tries })
	lines := logs.FilterMessage("nats: async error").All()
	if len(lines) != 2 {
		t.Fatalf("%d \"nats: async error\" lines for %d refused publishes to two subjects, want 2 (each error once, then once per 30 s)", len(lines), seen.Load())
	}
	for _, l := range lines {
		if _, ok := l.ContextMap()["suppressed"]; !ok {
			t.Fatalf("line without the count held back: %v", l.ContextMap())
		}
	}
}
