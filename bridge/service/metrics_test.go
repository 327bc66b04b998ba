package service

import (
	"context"
	"fmt"
	"io"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/delaybridge/delaybridge/codec"
)

func histCount(t *testing.T, o prometheus.Observer) (uint64, float64) {
	t.Helper()
	var d dto.Metric
	if err := o.(prometheus.Metric).Write(&d); err != nil {
		t.Fatal(err)
	}
	return d.Histogram.GetSampleCount(), d.Histogram.GetSampleSum()
}

// TestMetricsEndToEnd: a known mix through real brokers; every CONTRACT §7
// counter must end at exactly the expected value.
func TestMetricsEndToEnd(t *testing.T) {
	e := newEnv(t, "")
	svc, _ := e.start()
	m := svc.m
	now := e.clk.Now()
	at := func(d time.Duration) string { return now.Add(d).UTC().Format(time.RFC3339Nano) }
	k := func(key, val string, h ...string) { e.publishKafka(0, now, []byte(key), []byte(val), h...) }
	var nilv []byte
	// 3 plain schedules
	for _, id := range []string{"s1", "s2", "s3"} {
		k(id, id, "delay-at", at(10*time.Second), "delay-target", "orders")
	}
	// replace
	k("r1", "r1-old", "delay-at", at(10*time.Second), "delay-target", "orders")
	k("r1", "r1-new", "delay-at", at(12*time.Second), "delay-target", "orders")
	// cancel by header, by tombstone, of an unknown id
	k("c1", "c1", "delay-at", at(10*time.Second), "delay-target", "orders")
	k("c1", "", "delay-cancel", "true")
	k("c2", "c2", "delay-at", at(10*time.Second), "delay-target", "orders")
	e.publishKafka(0, now, []byte("c2"), nilv)
	k("ghost", "", "delay-cancel", "true")
	// admin cancel
	k("a1", "a1", "delay-at", at(10*time.Second), "delay-target", "orders")
	// bad messages
	k("b1", "b1", "delay-target", "orders")                        // missing-due
	k("b2", "b2", "delay-after", "soon", "delay-target", "orders") // bad-due
	k("b3", "b3", "delay-after", "1s", "delay-target", "payments") // target-not-allowed
	k("pf", "pf", "delay-at", at(10*time.Second), "delay-target", "kafka:missing-topic")
	k("flaky", "flaky", "delay-at", at(30*time.Second), "delay-target", "orders")
	const kafkaMsgs = 16
	// NATS
	e.publishNATS("delay.m", []byte("n1-old"), "delay-at", at(10*time.Second), "delay-target", "orders.m", "delay-id", "n1")
	e.publishNATS("delay.m", []byte("n1-new"), "delay-at", at(11*time.Second), "delay-target", "orders.m", "delay-id", "n1")
	e.publishNATS("delay.m", []byte("n2"), "delay-at", at(10*time.Second), "delay-target", "orders.m", "delay-id", "n2")
	e.publishNATS("delay.m", []byte(""), "delay-cancel", "true", "delay-id", "n2")
	e.publishNATS("delay.m", []byte("nbad"), "delay-target", "orders.m")
	const natsMsgs = 5

	eventually(t, "all ingested", func() bool {
		return testutil.ToFloat64(m.Ingested.WithLabelValues("delay")) >= kafkaMsgs &&
			testutil.ToFloat64(m.Ingested.WithLabelValues("DELAY")) >= natsMsgs
	})
	if err := svc.Engine().Cancel("delay", "a1"); err != nil {
		t.Fatal(err)
	}
	// Cancel of an unknown id through admin: not counted.
	if err := svc.Engine().Cancel("delay", "nope"); err == nil {
		t.Fatal("cancel of unknown id succeeded")
	}
	// ingest-time dead letters: 3 kafka + 1 nats
	e.waitFor("ingest dead letters", func(ds []delivery) bool {
		return countDest(ds, func(d delivery) bool { return d.dest == kafkaDLQ || d.dest == "dlq.delay" }) >= 4
	})
	e.advance(svc, 15*time.Second, 5*time.Second)
	e.advanceUntil("publish-failed and the 10s tasks", func(ds []delivery) bool {
		return len(byValue(ds, kafkaDLQ)) >= 4 && len(byValue(ds, kafkaOut)) >= 4 && len(byValue(ds, "orders.m")) >= 1
	})
	// Now make the flaky one fail twice with a charged error, then succeed.
	fault := e.kc.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: kafkaOut, Err: kerr.TopicAuthorizationFailed, Count: 2})
	_ = fault
	e.advanceUntil("flaky", func(ds []delivery) bool { return len(byValue(ds, kafkaOut)["flaky"]) > 0 })
	eventually(t, "no pending", func() bool { return svc.Engine().Stats().Pending == 0 })
	want := []struct {
		name string
		c    prometheus.Collector
		v    float64
	}{
		{"ingested delay", m.Ingested.WithLabelValues("delay"), kafkaMsgs},
		{"ingested DELAY", m.Ingested.WithLabelValues("DELAY"), natsMsgs},
		{"fired kafka task", m.Fired.WithLabelValues("kafka", "task"), 5},
		{"fired kafka dlq", m.Fired.WithLabelValues("kafka", "dlq"), 4},
		{"fired nats task", m.Fired.WithLabelValues("nats", "task"), 1},
		{"fired nats dlq", m.Fired.WithLabelValues("nats", "dlq"), 1},
		{"dl missing-due", m.DeadLettered.WithLabelValues(string(codec.CodeMissingDue)), 2},
		{"dl bad-due", m.DeadLettered.WithLabelValues(string(codec.CodeBadDue)), 1},
		{"dl not-allowed", m.DeadLettered.WithLabelValues(string(codec.CodeTargetNotAllowed)), 1},
		{"dl publish-failed", m.DeadLettered.WithLabelValues(string(codec.CodePublishFailed)), 1},
		{"cancelled delay", m.Cancelled.WithLabelValues("delay"), 3},
		{"cancelled DELAY", m.Cancelled.WithLabelValues("DELAY"), 1},
		{"replaced delay", m.Replaced.WithLabelValues("delay"), 1},
		{"replaced DELAY", m.Replaced.WithLabelValues("DELAY"), 1},
		{"publish retries kafka", m.PublishRetries.WithLabelValues("kafka"), 4},
		{"overdue", m.Overdue, 0},
	}
	mismatches := func() []string {
		var out []string
		for _, w := range want {
			if got := testutil.ToFloat64(w.c); got != w.v {
				out = append(out, fmt.Sprintf("%s = %v, want %v", w.name, got, w.v))
			}
		}
		return out
	}
	// The counters move after each batch's commit: poll until they hold
	// (or report what differs).
	deadline := time.Now().Add(30 * time.Second)
	for len(mismatches()) > 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	for _, m := range mismatches() {
		t.Error(m)
	}
	var pend float64
	for i := 0; i < 4; i++ {
		pend += testutil.ToFloat64(m.Pending.WithLabelValues(string(rune('0' + i))))
	}
	if pend != 0 {
		t.Errorf("pending gauge sum %v, want 0", pend)
	}
	if n, s := histCount(t, m.FireLateness.WithLabelValues("kafka")); n != 5 {
		t.Errorf("kafka lateness samples %d (sum %v), want 5", n, s)
	}
	if n, s := histCount(t, m.FireLateness.WithLabelValues("nats")); n != 1 {
		t.Errorf("nats lateness samples %d (sum %v), want 1", n, s)
	}
	t.Logf("fault hits %d", fault.Hits())
}

