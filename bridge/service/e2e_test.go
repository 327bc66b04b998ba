package service

import (
	"context"
	"errors"
	"fmt"
	"github.com/nats-io/nats.go/jetstream"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/delaybridge/delaybridge/bridge/kafka"
	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/config"
	"github.com/delaybridge/delaybridge/shard"
)

// TestMixedDelays publishes messages with delays from 0 ms to 5 minutes on
// both transports, moves the bridge clock forward in steps and checks that
// every message arrives exactly once, on its target, never before its due
// time.
func TestMixedDelays(t *testing.T) {
	e := newEnv(t, "")
	svc, _ := e.start()
	const n = 5000 // per transport: 10 k messages in all
	rng := rand.New(rand.NewPCG(1, 2))
	delays := map[string]time.Duration{}
	for i := range n {
		d := time.Duration(rng.IntN(300_000)) * time.Millisecond
		if i%10 == 0 {
			d = 0
		}
		kv, nv := "k"+strconv.Itoa(i), "n"+strconv.Itoa(i)
		delays[kv], delays[nv] = d, d
		e.publishKafka(int32(i%3), time.Time{}, []byte("key-"+strconv.Itoa(i)), []byte(kv),
			"delay-after", strconv.FormatInt(d.Milliseconds(), 10), "delay-target", "orders")
		e.publishNATS("delay.mixed", []byte(nv), "delay-after", d.String(), "delay-target", "orders.mixed")
	}
	e.advance(svc, 5*time.Minute+10*time.Second, 10*time.Second)
	got := e.advanceUntil("all mixed deliveries", func(ds []delivery) bool { return len(byValue(ds, "")) >= 2*n })
	for v, ds := range byValue(got, "") {
		if len(ds) != 1 {
			t.Errorf("%s delivered %d times", v, len(ds))
		}
		d := ds[0]
		due, err := time.Parse(time.RFC3339Nano, d.header(codec.HeaderDue))
		if err != nil {
			t.Fatalf("%s: delay-due %q: %v", v, d.header(codec.HeaderDue), err)
		}
		if d.at.Before(due) {
			t.Errorf("%s delivered at %v, before its due %v", v, d.at, due)
		}
		if _, ok := delays[v]; !ok {
			t.Errorf("unexpected delivery %q", v)
		}
		wantDest := "orders"
		if strings.HasPrefix(v, "n") {
			wantDest = "orders.mixed"
		}
		if d.dest != wantDest {
			t.Errorf("%s delivered to %s, want %s", v, d.dest, wantDest)
		}
	}
	// A consumer can see a delivery before the engine's delete commit.
	eventually(t, "no pending tasks after every delivery", func() bool { return svc.Engine().Stats().Pending == 0 })
}

