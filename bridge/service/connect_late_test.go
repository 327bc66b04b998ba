package service

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/bridge/nats"
	"github.com/delaybridge/delaybridge/internal/logthrottle"
)

// TestShutdownWhileConnectingClosesTheLateConnection: SIGTERM while the
// NATS transport is still connecting. Run gives up waiting for the
// connector at the shutdown deadline and closes what it has; a connect
// that completes after that must not leave its connection (and a source
// started after the stop) behind: closeAllBy took the closers list before
// the connector appended to it.
func TestShutdownWhileConnectingClosesTheLateConnection(t *testing.T) {
	e := newEnv(t, "shutdown_timeout: 1s\n")
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	natsHook := func(c *nats.Config) {
		fastNATS(c)
		// The first connect attempt is still under way at SIGTERM.
		once.Do(func() { close(entered); <-release })
	}
	varz := func() *natsserver.Varz {
		v, err := e.ns.Varz(nil)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	baseClients, baseTotal := e.ns.NumClients(), varz().TotalConnections

	_, cancel, done := e.runWith(Options{NATS: natsHook})
	<-entered
	cancel() // SIGTERM while NATS is connecting
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return")
	}
	// Run has returned. The connect now completes.
	close(release)
	eventually(t, "the late connect reached the server", func() bool { return varz().TotalConnections > baseTotal })
	eventually(t, "the late connection closed", func() bool { return e.ns.NumClients() == baseClients })
}

// TestOverdueAtRestartDeliveredAtOnce: tasks overdue at a restart are
// delivered without the clock moving (not after an outage backoff), both
// with every broker up and, for NATS, with Kafka down.
func TestOverdueAtRestartDeliveredAtOnce(t *testing.T) {
	for _, kafkaDown := range []bool{false, true} {
		t.Run(map[bool]string{false: "both-up", true: "kafka-down"}[kafkaDown], func(t *testing.T) {
			// With Kafka down the catch-up pause (catch_up_wait, see
			// TestCatchUpWaitBounds) would hold the NATS deliveries for
			// its length: this is the bridge without it.
			e := newEnv(t, map[bool]string{false: "", true: "catch_up_wait: 0s\n"}[kafkaDown])
			svc, stop := e.start()
			e.publishKafka(0, time.Time{}, []byte("k1"), []byte("kafka-overdue"), "delay-after", "5s", "delay-target", "orders")
			e.publishNATS("delay.o", []byte("nats-overdue"), "delay-after", "5s", "delay-target", "orders.o")
			waitIngested(t, svc, 2)
			stop()
			e.clk.Advance(10 * time.Second)
			if kafkaDown {
				e.kafkaAddr = "127.0.0.1:" + strconv.Itoa(freePort(t))
			}
			e.start()
			e.waitFor("overdue deliveries without the clock moving", func(ds []delivery) bool {
				n := len(byValue(ds, "orders.o")["nats-overdue"])
				if !kafkaDown {
					n = min(n, len(byValue(ds, kafkaOut)["kafka-overdue"]))
				}
				return n > 0
			})
		})
	}
}

// TestNATSAuthRefusedWhileKafkaRuns: a refused NATS login ends Run with
// the cause although the Kafka transport is connected and its source runs.
func TestNATSAuthRefusedWhileKafkaRuns(t *testing.T) {
	e := newEnv(t, "")
	ns := startNATSServer(t, &natsserver.Options{Username: "bridge", Password: "right"})
	kafkaUp := make(chan struct{})
	var once sync.Once
	natsHook := func(c *nats.Config) {
		fastNATS(c)
		// Let Kafka connect first, so the refusal comes while it runs.
		once.Do(func() { <-kafkaUp })
		c.URL, c.User, c.Password = ns.ClientURL(), "bridge", "wrong"
	}
	svc, _, done := e.runWith(Options{NATS: natsHook})
	e.publishKafka(0, time.Time{}, []byte("k"), []byte("v"), "delay-after", "1h", "delay-target", "orders")
	waitIngested(t, svc, 1) // the Kafka source runs
	close(kafkaUp)
	select {
	case err := <-done:
		if !errors.Is(err, nats.ErrAuth) {
			t.Fatalf("Run = %v, want nats.ErrAuth", err)
		}
		t.Logf("Run: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not end on the refused login")
	}
}

// TestOverdueAtRestartNotHeldAfterSecondConnectAttempt: NATS is down for
// the first connect attempt of a restart and back for the next one, 500 ms
// later. The tasks that were overdue at the restart must then be
// delivered at once, as they were before each transport connected on its
// own; they are held instead for an outage backoff as long as they are
// overdue (up to retry.max, default 5 min), the fake clock not moving here.
func TestOverdueAtRestartNotHeldAfterSecondConnectAttempt(t *testing.T) {
	e := newEnv(t, "")
	e.overdueWithNATSDown()
	svc2, _ := e.start()
	var nl *lateSink
	for _, l := range svc2.late {
		if l.transport == "nats" {
			nl = l
		}
	}
	// The first connect attempt failed, and the overdue task was tried:
	// as an outage (the engine says so), or still waiting in Deliver.
	eventually(t, "the overdue task met the NATS connect failure", func() bool {
		if nl.err.Load() == nil {
			return false
		}
		select {
		case <-nl.tried:
			err := svc2.Engine().Err()
			return err != nil && strings.Contains(err.Error(), "nats target unavailable")
		default:
			return true
		}
	})
	e.startNATS()
	eventually(t, "NATS connected", func() bool { return nl.real.Load() != nil })
	// /readyz still blames the connect, from the engine's outage record.
	t.Logf("Ready once NATS is connected: %v", svc2.Ready())
	e.waitFor("the overdue task once NATS is reached", func(ds []delivery) bool {
		return len(byValue(ds, "orders.o")["nats-overdue"]) > 0
	})
}

