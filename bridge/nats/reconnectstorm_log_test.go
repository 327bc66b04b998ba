package nats

import (
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestReconnectStormLogThrottled (hunt H204): a connection that drops
// again and again (a flapping network path, a load balancer resetting
// connections, a server restarted in a loop) logged "disconnected;
// reconnecting" and "reconnected" at every drop, and the throttle of
// failed attempts started again at each reconnect: 35 lines a minute with
// a drop every 5 s. Now a drop is logged once per 30 s with the drops held
// back, and a reconnect only when its drop was logged, so a logged drop
// always has its end.
func TestReconnectStormLogThrottled(t *testing.T) {
	s := startServer(t, jsOptions(t))
	p := newFreezeProxy(t, s.Addr().String())
	cfg := testConfig(t, p.url())
	core, all := observer.New(zap.DebugLevel)
	cfg.Logger = zap.New(core)
	connect(t, cfg)
	const drops = 6
	for i := range drops {
		p.cut()
		eventually(t, "reconnected", func() bool { return all.FilterMessage("nats: reconnected").Len() > i })
	}
	logs := all.Filter(func(e observer.LoggedEntry) bool { return e.Level >= zapcore.InfoLevel })
	down := logs.FilterMessage("nats: disconnected; reconnecting").All()
	up := logs.FilterMessage("nats: reconnected").Len()
	if len(down) != 1 || up != 1 {
		t.Fatalf("%d drops logged %d \"disconnected\" and %d \"reconnected\" lines, want 1 and 1 (then once per 30 s)", drops, len(down), up)
	}
	if _, ok := down[0].ContextMap()["held_back"]; !ok || down[0].Level != zapcore.WarnLevel {
		t.Fatalf("the drop's line: %v %v, want a Warn with the drops held back", down[0].Level, down[0].ContextMap())
	}
}
