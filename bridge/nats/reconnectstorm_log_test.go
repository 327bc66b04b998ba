package nats

import (
	"errors"
	"testing"
	"time"

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

// outagesShown is how many drops the Warn lines of logs show: each
// "disconnected" line one and its held_back more, and the held_back of
// each line that the connection dropped and reconnected again.
func outagesShown(logs *observer.ObservedLogs) int {
	n := 0
	for _, e := range logs.FilterLevelExact(zapcore.WarnLevel).All() {
		held, _ := e.ContextMap()["held_back"].(int64)
		switch e.Message {
		case "nats: disconnected; reconnecting":
			n += 1 + int(held)
		case "nats: disconnected and reconnected again since the last drop logged":
			n += int(held)
		}
	}
	return n
}

// TestReconnectStormSecondOutageShown (review F211): a second short
// outage within the interval of a logged one was held back (at Debug)
// and its count waited for the next drop line, which a connection that
// stays up never logs: the log showed one outage where there were two.
// The drops held back are reported at the end of their interval.
func TestReconnectStormSecondOutageShown(t *testing.T) {
	old := dropLogEvery
	t.Cleanup(func() { dropLogEvery = old }) // before the connection's handlers run
	dropLogEvery = 3 * time.Second
	s := startServer(t, jsOptions(t))
	p := newFreezeProxy(t, s.Addr().String())
	cfg := testConfig(t, p.url())
	core, all := observer.New(zap.DebugLevel)
	cfg.Logger = zap.New(core)
	connect(t, cfg)
	for i := range 2 {
		p.cut()
		eventually(t, "reconnected", func() bool { return all.FilterMessage("nats: reconnected").Len() > i })
	}
	// Within 3 s of the first drop the second is held back and reported
	// at the interval's end; on a machine slow enough to reconnect later
	// it is logged itself. Either way two outages show.
	eventually(t, "both outages shown", func() bool { return outagesShown(all) >= 2 })
	if n := outagesShown(all); n != 2 {
		t.Fatalf("2 drops shown as %d in %v", n, all.FilterLevelExact(zapcore.WarnLevel).All())
	}
}

// TestDropLogFlush: the drops held back within an interval are reported
// at its end (flush, the timer's call), as the drop the connection is in
// (its reconnect then logged) or as drops it came back from.
func TestDropLogFlush(t *testing.T) {
	core, logs := observer.New(zap.DebugLevel)
	resets := 0
	d := &dropLog{log: zap.New(core), every: time.Hour, reset: func() { resets++ }}
	t.Cleanup(func() { d.close() })
	errDrop := errors.New("EOF")
	warns := func(msg string) []observer.LoggedEntry {
		return logs.FilterLevelExact(zapcore.WarnLevel).FilterMessage(msg).All()
	}
	infos := func() int { return logs.FilterLevelExact(zapcore.InfoLevel).FilterMessage("nats: reconnected").Len() }

	d.dropped(errDrop) // logged
	d.reconnected("nats://a")
	d.dropped(errDrop) // held
	d.reconnected("nats://a")
	d.flush() // its interval's end: up again
	if w := warns("nats: disconnected and reconnected again since the last drop logged"); len(w) != 1 || w[0].ContextMap()["held_back"] != int64(1) {
		t.Fatalf("up at the interval's end: %v, want one line with held_back 1", w)
	}
	d.dropped(errDrop) // held
	d.reconnected("nats://a")
	d.dropped(errDrop) // held, still down
	d.flush()
	w := warns("nats: disconnected; reconnecting")
	if len(w) != 2 || w[1].ContextMap()["held_back"] != int64(1) || resets != 2 {
		t.Fatalf("down at the interval's end: %v, %d resets; want its drop's line with held_back 1 (the one before), the attempts' throttle reset", w, resets)
	}
	d.reconnected("nats://b")
	if infos() != 2 {
		t.Fatalf("%d reconnected lines at Info, want 2 (the first drop's, the one logged late)", infos())
	}
	d.flush() // nothing held: nothing logged
	if n := logs.FilterLevelExact(zapcore.WarnLevel).Len(); n != 3 {
		t.Fatalf("%d Warn lines, want 3", n)
	}
}

// TestDropLogFlushSaysWhen (review R212): a drop held back and reported
// at its interval's end (flush) was logged with that time only, up to 30 s
// after the drop: an operator matching it with a server's restart looked
// at the wrong time. The late lines name when the drop came.
func TestDropLogFlushSaysWhen(t *testing.T) {
	core, logs := observer.New(zap.DebugLevel)
	d := &dropLog{log: zap.New(core), every: time.Hour, reset: func() {}}
	t.Cleanup(func() { d.close() })
	errDrop := errors.New("EOF")
	within := func(e observer.LoggedEntry, key string, from, to time.Time) {
		t.Helper()
		at, ok := e.ContextMap()[key].(time.Time)
		if !ok || at.Before(from) || at.After(to) {
			t.Fatalf("%q: %s = %v, want the drop's time, within [%v, %v]", e.Message, key, e.ContextMap()[key], from, to)
		}
	}
	d.dropped(errDrop) // logged
	d.reconnected("nats://a")
	from := time.Now()
	d.dropped(errDrop) // held
	to := time.Now()
	d.reconnected("nats://a")
	d.flush()
	w := logs.FilterMessage("nats: disconnected and reconnected again since the last drop logged").All()
	if len(w) != 1 {
		t.Fatalf("%d lines for a drop held back and over, want 1", len(w))
	}
	within(w[0], "last_dropped_at", from, to)

	from = time.Now()
	d.dropped(errDrop) // held, still down at the interval's end
	to = time.Now()
	d.flush()
	w = logs.FilterMessage("nats: disconnected; reconnecting").FilterLevelExact(zapcore.WarnLevel).All()
	if len(w) != 2 {
		t.Fatalf("%d drop lines, want 2 (the first, the late one)", len(w))
	}
	within(w[1], "dropped_at", from, to)
}