// TestTransportDownAtStartHoldsOnDisk: NATS is down when the bridge
// starts and stays down while tasks for it come due (ingested by the
// Kafka source). Once the connector's first attempt failed plus
// lateGrace, deliveries fail as an outage, so what waits is bounded by
// retry.waiting_in_memory and the rest is held on disk; before, the NATS
// lane waited for the connector through the whole outage and every task
// coming due was set aside in memory, without bound (a hunt measured
// about 170 B a task, none held). Once NATS is back every task arrives.
func TestTransportDownAtStartHoldsOnDisk(t *testing.T) {
	old := lateGrace
	lateGrace = 200 * time.Millisecond
	t.Cleanup(func() { lateGrace = old })
	// catch_up_wait 0: NATS down at start would otherwise pause firing
	// for its length (TestCatchUpWaitBounds), and this test is about what
	// waits once tasks fire.
	e := newEnv(t, "retry: {initial: 1s, max: 4s, multiplier: 2, jitter: 0.1, max_attempts: 3, waiting_in_memory: 10}\ncatch_up_wait: 0s\n")
	e.ns.Shutdown()
	svc, _ := e.start()
	const n = 200
	for i := range n {
		e.publishKafka(int32(i%3), e.clk.Now(), []byte(fmt.Sprintf("k%d", i)), []byte(fmt.Sprintf("v%d", i)),
			"delay-after", "0", "delay-target", "nats:orders.x")
	}
	eventually(t, "the tasks for the down NATS held on disk, not in memory", func() bool {
		st := svc.Engine().Stats()
		return st.Pending == n && st.Held >= n-4*10-20 // waiting_in_memory a shard (4), a batch in flight
	})
	if err := svc.Ready(); err == nil {
		t.Fatal("ready with NATS down")
	}
	e.startNATS()
	e.advanceUntil("every task once NATS is back", func(ds []delivery) bool {
		return len(byValue(ds, "orders.x")) == n
	})
}

// overdueWithNATSDown stores a NATS task ("nats-overdue" for orders.o),
// stops the bridge, moves the clock 10 minutes on (the bridge was down
// that long: the task is overdue at the restart) and shuts NATS down.
func (e *env) overdueWithNATSDown() {
	e.t.Helper()
	svc, stop := e.start()
	e.publishNATS("delay.o", []byte("nats-overdue"), "delay-after", "5s", "delay-target", "orders.o")
	waitIngested(e.t, svc, 1)
	stop()
	e.clk.Advance(10 * time.Minute)
	e.ns.Shutdown()
}

// TestConnectBackoffWhilePaused: while firing waits at start for the
// sources to catch up (the catch-up pause), no delivery asks the
// connector of a transport whose brokers are down for an attempt, so its
// backoff stays at 2 s at most instead of doubling to 30 s: a bridge
// restarted in an outage reached the broker up to 30 s after its return
// (hunt H181: 22 s). Read from the connector's log lines, whose backoff is
// the pause before the next attempt. Only the first attempt's line is a
// Warn; the others, with the same error, are at Debug (one Warn every 2 s
// was about 30 lines a minute per transport, hunt H198).
func TestConnectBackoffWhilePaused(t *testing.T) {
	e := newEnv(t, "catch_up_wait: 10m\n")
	e.kafkaAddr = "127.0.0.1:" + strconv.Itoa(freePort(t)) // nothing listens
	core, logs := observer.New(zap.DebugLevel)
	svc, _, _ := e.runWith(Options{Logger: zap.New(core)})
	var backoffs []time.Duration
	warns := 0
	eventually(t, "five connect attempts to the down Kafka", func() bool {
		backoffs, warns = backoffs[:0], 0
		for _, l := range logs.FilterMessage("brokers unreachable; retrying").FilterField(zap.String("transport", "kafka")).All() {
			backoffs = append(backoffs, time.Duration(l.ContextMap()["backoff"].(time.Duration)))
			if l.Level == zap.WarnLevel {
				warns++
			}
		}
		return len(backoffs) >= 5
	})
	if warns != 1 {
		t.Fatalf("%d Warn lines for %d failed attempts with one error; want the first only (then one per %v)", warns, len(backoffs), logthrottle.DefaultEvery)
	}
	if !svc.Engine().FiringPaused() {
		t.Fatal("firing not paused: the test needs the catch-up pause")
	}
	if want := []time.Duration{500 * time.Millisecond, time.Second, 2 * time.Second, 2 * time.Second, 2 * time.Second}; !slices.Equal(backoffs[:5], want) {
		t.Fatalf("connect backoffs during the catch-up pause %v, want %v", backoffs[:5], want)
	}
}