// TestContract pins CONTRACT §1-§3 through real brokers: headers in and
// out, replace, cancel (header, tombstone, cancel before schedule),
// equal-due order, cross-transport targets and every dead-letter code.
func TestContract(t *testing.T) {
	e := newEnv(t, "shards: 1\n") // one shard: equal-due tasks of different ids keep source order
	svc, _ := e.start()
	now := time.Now()
	at := func(d time.Duration) string { return now.Add(d).UTC().Format(time.RFC3339Nano) }

	// §2 headers: everything but the control headers, plus id/origin/due.
	e.publishKafka(0, now, []byte("order-1"), []byte("headers"),
		"Delay-After", "30s", "DELAY-TARGET", "orders", "x-app", "shop", "x-multi", "a", "x-multi", "b", "delay-key", "routed-key")
	// Replace: the later schedule with the same id wins.
	e.publishKafka(1, now, []byte("order-2"), []byte("replaced-old"), "delay-after", "20s", "delay-target", "orders")
	e.publishKafka(1, now, []byte("order-2"), []byte("replaced-new"), "delay-after", "40s", "delay-target", "orders")
	// Cancel by header, and by tombstone.
	e.publishKafka(2, now, []byte("order-3"), []byte("cancelled"), "delay-after", "20s", "delay-target", "orders")
	e.publishKafka(2, now, []byte("order-3"), []byte("ignored"), "delay-cancel", "true")
	e.publishKafka(0, now, []byte("order-4"), []byte("tombstoned"), "delay-after", "20s", "delay-target", "orders")
	e.publishKafka(0, now, []byte("order-4"), nil)
	// A cancel on another partition with a later timestamp, read before
	// its (older) schedule: the schedule is dropped when it arrives.
	e.publishKafka(2, now.Add(time.Second), []byte("order-5"), []byte("x"), "delay-cancel", "true")
	e.publishKafka(1, now, []byte("order-5"), []byte("cancelled-early"), "delay-after", "20s", "delay-target", "orders")
	// Equal due, source order.
	for i := range 5 {
		e.publishKafka(0, now, []byte("same"), []byte("equal-"+strconv.Itoa(i)),
			"delay-at", at(25*time.Second), "delay-target", "orders", "delay-id", "eq-"+strconv.Itoa(i))
	}
	// Cross transport both ways.
	e.publishKafka(0, now, []byte("x1"), []byte("to-nats"), "delay-after", "10s", "delay-target", "nats:orders.cross")
	e.publishNATS("delay.x", []byte("to-kafka"), "delay-after", "10s", "delay-target", "kafka:orders", "Nats-Msg-Id", "nx1")
	// NATS replace and cancel by Nats-Msg-Id.
	e.publishNATS("delay.r", []byte("nats-old"), "delay-after", "10s", "delay-target", "orders.r", "Nats-Msg-Id", "n-2")
	e.publishNATS("delay.r", []byte("nats-new"), "delay-after", "15s", "delay-target", "orders.r", "Nats-Msg-Id", "n-2b", "delay-id", "n-2")
	e.publishNATS("delay.r", []byte("nats-cancelled"), "delay-after", "10s", "delay-target", "orders.r", "delay-id", "n-3")
	e.publishNATS("delay.r", []byte(""), "delay-cancel", "true", "delay-id", "n-3")

	// Every §3 code reachable at ingest, on Kafka; and two on NATS.
	bad := []struct {
		code    codec.Code
		headers []string
		value   string
	}{
		{codec.CodeMissingDue, []string{"delay-target", "orders"}, "missing-due"},
		{codec.CodeAmbiguousDue, []string{"delay-after", "1s", "delay-at", at(time.Second), "delay-target", "orders"}, "ambiguous-due"},
		{codec.CodeBadDue, []string{"delay-after", "soon", "delay-target", "orders"}, "bad-due"},
		{codec.CodeDelayTooLong, []string{"delay-after", "31d", "delay-target", "orders"}, "delay-too-long"},
		{codec.CodeMissingTarget, []string{"delay-after", "1s"}, "missing-target"},
		{codec.CodeBadTarget, []string{"delay-after", "1s", "delay-target", "no spaces!"}, "bad-target"},
		{codec.CodeTargetNotAllowed, []string{"delay-after", "1s", "delay-target", "payments"}, "target-not-allowed"},
		{codec.CodeTooLarge, []string{"delay-after", "1s", "delay-target", "orders"}, strings.Repeat("x", 70_000)},
		{codec.CodePublishFailed, []string{"delay-after", "1s", "delay-target", "missing-topic"}, "publish-failed"},
	}
	for _, b := range bad {
		e.publishKafka(1, now, []byte("bad-"+string(b.code)), []byte(b.value), b.headers...)
	}
	e.publishNATS("delay.bad", []byte("nats-missing-due"), "delay-target", "orders.x")
	e.publishNATS("delay.bad", []byte("nats-not-allowed"), "delay-after", "1s", "delay-target", "secret.x")

	// Ingest dead letters at once (fake clock not moved yet).
	e.waitFor("ingest-time dead letters", func(ds []delivery) bool {
		return countDest(ds, func(d delivery) bool { return d.dest == kafkaDLQ || d.dest == "dlq.delay" }) >= len(bad)-1+2
	})
	if got := countDest(e.deliveries(), func(d delivery) bool { return d.dest == kafkaOut || strings.HasPrefix(d.dest, "orders.") }); got != 0 {
		t.Fatalf("%d deliveries to targets before any due time", got)
	}
	// Move past every due time and through the publish-failed retries.
	e.advance(svc, 2*time.Minute, 5*time.Second)
	got := e.advanceUntil("every delivery", func(ds []delivery) bool {
		return countDest(ds, func(d delivery) bool { return d.dest == kafkaDLQ || d.dest == "dlq.delay" }) >= len(bad)+2 &&
			// headers, replaced-new, equal-0..4, to-nats, to-kafka, nats-new
			countDest(ds, func(d delivery) bool { return d.dest == kafkaOut || strings.HasPrefix(d.dest, "orders.") }) >= 10
	})
	vals := byValue(got, "")

	h := one(t, vals, "headers")
	if h.key != "routed-key" {
		t.Errorf("delivered key %q, want delay-key routed-key", h.key)
	}
	var names []string
	for _, x := range h.headers {
		names = append(names, x.Key+"="+string(x.Value))
	}
	wantOrigin := "kafka:delay/0@0"
	wantHeaders := []string{"x-app=shop", "x-multi=a", "x-multi=b", "delay-id=order-1", "delay-origin=" + wantOrigin,
		"delay-due=" + codec.FormatDue(now.Add(30*time.Second).UnixMilli())}
	if strings.Join(names, ",") != strings.Join(wantHeaders, ",") {
		t.Errorf("delivered headers\n got  %v\n want %v", names, wantHeaders)
	}

	one(t, vals, "replaced-new")
	for _, v := range []string{"replaced-old", "cancelled", "tombstoned", "cancelled-early", "nats-old", "nats-cancelled", "ignored"} {
		if len(vals[v]) != 0 {
			t.Errorf("%s was delivered; it was replaced or cancelled", v)
		}
	}
	one(t, vals, "nats-new")
	if d := one(t, vals, "to-nats"); d.transport != "nats" || d.dest != "orders.cross" {
		t.Errorf("to-nats went to %s %s", d.transport, d.dest)
	}
	if d := one(t, vals, "to-kafka"); d.transport != "kafka" || d.dest != kafkaOut || d.header(codec.HeaderID) != "nx1" || d.header(codec.HeaderNatsMsgID) != "nx1" {
		t.Errorf("to-kafka went to %s %s with id %q and Nats-Msg-Id %q (a source header, kept)", d.transport, d.dest,
			d.header(codec.HeaderID), d.header(codec.HeaderNatsMsgID))
	}
	var order []string
	for _, d := range got {
		if strings.HasPrefix(d.value, "equal-") {
			order = append(order, d.value)
		}
	}
	if strings.Join(order, ",") != "equal-0,equal-1,equal-2,equal-3,equal-4" {
		t.Errorf("equal-due order %v", order)
	}

	for _, b := range bad {
		d := one(t, vals, b.value)
		if d.dest != kafkaDLQ || d.header(codec.HeaderError) != string(b.code) || d.header(codec.HeaderErrorDetail) == "" ||
			!strings.HasPrefix(d.header(codec.HeaderOrigin), "kafka:delay/1@") || d.key != "bad-"+string(b.code) {
			t.Errorf("%s: dead letter to %s code %q detail %q origin %q key %q", b.code, d.dest,
				d.header(codec.HeaderError), d.header(codec.HeaderErrorDetail), d.header(codec.HeaderOrigin), d.key)
		}
	}
	if d := one(t, vals, "nats-missing-due"); d.dest != "dlq.delay" || d.header(codec.HeaderError) != string(codec.CodeMissingDue) {
		t.Errorf("nats missing-due: %s %q", d.dest, d.header(codec.HeaderError))
	}
	if d := one(t, vals, "nats-not-allowed"); d.dest != "dlq.delay" || d.header(codec.HeaderError) != string(codec.CodeTargetNotAllowed) {
		t.Errorf("nats target-not-allowed: %s %q", d.dest, d.header(codec.HeaderError))
	}
	// The unchanged dead letter keeps its control headers.
	if d := one(t, vals, "bad-due"); d.header("delay-after") != "soon" {
		t.Errorf("dead letter lost its delay-after header: %v", d.headers)
	}
}