// TestKafkaSourceLagWhileHeld: while a partition is held (its DLQ fails), the
// messages published to it are not taken in; delaybridge_source_lag_messages
// must count them.
// TestKafkaSourceLagWhileHeld: a partition held by a dead letter its DLQ
// will not take keeps counting what is published to it in
// delaybridge_source_lag_messages (it froze at the last fetch).
func TestKafkaSourceLagWhileHeld(t *testing.T) {
	e := newEnv(t, "")
	svc, _ := e.start()
	failDLQ := e.failProduceTo(kafkaDLQ)
	lag := func() float64 { return testutil.ToFloat64(svc.m.SourceLag.WithLabelValues(kafkaDelay, "0")) }
	e.publishKafka(0, time.Time{}, []byte("k0"), []byte("good"), "delay-after", "1h", "delay-target", "orders")
	eventually(t, "commit of the good message", func() bool { return e.committedOffset(0) == 1 })
	failDLQ.Store(true)
	e.publishKafka(0, time.Time{}, []byte("k1"), []byte("bad"), "delay-target", "orders") // missing-due: held
	eventually(t, "not ready", func() bool { return svc.Ready() != nil })
	off := 2
	for round := 1; round <= 4; round++ {
		for range 5 {
			e.publishKafka(0, time.Time{}, []byte("k"), []byte("v"), "delay-after", "1h", "delay-target", "orders")
			off++
		}
		want := float64(off - 1) // offsets 1..off-1 not taken in (committed/stored is 1)
		deadline := time.Now().Add(10 * time.Second)
		for lag() < want && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		t.Logf("round %d: lag gauge %v, messages not taken in %v", round, lag(), want)
		if lag() < want {
			t.Fatalf("round %d: delaybridge_source_lag_messages{delay,0} = %v while %v messages of the held partition are not taken in", round, lag(), want)
		}
	}
}

