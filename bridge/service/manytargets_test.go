package service

import (
	"context"
	"net/http/httptest"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/bridge/kafka"
)

// createKafkaTopics creates topics (1 partition each) on e's broker.
func (e *env) createKafkaTopics(topics ...string) {
	e.t.Helper()
	e.createKafkaTopicsN(1, topics...)
}

// TestOneTopicDownAmongHealthyKafkaTargets (hunt H177): one Kafka target
// topic that cannot take writes (NOT_ENOUGH_REPLICAS: an outage, charged
// no attempt) among healthy topics is one outage until that topic takes
// writes: one Warn, no "reachable again", readiness steadily not ready.
// The lane's outage record was per transport: each retry of the down
// topic's task set it and each delivery to any other topic cleared it (10
// Warn and 10 Info lines and readiness flapping over 10 healthy
// deliveries).
func TestOneTopicDownAmongHealthyKafkaTargets(t *testing.T) {
	e := newEnv(t, "shards: 1\nretry: {initial: 1s, max: 2s, multiplier: 2, jitter: 0, max_attempts: 2}\n")
	e.createKafkaTopics("orders-down")
	core, logs := observer.New(zap.InfoLevel)
	svc, _, _ := e.runWith(Options{Logger: zap.New(core)})
	fault := e.kc.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: "orders-down", Err: kerr.NotEnoughReplicas, Count: -1})
	defer fault.Remove()
	e.publishKafka(0, e.clk.Now(), []byte("d"), []byte("down"), "delay-after", "1s", "delay-target", "orders-down")
	waitIngested(t, svc, 1)
	e.advanceUntil("refused produces", func([]delivery) bool { return fault.Hits() >= 3 })
	var states []bool // readiness after each healthy delivery and after each refused retry
	for i := range 10 {
		s := strconv.Itoa(i)
		e.publishKafka(0, e.clk.Now(), []byte("h"+s), []byte("h"+s), "delay-after", "0", "delay-target", "orders")
		e.advanceUntil("healthy delivery", func(ds []delivery) bool { return len(byValue(ds, kafkaOut)["h"+s]) > 0 })
		states = append(states, svc.Ready() == nil)
		h := fault.Hits()
		e.advanceUntil("another refused retry", func([]delivery) bool { return fault.Hits() > h })
		states = append(states, svc.Ready() == nil)
	}
	down, up := logs.FilterMessageSnippet("target broker unreachable").Len(), logs.FilterMessageSnippet("target broker reachable again").Len()
	t.Logf("readiness %v; %d Warn unreachable, %d Info reachable again", states, down, up)
	if down != 1 || up != 0 {
		t.Errorf("one topic down among healthy ones: %d Warn lines \"target broker unreachable\" and %d \"reachable again\", want 1 and 0", down, up)
	}
	if slices.Contains(states, true) && slices.Contains(states, false) {
		t.Errorf("readiness flaps with which topic the last batch held: %v", states)
	}
}

// TestTargetTopicCreatedJustBeforeDue: a Kafka target topic created after
// the bridge's producer read the cluster's metadata (a new tenant's), with
// its task due at once, is delivered to. The producer's metadata cache
// (kafka.MetadataTTL, 6 s) did not know it: each try failed as a missing
// topic and charged an attempt, so with retry.max_attempts 3 (and a cache
// older than the retries) the task was dead-lettered publish-failed
// although its topic existed (hunt H177).
func TestTargetTopicCreatedJustBeforeDue(t *testing.T) {
	e := newEnv(t, "shards: 1\nretry: {initial: 1s, max: 2s, multiplier: 2, jitter: 0, max_attempts: 3}\n")
	e.kcl.AddConsumeTopics("orders-new")
	svc, _ := e.startWith(func(c *kafka.Config) { c.MetadataTTL = time.Minute })
	e.publishKafka(0, time.Time{}, []byte("w"), []byte("warm"), "delay-after", "0", "delay-target", "orders")
	e.advanceUntil("warm-up delivery", func(ds []delivery) bool { return len(byValue(ds, kafkaOut)["warm"]) > 0 })
	e.createKafkaTopics("orders-new")
	e.publishKafka(0, time.Time{}, []byte("n"), []byte("new"), "delay-after", "0", "delay-target", "orders-new")
	// Due at once: it may be delivered before a look at the pending count.
	eventually(t, "ingested or delivered", func() bool {
		return svc.Engine().Stats().Pending >= 1 || len(byValue(e.deliveries(), "orders-new")["new"]) > 0
	})
	got := e.advanceUntil("delivered or dead-lettered", func(ds []delivery) bool {
		return len(byValue(ds, "orders-new")["new"]) > 0 || len(byValue(ds, kafkaDLQ)["new"]) > 0
	})
	if dl := byValue(got, kafkaDLQ)["new"]; len(dl) > 0 {
		t.Fatalf("a task to a topic that exists was dead-lettered %s: %s", dl[0].header("delay-error"), dl[0].header("delay-error-detail"))
	}
}