func one(t *testing.T, vals map[string][]delivery, v string) delivery {
	t.Helper()
	ds := vals[v]
	if len(ds) != 1 {
		t.Fatalf("%.40s delivered %d times, want once", v, len(ds))
	}
	return ds[0]
}

// TestRestartZeroLoss stops the bridge the SIGTERM way in the middle of
// firing, starts a new process on the same store, and checks every message
// arrives exactly once.
func TestRestartZeroLoss(t *testing.T) {
	e := newEnv(t, "")
	svc, stop := e.start()
	const n = 300
	for i := range n {
		d := strconv.Itoa(i%60) + "s"
		e.publishKafka(int32(i%3), time.Time{}, []byte("r"+strconv.Itoa(i)), []byte("k"+strconv.Itoa(i)), "delay-after", d, "delay-target", "orders")
		e.publishNATS("delay.r", []byte("n"+strconv.Itoa(i)), "delay-after", d, "delay-target", "orders.r")
	}
	e.advance(svc, 30*time.Second, 5*time.Second)
	stop()
	before := len(e.deliveries())
	// Published while the bridge is down: must be picked up on restart.
	for i := n; i < n+50; i++ {
		e.publishKafka(int32(i%3), time.Time{}, []byte("r"+strconv.Itoa(i)), []byte("k"+strconv.Itoa(i)), "delay-after", "5s", "delay-target", "orders")
		e.publishNATS("delay.r", []byte("n"+strconv.Itoa(i)), "delay-after", "5s", "delay-target", "orders.r")
	}
	svc2, _ := e.start()
	if st := svc2.Engine().Stats(); st.Pending == 0 {
		t.Fatal("restarted bridge recovered no pending tasks")
	}
	e.advance(svc2, 40*time.Second, 5*time.Second)
	got := e.advanceUntil("all deliveries after restart", func(ds []delivery) bool { return len(byValue(ds, "")) >= 2*(n+50) })
	dups := 0
	for v, ds := range byValue(got, "") {
		if len(ds) > 1 {
			dups += len(ds) - 1
			t.Logf("%s delivered %d times", v, len(ds))
		}
	}
	if dups != 0 {
		t.Errorf("%d duplicates after a graceful restart", dups)
	}
	t.Logf("%d delivered before the restart, %d in all", before, len(got))
}

