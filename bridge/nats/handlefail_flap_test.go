package nats

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/bridge"
)

// firstTryFails fails the first try of each batch of messages and passes
// its retry: a store hovering at its free-space reserve, where each fire
// frees room for about one batch.
type firstTryFails struct {
	*recorder
	mu    sync.Mutex
	tries int
}

func (f *firstTryFails) Handle(ctx context.Context, b *bridge.Batch) error {
	if len(b.Items) > 0 {
		f.mu.Lock()
		f.tries++
		odd := f.tries%2 == 1
		f.mu.Unlock()
		if odd {
			return errHandle
		}
	}
	return f.recorder.Handle(ctx, b)
}

// TestHandleFailFlappingThrottled (review R210): when "batches stored
// again" reset the throttle (88b29ae), a store that refuses each batch
// once and takes its retry logged a failure and an end for every batch:
// the line per retry that H204 throttled, twice over.
func TestHandleFailFlappingThrottled(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	_, _, js, src := createdSource(t, func(c *Config) { c.Logger = zap.New(core) })
	h := &firstTryFails{recorder: newRecorder()}
	runSource(t, src, h)
	const n = 8
	for i := range n {
		v := fmt.Sprint("v", i)
		publish(t, js, "delay.a", v, nil)
		eventually(t, "message "+v+" stored", func() bool { return taken(h.recorder, v) })
	}
	fails := logs.FilterMessage("nats source: handle batch failed; not acked, retrying").Len()
	ends := logs.FilterMessageSnippet("batches stored again").Len()
	if fails > 2 || ends > 2 {
		t.Fatalf("%d batches, each refused once: %d failure and %d end lines, want at most 2 of each (one per 30 s)", n, fails, ends)
	}
}
