package service

import (
	"context"
	"strconv"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/delaybridge/delaybridge/bridge/nats"
)

// crashedPull plays a bridge run killed (kill -9, an OOM kill) after its
// pull had received n messages of the durable consumer and before it
// stored them: the messages are left delivered and unacknowledged, which
// the server redelivers by itself only after the consumer's ack wait.
func (e *env) crashedPull(n int) []string {
	e.t.Helper()
	nc, err := natsgo.Connect(e.ns.ClientURL())
	if err != nil {
		e.t.Fatal(err)
	}
	defer nc.Close() // the crash: no ack, no nak
	js, err := jetstream.New(nc)
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cons, err := js.Consumer(ctx, "DELAY", "bridge")
	if err != nil {
		e.t.Fatal(err)
	}
	b, err := cons.Fetch(n, jetstream.FetchMaxWait(5*time.Second))
	if err != nil {
		e.t.Fatal(err)
	}
	var got []string
	for m := range b.Messages() {
		got = append(got, string(m.Data()))
	}
	if len(got) != n {
		e.t.Fatalf("the crashed run's pull got %q, want %d messages", got, n)
	}
	return got
}

// natsSettled reports whether the bridge's consumer has nothing pending
// and nothing awaiting acknowledgement: every message, redeliveries after
// the ack wait included, was taken in.
func (e *env) natsSettled() bool {
	js, err := jetstream.New(e.nc)
	if err != nil {
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	cons, err := js.Consumer(ctx, "DELAY", "bridge")
	if err != nil {
		return false
	}
	info, err := cons.Info(ctx)
	return err == nil && info.NumPending == 0 && info.NumAckPending == 0
}

// crashAckWait is the consumer's ack wait in the crash-in-flight tests:
// left to it, the crashed run's messages would not come back within the
// tests' waits (1 min).
const crashAckWait = 5 * time.Minute

// storedThenStopped runs the bridge once with the NATS options it returns
// (ack wait crashAckWait): it creates the consumer and stores task "c",
// due 10 s after the test's start, then stops. at gives the delay-at of
// an offset from that start.
func (e *env) storedThenStopped() (o Options, at func(time.Duration) string) {
	e.t.Helper()
	o = Options{NATS: func(c *nats.Config) { fastNATS(c); c.AckWait = crashAckWait }}
	t0 := e.clk.Now()
	at = func(d time.Duration) string { return strconv.FormatInt(t0.Add(d).UnixMilli(), 10) }
	svc, stop, done := e.runWith(o)
	e.publishNATS("delay.c", []byte("cancelled"), "delay-id", "c", "delay-at", at(10*time.Second), "delay-target", "orders.c")
	waitStored(e.t, svc, 1, "DELAY", "c")
	stop()
	if err := <-done; err != nil {
		e.t.Fatal(err)
	}
	return o, at
}

// TestCatchUpNATSCrashInFlight (hunt H171): restarts in a loop under load,
// NATS source. Messages a run had received when it was killed came back
// only after the consumer's ack wait (30 s by default), while the next
// run's catch-up pause ended as soon as a batch of newer messages left
// nothing pending. In H171's soak (24 restarts, half of them kill -9, 300
// msg/s per transport) that gave 63 superseded versions delivered, all
// from the NATS source:
//
//   - cancel: a cancel published during the outage, before its task's due
//     time, was pulled by a run killed during its pause; the next run,
//     started within the ack wait, fired the cancelled task after its
//     pause.
//   - replace: the OLD version was in flight at the kill, its replacement
//     published after; the next run read and delivered the replacement,
//     then the old version came back after the ack wait, found its id free
//     (the replacement fired) and was delivered after the new one.
//
// The source now asks for them back at start (a nak each), and the server
// redelivers them before newer messages. The ack wait is 5 min here: left
// to it, the messages would not come back within the test's waits.
func TestCatchUpNATSCrashInFlight(t *testing.T) {
	e := newEnv(t, "catch_up_wait: 1m\n")
	o, at := e.storedThenStopped()

	// The outage, before the due times: the publishers cancel "c" and send
	// "r" (due at t0+10s), then replace "r" (due at t0+15s). A run that
	// starts meanwhile pulls the cancel and r's first version and is killed
	// before it stores them.
	e.publishNATS("delay.c", []byte("cancel"), "delay-id", "c", "delay-cancel", "true")
	e.publishNATS("delay.c", []byte("r-v1"), "delay-id", "r", "delay-at", at(10*time.Second), "delay-target", "orders.c")
	e.crashedPull(2)
	e.publishNATS("delay.c", []byte("r-v2"), "delay-id", "r", "delay-at", at(15*time.Second), "delay-target", "orders.c")

	// The next run comes back within the ack wait, after both due times.
	e.clk.Advance(20 * time.Second)
	svc, _, _ := e.runWith(o)
	e.waitFor("r-v2", func(ds []delivery) bool { return len(byValue(ds, "orders.c")["r-v2"]) == 1 })
	// The crashed run's messages were asked back and taken in.
	eventually(t, "the crashed run's messages redelivered and taken in", e.natsSettled)
	e.settle(svc)
	// A last task, due now: once it is read from the ORDERS stream, what
	// fired before it (stored in that stream before it) was read too.
	e.publishNATS("delay.c", []byte("last"), "delay-id", "last", "delay-at", at(20*time.Second), "delay-target", "orders.c")
	got := byValue(e.waitFor("the last task", func(ds []delivery) bool { return len(byValue(ds, "orders.c")["last"]) == 1 }), "orders.c")
	if n := len(got["cancelled"]); n != 0 {
		t.Errorf("task c delivered %d times, though its cancel was published before its due time (before the run that fired it started)", n)
	}
	if n := len(got["r-v1"]); n != 0 {
		t.Errorf("r's first version delivered %d times, after its replacement, which was published before its due time", n)
	}
}

// TestCatchUpNATSCrashInFlightQuiet: with nothing published after a run
// was killed holding messages, the next run's pause ends once they are
// redelivered and stored: asked back at start, well within the ack wait
// (5 min) and catch_up_wait (10 min), which the test's waits (1 min) are
// shorter than. The cancel among them stops its task.
func TestCatchUpNATSCrashInFlightQuiet(t *testing.T) {
	e := newEnv(t, "catch_up_wait: 10m\n")
	o, at := e.storedThenStopped()
	e.publishNATS("delay.c", []byte("cancel"), "delay-id", "c", "delay-cancel", "true")
	e.crashedPull(1)
	e.clk.Advance(20 * time.Second)
	start := time.Now()
	svc, _, _ := e.runWith(o)
	eventually(t, "firing resumed", func() bool { return !svc.Engine().FiringPaused() })
	paused := time.Since(start)
	e.settle(svc)
	e.publishNATS("delay.c", []byte("last"), "delay-id", "last", "delay-at", at(20*time.Second), "delay-target", "orders.c")
	got := e.waitFor("the last task", func(ds []delivery) bool { return len(byValue(ds, "orders.c")["last"]) == 1 })
	if n := len(byValue(got, "orders.c")["cancelled"]); n != 0 {
		t.Errorf("task c delivered %d times, though its cancel was published before its due time", n)
	}
	t.Logf("paused %v (ack wait %v)", paused, crashAckWait)
}