// TestBrokerOutage injects produce failures into the Kafka broker and
// restarts the NATS server while tasks come due: tasks wait (retried with
// backoff), readiness reports the outage, and everything is delivered once
// the brokers are back. With retry.waiting_in_memory 0 every waiting task
// is held on disk instead of the wheel, and released by the probe that
// finds its broker back.
func TestBrokerOutage(t *testing.T) {
	for _, tc := range []struct {
		name, waiting string
		held          int64
	}{
		{"in memory", "", 0},
		{"held on disk", ", waiting_in_memory: 0", 100},
	} {
		t.Run(tc.name, func(t *testing.T) { testBrokerOutage(t, tc.waiting, tc.held) })
	}
}

func testBrokerOutage(t *testing.T, waiting string, wantHeld int64) {
	// Two attempts only: the outage lasts many retry rounds, and a broker
	// that cannot be reached must not use them up (nothing dead-lettered).
	e := newEnv(t, "retry: {initial: 1s, max: 2s, multiplier: 2, jitter: 0, max_attempts: 2"+waiting+"}\n")
	svc, _ := e.start()
	failProduce := e.failProduceTo(kafkaOut)
	const n = 50
	for i := range n {
		e.publishKafka(int32(i%3), time.Time{}, []byte("o"+strconv.Itoa(i)), []byte("k"+strconv.Itoa(i)), "delay-after", "2s", "delay-target", "orders")
		e.publishNATS("delay.o", []byte("n"+strconv.Itoa(i)), "delay-after", "2s", "delay-target", "orders.o")
	}
	waitIngested(t, svc, 2*n)

	failProduce.Store(true)
	e.ns.Shutdown()
	e.clk.Advance(3 * time.Second) // all due now, both brokers refuse
	eventually(t, "readiness to report the NATS outage", func() bool { return svc.Ready() != nil })
	// Let several retry rounds fail.
	for range 5 {
		e.clk.Advance(2 * time.Second)
		time.Sleep(50 * time.Millisecond) // give the fire loops real time to fail a round; correctness does not depend on it
	}
	if got := countDest(e.deliveries(), func(d delivery) bool { return d.dest == kafkaOut || d.dest == "orders.o" }); got != 0 {
		t.Fatalf("%d delivered during the outage", got)
	}
	// Every task is still pending; with waiting_in_memory 0 each is held
	// once a round has failed it, which under load may take more rounds
	// than the five above (CI once saw 85 of 100 held after them).
	var st shard.Stats
	eventually(t, fmt.Sprintf("all %d tasks pending, %d held", 2*n, wantHeld), func() bool {
		if st = svc.Engine().Stats(); st.Pending != 2*n {
			t.Fatalf("pending during outage = %d, held %d; want %d (nothing lost, nothing dead-lettered)", st.Pending, st.Held, 2*n)
		}
		if st.Held == wantHeld {
			return true
		}
		e.clk.Advance(2 * time.Second) // another retry round
		return false
	})
	if got := countDest(e.deliveries(), func(d delivery) bool { return d.dest == kafkaOut || d.dest == "orders.o" }); got != 0 {
		t.Fatalf("%d delivered during the outage", got)
	}

	failProduce.Store(false)
	e.startNATS()
	got := e.advanceUntil("the backlog after the outage", func(ds []delivery) bool {
		return len(byValue(ds, kafkaOut))+len(byValue(ds, "orders.o")) >= 2*n
	})
	if dl := countDest(got, func(d delivery) bool { return d.dest == kafkaDLQ || d.dest == "dlq.delay" }); dl != 0 {
		t.Errorf("%d dead letters; the outage must only delay delivery", dl)
	}
	// The Kafka publisher is healthy again once a publish succeeded.
	eventually(t, "readiness after the outage", func() bool { return svc.Ready() == nil })
}

// TestDLQOutageHoldsCommit is CONTRACT §3 with the DLQ down: the source
// offset of a bad message is committed only after the DLQ acknowledged its
// dead letter. While every produce to the DLQ topic fails, the group's
// offset of the partition stays before the bad message and the bridge is
// not ready; once the DLQ takes it, the offset moves past it.
func TestDLQOutageHoldsCommit(t *testing.T) {
	e := newEnv(t, "retry: {initial: 1s, max: 2s, multiplier: 2, jitter: 0, max_attempts: 2}\n")
	svc, _ := e.start()
	failDLQ := e.failProduceTo(kafkaDLQ)
	committed := func() (int64, bool) {
		gi := e.kc.GroupInfo("bridge")
		if gi == nil {
			return 0, false
		}
		c, ok := gi.Commits[kafkaDelay][0]
		return c.Offset, ok
	}
	// A good message first, so the partition has a commit to compare with.
	e.publishKafka(0, time.Time{}, []byte("k0"), []byte("good"), "delay-after", "1h", "delay-target", "orders")
	eventually(t, "the good message's commit", func() bool { off, ok := committed(); return ok && off == 1 })

	failDLQ.Store(true)
	e.publishKafka(0, time.Time{}, []byte("k1"), []byte("bad"), "delay-target", "orders") // missing-due
	eventually(t, "readiness to report the DLQ", func() bool { return svc.Ready() != nil })
	for range 5 { // several failed rounds of the dead letter's delivery
		e.clk.Advance(2 * time.Second)
		time.Sleep(20 * time.Millisecond) // real time for a round to fail; correctness does not depend on it
	}
	if off, _ := committed(); off != 1 {
		t.Fatalf("committed offset %d while the DLQ refused the dead letter, want 1 (not past the bad message)", off)
	}

	failDLQ.Store(false)
	got := e.advanceUntil("the dead letter", func(ds []delivery) bool { return len(byValue(ds, kafkaDLQ)) > 0 })
	if dl := byValue(got, kafkaDLQ)["bad"]; len(dl) == 0 || dl[0].header("delay-error") != "missing-due" {
		t.Fatalf("DLQ deliveries %v, want the bad message with delay-error missing-due", byValue(got, kafkaDLQ))
	}
	eventually(t, "the commit past the bad message", func() bool { off, _ := committed(); return off == 2 })
	eventually(t, "readiness after the DLQ recovered", func() bool { return svc.Ready() == nil })
}