// TestThousandsOfTargets (hunt H177): 1500 Kafka topics and 1500 NATS
// subjects, a task each: all delivered, no /metrics series names a target
// (no label is a target), and the series count does not grow. It logs the
// goroutines: kafka-go's transport keeps a connection (a goroutine) per
// concurrent produce request, idle for 30 s, at most maxProduceInFlight
// (TestConnectionsPerDistinctTopics in bridge/kafka). DELAYBRIDGE_LONG=1
// runs it (about 15 s).
func TestThousandsOfTargets(t *testing.T) {
	if os.Getenv("DELAYBRIDGE_LONG") == "" {
		t.Skip("DELAYBRIDGE_LONG=1 runs it")
	}
	const n = 1500
	e := newEnv(t, "shards: 2\n")
	var topics []string
	for i := range n {
		topics = append(topics, "orders-t"+strconv.Itoa(i))
	}
	for i := 0; i < n; i += 500 {
		e.createKafkaTopics(topics[i:min(i+500, n)]...)
	}
	svc, _ := e.start()
	srv := httptest.NewServer(svc.AdminHandler())
	defer srv.Close()
	metricsLines := func() (int, string) {
		_, body := adminCall(t, srv, "GET", "/metrics")
		k := 0
		for _, l := range strings.Split(body, "\n") {
			if strings.HasPrefix(l, "delaybridge_") {
				k++
			}
		}
		return k, body
	}
	e.publishKafka(0, time.Time{}, []byte("w"), []byte("warm"), "delay-after", "0", "delay-target", "orders")
	e.publishNATS("delay.w", []byte("warmn"), "delay-after", "0", "delay-target", "orders.warm")
	e.advanceUntil("warm-up", func(ds []delivery) bool {
		return len(byValue(ds, kafkaOut)["warm"]) > 0 && len(byValue(ds, "orders.warm")) > 0
	})
	time.Sleep(500 * time.Millisecond)
	g0 := runtime.NumGoroutine()
	m0, _ := metricsLines()
	ctx := context.Background()
	var recs []*kgo.Record
	for i, tp := range topics {
		recs = append(recs, &kgo.Record{Topic: kafkaDelay, Partition: int32(i % 3), Key: []byte("k" + strconv.Itoa(i)), Value: []byte("v"),
			Timestamp: e.clk.Now(), Headers: []kgo.RecordHeader{{Key: "delay-after", Value: []byte("1s")}, {Key: "delay-target", Value: []byte(tp)}}})
	}
	if err := e.kcl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	js, _ := jetstream.New(e.nc)
	var futs []jetstream.PubAckFuture
	for i := range n {
		m := natsgo.NewMsg("delay.m")
		m.Header.Set("delay-after", "1s")
		m.Header.Set("delay-target", "orders.t"+strconv.Itoa(i))
		m.Header.Set("delay-id", "n"+strconv.Itoa(i))
		f, err := js.PublishMsgAsync(m)
		if err != nil {
			t.Fatal(err)
		}
		futs = append(futs, f)
	}
	<-js.PublishAsyncComplete()
	for _, f := range futs {
		select {
		case <-f.Ok():
		case err := <-f.Err():
			t.Fatalf("publish to the delay stream: %v", err)
		}
	}
	for i := 0; svc.Engine().Stats().Pending < 2*n && i < 100; i++ {
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("pending %d, dlq kafka %d nats %d", svc.Engine().Stats().Pending, len(byValue(e.deliveries(), kafkaDLQ)), len(byValue(e.deliveries(), "dlq.delay")))
	start := time.Now()
	e.advanceUntil("all delivered", func([]delivery) bool { return svc.Engine().Stats().Pending == 0 })
	t.Logf("delivered %d in %s", 2*n, time.Since(start))
	g1 := runtime.NumGoroutine()
	t.Logf("kafka deliveries %d nats %d", countDest(e.deliveries(), func(d delivery) bool { return strings.HasPrefix(d.dest, "orders-t") }),
		countDest(e.deliveries(), func(d delivery) bool { return strings.HasPrefix(d.dest, "orders.t") }))
	m1, body := metricsLines()
	t.Logf("goroutines %d -> %d; metric lines %d -> %d", g0, g1, m0, m1)
	if strings.Contains(body, "orders-t1") || strings.Contains(body, "orders.t1") {
		t.Errorf("/metrics names a target")
	}
	if m1 != m0 {
		t.Errorf("/metrics went from %d to %d delaybridge_ lines with 3000 targets", m0, m1)
	}
}

// TestMissingTopicDeadLetteredAfterRetries: with the default retry policy
// (jitter off), a task to a Kafka topic that does not exist reaches the
// DLQ as publish-failed 4m15s after its due time (10 attempts), as the
// README says.
func TestMissingTopicDeadLetteredAfterRetries(t *testing.T) {
	e := newEnv(t, "shards: 1\nretry: {initial: 500ms, max: 5m, multiplier: 2, jitter: 0, max_attempts: 10}\n")
	svc, _ := e.start()
	due := e.clk.Now().Add(time.Second)
	e.publishKafka(0, time.Time{}, []byte("m"), []byte("missing"), "delay-after", "1s", "delay-target", "kafka:missing-topic")
	waitIngested(t, svc, 1)
	got := e.advanceUntil("dead letter", func(ds []delivery) bool { return len(byValue(ds, kafkaDLQ)["missing"]) > 0 })
	d := byValue(got, kafkaDLQ)["missing"][0]
	t.Logf("dead-lettered %s after due: %s / %s", d.at.Sub(due), d.header("delay-error"), d.header("delay-error-detail"))
	if after := d.at.Sub(due); after < 4*time.Minute+10*time.Second || after > 4*time.Minute+25*time.Second {
		t.Errorf("dead-lettered %s after its due time, want about 4m15s", after)
	}
	if c := d.header("delay-error"); c != "publish-failed" || !strings.Contains(d.header("delay-error-detail"), "missing-topic") {
		t.Errorf("delay-error %q, detail %q", c, d.header("delay-error-detail"))
	}
}
