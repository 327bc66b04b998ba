// Package testlog gives tests a zaptest logger that stays safe to use after
// its test ends.
//
// Broker clients call their handlers on goroutines of their own (nats.go's
// ClosedHandler, which the bridge logs from, runs after a connection closed
// in a test's cleanup; kafka-go's background goroutines log while they
// wind down), so a log line may come after the test ended. zaptest writes
// it with t.Logf, which then races with the testing package's write of the
// test's end, and -race fails the test. This logger waits, at the test's
// cleanup, for writes under way and drops later ones.
package testlog

import (
	"sync"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
)

// New returns zaptest.NewLogger(t, opts...), silenced once t's cleanups run.
func New(t testing.TB, opts ...zaptest.LoggerOption) *zap.Logger {
	g := &gate{}
	t.Cleanup(g.close)
	return zap.New(gatedCore{Core: zaptest.NewLogger(t, opts...).Core(), g: g})
}

type gate struct {
	mu     sync.RWMutex
	closed bool
}

func (g *gate) close() {
	g.mu.Lock()
	g.closed = true
	g.mu.Unlock()
}

type gatedCore struct {
	zapcore.Core
	g *gate
}

func (c gatedCore) With(f []zapcore.Field) zapcore.Core {
	return gatedCore{Core: c.Core.With(f), g: c.g}
}

func (c gatedCore) Check(e zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	if c.Enabled(e.Level) {
		return ce.AddCore(e, c)
	}
	return ce
}

func (c gatedCore) Write(e zapcore.Entry, f []zapcore.Field) error {
	c.g.mu.RLock()
	defer c.g.mu.RUnlock()
	if c.g.closed {
		return nil
	}
	return c.Core.Write(e, f)
}
