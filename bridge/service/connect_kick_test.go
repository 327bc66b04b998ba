package service

import (
	"context"
	"os"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/delaybridge/delaybridge/bridge/nats"
	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/clock"
	"github.com/delaybridge/delaybridge/internal/testlog"
	"github.com/delaybridge/delaybridge/shard"
)

// The connector and the engine's probes of a transport not reached at
// start (lateSink: lateGrace, kick).

// TestBackWithinGraceAfterLastAttempt: a transport not reached at start
// keeps its deliveries waiting for lateGrace (5 s) after its first failed
// attempt, so what was overdue at the restart goes out as soon as a broker
// down for a moment answers. The connector tries at 0, 0.5, 1.5, 3.5 and
// 7.5 s: a broker back at 4 s, within the grace, was not tried before the
// grace ended, and the overdue task then waited its outage backoff
// (retry.max when long overdue; the fake clock does not move here). Now a
// delivery that finds no publisher after the grace asks the connector to
// try at once (kick) and waits for that attempt (found by a hunt).
func TestBackWithinGraceAfterLastAttempt(t *testing.T) {
	e := newEnv(t, "")
	e.overdueWithNATSDown()

	var mu sync.Mutex
	var attempts []time.Time
	svc2, _, _ := e.runWith(Options{NATS: func(c *nats.Config) {
		fastNATS(c)
		mu.Lock()
		attempts = append(attempts, time.Now())
		mu.Unlock()
	}})
	var a1, a4 time.Time
	eventually(t, "4 attempts", func() bool {
		mu.Lock()
		defer mu.Unlock()
		if len(attempts) < 4 {
			return false
		}
		a1, a4 = attempts[0], attempts[3]
		return true
	})
	time.Sleep(time.Until(a4.Add(500 * time.Millisecond)))
	e.startNATS()
	t.Logf("NATS back %v after the first attempt (lateGrace %v)", time.Since(a1), lateGrace)
	deadline := time.Now().Add(15 * time.Second)
	for len(byValue(e.deliveries(), "orders.o")["nats-overdue"]) == 0 {
		if time.Now().After(deadline) {
			mu.Lock()
			n := len(attempts)
			mu.Unlock()
			t.Fatalf("the overdue task was not delivered although NATS answered %v after the first failed attempt, within lateGrace (%d connect attempts; Ready: %v)",
				a4.Add(500*time.Millisecond).Sub(a1), n, svc2.Ready())
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("delivered %v after the first attempt", time.Since(a1))
}

// probeSink records each delivery to a transport and its outcome.
type probeSink struct {
	inner shard.Sink
	mu    sync.Mutex
	fails []time.Time
	oks   []time.Time
}

func (p *probeSink) Deliver(ctx context.Context, batch []*codec.Task) []error {
	errs := p.inner.Deliver(ctx, batch)
	p.mu.Lock()
	defer p.mu.Unlock()
	failed := false
	for _, err := range errs {
		failed = failed || err != nil
	}
	if failed {
		p.fails = append(p.fails, time.Now())
	} else {
		p.oks = append(p.oks, time.Now())
	}
	return errs
}

func (p *probeSink) lastFail() time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.fails) == 0 {
		return time.Time{}
	}
	return p.fails[len(p.fails)-1]
}

// TestDownLongerThanGraceDeliveredWithinRetryMax: NATS is down at
// start for longer than lateGrace, so the tasks for it wait as in an
// outage (held on disk here). An outage of a connected transport delivers
// within retry.max after the broker answers (one probe per retry.max).
// Here the connector must first reach the broker (its backoff, up to
// retry.max) and the engine's probe that failed meanwhile (the broker
// answers, the connector has not retried yet: "not connected yet") is
// not retried before another retry.max: it took up to twice retry.max
// (7.3 s with retry.max 4 s, found by a hunt). A probe now asks the
// connector for an attempt and waits for it (kick).
func TestDownLongerThanGraceDeliveredWithinRetryMax(t *testing.T) {
	if os.Getenv("DELAYBRIDGE_LONG") != "1" {
		t.Skip("long form only (DELAYBRIDGE_LONG=1): real-time connect phases, about 30 s")
	}
	old := lateGrace
	lateGrace = 200 * time.Millisecond
	t.Cleanup(func() { lateGrace = old })
	const retryMax = 4 * time.Second
	e := newEnv(t, "shards: 1\nretry: {initial: 1s, max: 4s, multiplier: 2, jitter: 0, max_attempts: 3, waiting_in_memory: 0}\n")
	e.ns.Shutdown()

	var mu sync.Mutex
	var attempts []time.Time
	natsHook := func(c *nats.Config) {
		fastNATS(c)
		mu.Lock()
		attempts = append(attempts, time.Now())
		mu.Unlock()
	}
	attempt := func(i int) (time.Time, bool) {
		mu.Lock()
		defer mu.Unlock()
		if len(attempts) <= i {
			return time.Time{}, false
		}
		return attempts[i], true
	}
	ctx, cancel := context.WithCancel(context.Background())
	svc, err := New(ctx, e.config(), Options{Logger: testlog.New(t, zaptest.Level(testLogLevel())), Clock: clock.Real{}, Kafka: fastKafka, NATS: natsHook})
	if err != nil {
		t.Fatal(err)
	}
	probe := &probeSink{inner: svc.sinks.NATS}
	svc.sinks.NATS = probe
	done := make(chan error, 1)
	go func() { done <- svc.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Error("Run did not return")
		}
	})

	// The fifth attempt: from there on the connect backoff is retry.max.
	eventually(t, "5 connect attempts", func() bool { _, ok := attempt(4); return ok })
	a5, _ := attempt(4)
	// Ingest a task for NATS at a5+3.5 s: held, probed at +1, +3, +7,
	// +11, ... s, so 2.5 s after each connect attempt.
	time.Sleep(time.Until(a5.Add(3500 * time.Millisecond)))
	e.publishKafka(0, time.Time{}, []byte("k"), []byte("held"), "delay-after", "0", "delay-target", "nats:orders.x")
	eventually(t, "held", func() bool { return svc.Engine().Stats().Held == 1 })

	// At the connect attempt 12 s after a5, check the phase and bring
	// NATS back 200 ms after that attempt (which failed).
	eventually(t, "attempt at a5+12s", func() bool { _, ok := attempt(7); return ok })
	a8, _ := attempt(7)
	time.Sleep(time.Until(a8.Add(200 * time.Millisecond)))
	e.startNATS()
	up := time.Now()
	t.Logf("NATS up %v after the last failed connect attempt; last failed probe %v before", up.Sub(a8), up.Sub(probe.lastFail()))
	e.waitFor("the held task", func(ds []delivery) bool { return len(byValue(ds, "orders.x")["held"]) > 0 })
	late := time.Since(up)
	a9, _ := attempt(8)
	probe.mu.Lock()
	t.Logf("connected %v after NATS was up; failed probes after it was up: %d; delivered %v after it was up (retry.max %v)",
		a9.Sub(up), countAfter(probe.fails, up), late, retryMax)
	probe.mu.Unlock()
	if late > retryMax+time.Second {
		t.Errorf("delivered %v after NATS answered: more than retry.max (%v)", late, retryMax)
	}
}

func countAfter(ts []time.Time, t0 time.Time) int {
	n := 0
	for _, t := range ts {
		if t.After(t0) {
			n++
		}
	}
	return n
}