// TestDLQRefusalParks: a DLQ topic that refuses a dead letter (here every
// produce to it answered MESSAGE_TOO_LARGE, as when its max.message.bytes
// is below the delay topic's) is not an outage: after the retry policy's
// attempts the dead letter is parked, the partition's offset moves past
// the bad message (one bad message never stalls its partition), the
// bridge stays not ready, and the dead letter still reaches the DLQ once
// the topic takes it.
func TestDLQRefusalParks(t *testing.T) {
	e := newEnv(t, "retry: {initial: 1s, max: 2s, multiplier: 2, jitter: 0, max_attempts: 2}\n")
	svc, _ := e.start()
	committed := func() int64 { return e.committedOffset(0) }
	e.publishKafka(0, time.Time{}, []byte("k0"), []byte("good"), "delay-after", "1h", "delay-target", "orders")
	eventually(t, "the good message's commit", func() bool { return committed() == 1 })

	refuse := e.kc.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: kafkaDLQ, Err: kerr.MessageTooLarge, Count: -1})
	e.publishKafka(0, time.Time{}, []byte("k1"), []byte("bad"), "delay-target", "orders") // missing-due
	eventually(t, "readiness to report the DLQ", func() bool { return svc.Ready() != nil })
	e.advanceUntil("the commit past the parked dead letter", func([]delivery) bool { return committed() == 2 })
	if err := svc.Ready(); err == nil {
		t.Fatal("ready while the DLQ refuses a dead letter")
	}
	if n := len(byValue(e.deliveries(), kafkaDLQ)["bad"]); n != 0 {
		t.Fatalf("%d dead letters delivered to a DLQ that refuses them", n)
	}
	if refuse.Hits() < 2 {
		t.Fatalf("%d refused produces, want the policy's 2 attempts at least", refuse.Hits())
	}

	refuse.Remove()
	got := e.advanceUntil("the dead letter", func(ds []delivery) bool { return len(byValue(ds, kafkaDLQ)["bad"]) > 0 })
	if dl := byValue(got, kafkaDLQ)["bad"]; dl[0].header("delay-error") != "missing-due" {
		t.Fatalf("dead letter with delay-error %q, want missing-due", dl[0].header("delay-error"))
	}
	eventually(t, "readiness after the DLQ took it", func() bool { return svc.Ready() == nil })
}

// TestDLQNotAuthorizedHoldsCommit: a DLQ topic the bridge may not write
// (every produce to it answered TOPIC_AUTHORIZATION_FAILED) fails as a
// whole, not as this message: however many attempts past the retry policy,
// the dead letter is not parked, the partition's offset stays before the
// bad message (CONTRACT §3: the bridge does not commit, retries with
// backoff, reports not-ready) and moves past it once the DLQ takes it.
func TestDLQNotAuthorizedHoldsCommit(t *testing.T) {
	e := newEnv(t, "retry: {initial: 1s, max: 2s, multiplier: 2, jitter: 0, max_attempts: 2}\n")
	svc, _ := e.start()
	committed := func() int64 { return e.committedOffset(0) }
	e.publishKafka(0, time.Time{}, []byte("k0"), []byte("good"), "delay-after", "1h", "delay-target", "orders")
	eventually(t, "the good message's commit", func() bool { return committed() == 1 })

	deny := e.kc.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: kafkaDLQ, Err: kerr.TopicAuthorizationFailed, Count: -1})
	e.publishKafka(0, time.Time{}, []byte("k1"), []byte("bad"), "delay-target", "orders") // missing-due
	eventually(t, "readiness to report the DLQ", func() bool { return svc.Ready() != nil })
	// Three times the policy's attempts.
	e.advanceUntil("refused produces past the retry policy", func([]delivery) bool { return deny.Hits() >= 6 })
	if off := committed(); off != 1 {
		t.Fatalf("committed offset %d while the DLQ topic may not be written, want 1 (not past the bad message)", off)
	}
	if err := svc.Ready(); err == nil {
		t.Fatal("ready while the DLQ topic may not be written")
	}
	if n := len(byValue(e.deliveries(), kafkaDLQ)["bad"]); n != 0 {
		t.Fatalf("%d dead letters delivered to a DLQ that refuses them", n)
	}

	deny.Remove()
	got := e.advanceUntil("the dead letter", func(ds []delivery) bool { return len(byValue(ds, kafkaDLQ)["bad"]) > 0 })
	if dl := byValue(got, kafkaDLQ)["bad"]; dl[0].header("delay-error") != "missing-due" {
		t.Fatalf("dead letter with delay-error %q, want missing-due", dl[0].header("delay-error"))
	}
	eventually(t, "the commit past the bad message", func() bool { return committed() == 2 })
	eventually(t, "readiness after the DLQ took it", func() bool { return svc.Ready() == nil })
}

