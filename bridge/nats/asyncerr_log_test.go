package nats

import (
	"errors"
	"fmt"
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
// a publish". Now each error text (without the denied subject) is logged
// once, then once per 30 s with the count held back.
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
	// A subject per entity (review R200): keyed per subject, 80 subjects
	// made 65 lines (the throttle's key bound), not one.
	const tries, subjects = 3, 80
	for try := range tries {
		var batch []*codec.Task
		for i := range subjects {
			batch = append(batch, task(fmt.Sprint("t", i), fmt.Sprint("secret.order", i), "v", 0))
		}
		errs := sink.Deliver(ctxT(t), batch)
		for i := range subjects {
			if errs == nil || errs[i] == nil {
				t.Fatalf("try %d: a denied publish succeeded: %v", try, errs)
			}
		}
	}
	eventually(t, "every refusal seen", func() bool { return seen.Load() >= subjects*tries })
	lines := logs.FilterMessage("nats: async error").All()
	if len(lines) != 1 {
		t.Fatalf("%d \"nats: async error\" lines for %d refused publishes to %d subjects, want 1 (the refusal once, then once per 30 s)", len(lines), seen.Load(), subjects)
	}
	for _, l := range lines {
		if _, ok := l.ContextMap()["held_back"]; !ok {
			t.Fatalf("line without the count held back: %v", l.ContextMap())
		}
	}
}