// TestNATSSourceLagWhileHeld: as TestKafkaSourceLagWhileHeld, on the JetStream
// source: the DLQ stream refuses the dead letter (max_msg_size), the
// consumer is held; messages published meanwhile must show as lag.
// TestNATSSourceLagWhileHeld: the same for a NATS consumer held by a dead
// letter (the gauge stayed at the last batch's pending count, 0).
func TestNATSSourceLagWhileHeld(t *testing.T) {
	e := newEnv(t, "retry: {initial: 1s, max: 2s, multiplier: 2, jitter: 0, max_attempts: 1000}\n")
	svc, _ := e.start()
	lag := func() float64 { return testutil.ToFloat64(svc.m.SourceLag.WithLabelValues("DELAY", "0")) }
	js, err := jetstream.New(e.nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	e.publishNATS("delay.o", []byte("good"), "delay-after", "1h", "delay-target", "orders.o")
	waitIngested(t, svc, 1)
	if _, err := js.UpdateStream(ctx, jetstream.StreamConfig{Name: "DLQ", Subjects: []string{"dlq.>"}, MaxMsgSize: 1}); err != nil {
		t.Fatal(err)
	}
	e.publishNATS("delay.o", []byte("bad"), "delay-target", "orders.o") // missing-due: held
	eventually(t, "not ready", func() bool { return svc.Ready() != nil })
	for i := range 20 {
		e.publishNATS("delay.o", []byte("v"+strconv.Itoa(i)), "delay-after", "1h", "delay-target", "orders.o")
	}
	deadline := time.Now().Add(10 * time.Second)
	for lag() < 20 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if lag() < 20 {
		t.Fatalf("delaybridge_source_lag_messages{DELAY,0} = %v while 20 messages published after the held one are not taken in", lag())
	}
}

// TestFireLatenessOfAnOverduePublish documents what lateness an overdue-at-ingest task
// records, and what an outage does to publish_retries_total.
// TestFireLatenessOfAnOverduePublish: a task published already overdue
// (delay-at in the past) is counted by delaybridge_overdue_total; its fire
// lateness counts from its broker time, not from a due time before it
// existed, so one publisher's past due times do not page as a slow bridge.
func TestFireLatenessOfAnOverduePublish(t *testing.T) {
	e := newEnv(t, "retry: {initial: 1s, max: 2s, multiplier: 2, jitter: 0, max_attempts: 2}\n")
	svc, _ := e.start()
	m := svc.m
	past := e.clk.Now().Add(-time.Hour).UTC().Format(time.RFC3339Nano)
	e.publishKafka(0, time.Time{}, []byte("late"), []byte("late"), "delay-at", past, "delay-target", "orders")
	e.waitFor("late", func(ds []delivery) bool { return len(byValue(ds, kafkaOut)) > 0 })
	eventually(t, "lateness sample", func() bool { n, _ := histCount(t, m.FireLateness.WithLabelValues("kafka")); return n == 1 })
	_, sum := histCount(t, m.FireLateness.WithLabelValues("kafka"))
	t.Logf("overdue=%v lateness sum=%vs", testutil.ToFloat64(m.Overdue), sum)
	if got := testutil.ToFloat64(m.Overdue); got != 1 {
		t.Errorf("delaybridge_overdue_total = %v, want 1", got)
	}
	if sum >= 60 {
		t.Errorf("a task published 1h overdue recorded %vs of fire lateness: the publisher's past delay-at, not the bridge, made it late", sum)
	}
}

// TestContractMetricsAtStart: a started bridge's /metrics has a series
// of every CONTRACT §7 metric before any traffic (at 0), so alerts on
// their rates see the first event and dashboards show 0, not "no data";
// and so of the series the dashboard queries by source or transport
// (dropped by why, held by transport, best-effort deliveries).
func TestContractMetricsAtStart(t *testing.T) {
	e := newEnv(t, "")
	svc, _ := e.start()
	eventually(t, "ready", func() bool { return svc.Ready() == nil })
	srv := httptest.NewServer(svc.AdminHandler())
	defer srv.Close()
	resp, err := srv.Client().Get(srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`delaybridge_ingested_total{source="delay"} 0`,
		`delaybridge_ingested_total{source="DELAY"} 0`,
		`delaybridge_fired_total{kind="task",transport="kafka"} 0`,
		`delaybridge_fired_total{kind="task",transport="nats"} 0`,
		`delaybridge_dead_lettered_total{reason="bad-due"} 0`,
		`delaybridge_cancelled_total{source="delay"} 0`,
		`delaybridge_pending_tasks{shard="0"} 0`,
		`delaybridge_fire_lateness_seconds_count{transport="kafka"} 0`,
		`delaybridge_store_commit_seconds_bucket{op="ingest",le="0.0005"}`,
		`delaybridge_publish_retries_total{transport="nats"} 0`,
		`delaybridge_dropped_total{source="delay",why="older"} 0`,
		`delaybridge_dropped_total{source="delay",why="cancelled"} 0`,
		`delaybridge_held_tasks{shard="0",transport="kafka"} 0`,
		`delaybridge_best_effort_deliveries_total{transport="nats"} 0`,
	} {
		if !strings.Contains(string(body), want) {
			t.Errorf("/metrics of a started bridge has no %s", want)
		}
	}
}