// TestNATSDLQOutageHoldsAck is TestDLQOutageHoldsCommit on NATS: while the
// DLQ stream cannot store a dead letter, the bad message stays
// unacknowledged (the consumer's ack floor stays before it) until the
// stream takes the dead letter. A stream full with DiscardNew fails as a
// whole: it holds the ack however many attempts past the retry policy. A
// stream whose max_msg_size refuses the dead letter as this message holds
// it too within the retry policy; at its last attempt the dead letter is
// parked in the store so that the subject moves on (CONTRACT §3: one bad
// message never stalls its partition): the bad message is acked, the
// bridge stays not ready, and the dead letter is still delivered once the
// stream takes it.
func TestNATSDLQOutageHoldsAck(t *testing.T) {
	for _, tc := range []struct {
		name        string
		maxAttempts int
		full        bool // the DLQ stream is full (DiscardNew); else its max_msg_size refuses the dead letter
		parked      bool
	}{
		{"too large, within the retry policy", 1000, false, false},
		{"too large every attempt", 2, false, true},
		{"stream full, past the retry policy", 2, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, fmt.Sprintf("retry: {initial: 1s, max: 2s, multiplier: 2, jitter: 0, max_attempts: %d}\n", tc.maxAttempts))
			svc, _ := e.start()
			js, ackFloor, tried := watchNATSHold(t, e)
			ctx := context.Background()
			e.publishNATS("delay.o", []byte("good"), "delay-after", "1h", "delay-target", "orders.o")
			eventually(t, "the good message's ack", func() bool { return ackFloor() == 1 })

			dlqStream := func(limit int64) {
				t.Helper()
				cfg := jetstream.StreamConfig{Name: "DLQ", Subjects: []string{"dlq.>"}, MaxMsgSize: int32(limit)}
				if tc.full {
					cfg = jetstream.StreamConfig{Name: "DLQ", Subjects: []string{"dlq.>"}, MaxMsgs: limit, Discard: jetstream.DiscardNew}
				}
				if _, err := js.UpdateStream(ctx, cfg); err != nil {
					t.Fatal(err)
				}
			}
			if tc.full {
				if _, err := js.Publish(ctx, "dlq.filler", []byte("filler")); err != nil {
					t.Fatal(err)
				}
			}
			dlqStream(1)
			e.publishNATS("delay.o", []byte("bad"), "delay-target", "orders.o") // missing-due
			eventually(t, "readiness to report the DLQ", func() bool { return svc.Ready() != nil })
			if tc.parked {
				e.advanceUntil("the ack of the parked dead letter's message", func([]delivery) bool { return ackFloor() == 2 })
				if err := svc.Ready(); err == nil {
					t.Fatal("ready while the DLQ refuses a dead letter")
				}
				if n := len(byValue(e.deliveries(), "dlq.delay")["bad"]); n != 0 {
					t.Fatalf("%d dead letters delivered to a DLQ that refuses them", n)
				}
			} else {
				// Three times the (short) policy's attempts.
				e.advanceUntil("failed attempts", func([]delivery) bool { return tried() >= 6 })
				if f := ackFloor(); f != 1 {
					t.Fatalf("ack floor %d after %d attempts while the DLQ could not be written, want 1 (the bad message not acked)", f, tried())
				}
				if err := svc.Ready(); err == nil {
					t.Fatal("ready while the DLQ cannot be written")
				}
			}

			dlqStream(-1)
			e.advanceUntil("the dead letter", func(ds []delivery) bool { return len(byValue(ds, "dlq.delay")["bad"]) > 0 })
			eventually(t, "the ack of the bad message", func() bool { return ackFloor() == 2 })
			eventually(t, "readiness after the DLQ recovered", func() bool { return svc.Ready() == nil })
		})
	}
}

// TestKafkaPublisherOutageNotReady: the Kafka source keeps fetching while
// every produce to the target fails at the connection; the publisher alone
// must make the bridge not ready, and ready again once produces succeed.
func TestKafkaPublisherOutageNotReady(t *testing.T) {
	e := newEnv(t, "retry: {initial: 1s, max: 2s, multiplier: 2, jitter: 0, max_attempts: 1000}\n")
	svc, _ := e.start()
	failProduce := e.failProduceTo(kafkaOut)
	// Stamped with the bridge's clock: due 1 s after it whatever real time
	// the setup took (a real stamp ran ahead of the fake clock under load).
	e.publishKafka(0, e.clk.Now(), []byte("v"), []byte("k"), "delay-after", "1s", "delay-target", "orders")
	waitIngested(t, svc, 1)
	// Kafka ingesting says nothing of NATS: wait until both are connected.
	eventually(t, "ready before the outage", func() bool { return svc.Ready() == nil })
	failProduce.Store(true)
	e.clk.Advance(2 * time.Second)
	eventually(t, "readiness to report the Kafka publisher", func() bool {
		err := svc.Ready()
		return err != nil && strings.Contains(err.Error(), "kafka: publish")
	})
	failProduce.Store(false)
	e.advanceUntil("the delivery after the outage", func(ds []delivery) bool { return len(byValue(ds, kafkaOut)) > 0 })
	eventually(t, "readiness after the outage", func() bool { return svc.Ready() == nil })
}

// TestReadyGaugeWithoutProbe: delaybridge_ready follows readiness while
// nobody calls /readyz (no Kubernetes probe), so its alert means something.
func TestReadyGaugeWithoutProbe(t *testing.T) {
	e := newEnv(t, "")
	svc, stop := e.start()
	e.publishKafka(0, time.Time{}, []byte("v"), []byte("k"), "delay-after", "1h", "delay-target", "orders")
	waitIngested(t, svc, 1)
	eventually(t, "delaybridge_ready 1", func() bool { return testutil.ToFloat64(svc.m.Ready) == 1 })
	stop()
	if got := testutil.ToFloat64(svc.m.Ready); got != 0 {
		t.Fatalf("delaybridge_ready = %g after shutdown, want 0", got)
	}
	if err := svc.Ready(); err == nil || !strings.Contains(err.Error(), "shutting down") {
		t.Fatalf("Ready after shutdown = %v, want shutting down", err)
	}
}

func waitIngested(t *testing.T, svc *Service, n int64) {
	t.Helper()
	eventually(t, "ingest", func() bool { return svc.Engine().Stats().Pending >= n })
}

// waitStored waits until each of ids is a task of source in the store and
// pending tasks are left in all. A pending count alone is not enough after
// a wait for deliveries: a task delivered is still counted until its
// delete is durable, so the count may be reached while one of ids is not
// taken in yet, and a stop then leaves it unacked on its source.
func waitStored(t *testing.T, svc *Service, pending int64, source string, ids ...string) {
	t.Helper()
	eventually(t, fmt.Sprintf("%s %q stored, %d pending", source, ids, pending), func() bool {
		for _, id := range ids {
			if _, err := svc.Engine().Lookup(source, id); err != nil {
				return false
			}
		}
		return svc.Engine().Stats().Pending == pending
	})
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("timed out waiting for %s", what)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// TestStartWithBrokersDown starts the bridge while neither broker listens:
// it must not exit (no crash loop), report not-ready with the reason, and
// work once the brokers come up.
func TestStartWithBrokersDown(t *testing.T) {
	e := newEnv(t, "")
	kafkaPort := freePort(t)
	e.kafkaAddr = "127.0.0.1:" + strconv.Itoa(kafkaPort)
	e.ns.Shutdown()
	svc, stop := e.start()
	eventually(t, "not-ready while connecting", func() bool {
		err := svc.Ready()
		return err != nil && strings.Contains(err.Error(), "connecting to brokers:")
	})
	// Bring both up: a fresh Kafka-protocol broker on the configured port
	// and the NATS server back on its port.
	kc, err := kfake.NewCluster(kfake.Ports(kafkaPort), kfake.SeedTopics(3, kafkaDelay, kafkaDLQ, kafkaOut))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close)
	e.startNATS()
	eventually(t, "ready after the brokers came up", func() bool { return svc.Ready() == nil })

	cl, err := kgo.NewClient(kgo.SeedBrokers(e.kafkaAddr), kgo.ConsumeTopics(kafkaOut), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	rec := &kgo.Record{Topic: kafkaDelay, Key: []byte("late"), Value: []byte("after-outage"), Timestamp: e.clk.Now(),
		Headers: []kgo.RecordHeader{{Key: "delay-after", Value: []byte("1s")}, {Key: "delay-target", Value: []byte("orders")}}}
	if err := cl.ProduceSync(context.Background(), rec).FirstErr(); err != nil {
		t.Fatal(err)
	}
	e.publishNATS("delay.late", []byte("nats-after-outage"), "delay-after", "1s", "delay-target", "orders.late")
	waitIngested(t, svc, 2)
	// The NATS task is due 1 s after its JetStream (real) time, which the
	// fake clock, started at newEnv, trails by however long the brokers
	// took to come up: move it until the task is delivered.
	e.advanceUntil("NATS delivery after a start with brokers down", func(ds []delivery) bool { return len(byValue(ds, "orders.late")) == 1 })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for got := false; !got; {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatal("Kafka delivery after a start with brokers down did not arrive")
		}
		fs.EachRecord(func(r *kgo.Record) { got = got || string(r.Value) == "after-outage" })
	}
	stop()
}

// runToStartError runs a bridge on the configuration yml for at most 30 s
// and returns whether that deadline passed and Run's error.
func runToStartError(t *testing.T, yml string) (timedOut bool, err error) {
	t.Helper()
	cfg, err := config.LoadBytes([]byte(yml), nil)
	if err != nil {
		t.Fatal(err)
	}
	svc, err := New(context.Background(), cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err = svc.Run(ctx)
	return ctx.Err() != nil, err
}

// kafkaOnlyYAML is a Kafka-only configuration on brokers (delay topic
// "delay", DLQ "delay.dlq"), with a temp data dir and an admin port of its
// own; more is YAML added to the kafka block, indented two spaces.
func kafkaOnlyYAML(t *testing.T, brokers []string, more string) string {
	q := make([]string, len(brokers))
	for i, b := range brokers {
		q[i] = strconv.Quote(b)
	}
	return "data_dir: " + strconv.Quote(t.TempDir()) + "\nkafka:\n  brokers: [" + strings.Join(q, ", ") + "]\n" + more +
		"  sources: [{topic: delay, dlq: delay.dlq}]\nadmin: {listen: \"127.0.0.1:0\"}\n"
}

// runKafkaOnly runs a Kafka-only bridge (kafkaOnlyYAML) on brokers with o;
// see runYAML.
func runKafkaOnly(t *testing.T, brokers []string, o Options) (svc *Service, cancel context.CancelFunc, done <-chan error) {
	t.Helper()
	return runYAML(t, kafkaOnlyYAML(t, brokers, ""), o)
}

// runYAML runs a bridge with the config yml and o, and returns its cancel
// (SIGTERM) and Run's result; at Cleanup it is cancelled and waited for.
func runYAML(t *testing.T, yml string, o Options) (svc *Service, cancel context.CancelFunc, done <-chan error) {
	t.Helper()
	cfg, err := config.LoadBytes([]byte(yml), nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	svc, err = New(ctx, cfg, o)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	ch, finished := make(chan error, 1), make(chan struct{})
	go func() {
		defer close(finished)
		ch <- svc.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-finished:
		case <-time.After(30 * time.Second):
			t.Error("bridge did not stop within 30s")
		}
	})
	return svc, cancel, ch
}

// TestWrongPasswordFailsFast: refused credentials are an error at start,
// not a retry loop; also when another configured broker's name does not
// resolve. The check joins every broker's dial error, so the refusal of
// the first and the *net.DNSError of the second are one error, and a
// first version of the test for an unreachable broker matched the DNS
// error anywhere in it and retried the refused login forever.
func TestWrongPasswordFailsFast(t *testing.T) {
	kc, err := kfake.NewCluster(kfake.EnableSASL(), kfake.Superuser("PLAIN", "bridge", "right"), kfake.SeedTopics(1, kafkaDelay, kafkaDLQ))
	if err != nil {
		t.Fatal(err)
	}
	defer kc.Close()
	for _, tc := range []struct {
		name    string
		brokers []string
	}{
		{"one broker", []string{kc.ListenAddrs()[0]}},
		{"and an unresolvable one", []string{kc.ListenAddrs()[0], "nosuchhost.invalid:9092"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			timedOut, err := runToStartError(t, kafkaOnlyYAML(t, tc.brokers, "  sasl: {mechanism: PLAIN, username: bridge, password: wrong}\n"))
			if !errors.Is(err, kafka.ErrAuth) {
				t.Fatalf("Run = %v, want an error wrapping kafka.ErrAuth", err)
			}
			if timedOut {
				t.Fatal("Run retried until the deadline instead of failing fast")
			}
		})
	}
}

// TestNATSCredentialsNotInStartError: a refused nats.url login fails the
// start with an error that does not carry the password.
func TestNATSCredentialsNotInStartError(t *testing.T) {
	ns := startNATSServer(t, &natsserver.Options{Username: "bridge", Password: "right"})
	const secret = "s3cret-wrong-pw"
	yml := `
data_dir: ` + strconv.Quote(t.TempDir()) + `
nats:
  url: ` + strconv.Quote("nats://bridge:"+secret+"@"+ns.Addr().String()) + `
  stream: DELAY
  create: true
  sources: [{subject: delay.>, dlq: dlq.delay}]
admin: {listen: "127.0.0.1:0"}
`
	timedOut, err := runToStartError(t, yml)
	if err == nil || timedOut {
		t.Fatalf("Run = %v (deadline passed: %v), want a refused login at start", err, timedOut)
	}
	if strings.Contains(err.Error(), secret) {
		t.Fatalf("start error carries the password: %v", err)
	}
	t.Logf("start error: %v", err)
}
