package service

import (
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/bridge/kafka"
)

// TestTargetRefusingWritesNotReady: a target broker that answers but
// cannot take writes now (NOT_ENOUGH_REPLICAS here; no leader, a JetStream
// 503 alike) is an outage: the task waits without using its retry budget,
// and readiness says so until a delivery to that transport succeeds. The
// publisher's own health sees only connection failures, so before this
// the bridge stayed ready while nothing was delivered. The outage is kept
// per target transport: NATS deliveries meanwhile do not log the Kafka
// target "reachable again".
func TestTargetRefusingWritesNotReady(t *testing.T) {
	e := newEnv(t, "shards: 1\nretry: {initial: 1s, max: 2s, multiplier: 2, jitter: 0, max_attempts: 2}\n")
	core, logs := observer.New(zap.InfoLevel)
	svc, _, _ := e.runWith(Options{Logger: zap.New(core)})
	fault := e.kc.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: kafkaOut, Err: kerr.NotEnoughReplicas, Count: -1})
	e.publishKafka(0, e.clk.Now(), []byte("k"), []byte("kafka-down"), "delay-after", "1s", "delay-target", kafkaOut)
	waitIngested(t, svc, 1)
	e.advanceUntil("refused produces", func([]delivery) bool { return fault.Hits() >= 3 })
	for i := range 3 {
		e.publishNATS("delay.f", []byte("n"+string(rune('0'+i))), "delay-after", "0", "delay-target", "orders.f")
		e.advanceUntil("nats delivery", func(ds []delivery) bool { return len(byValue(ds, "orders.f")) > i })
		e.advanceUntil("more refused produces", func([]delivery) bool { return fault.Hits() >= 3*(i+2) })
	}
	if st := svc.Engine().Stats(); st.Pending != 1 {
		t.Fatalf("pending %d, want 1 (an outage dead-letters nothing)", st.Pending)
	}
	if n := len(byValue(e.deliveries(), kafkaDLQ)); n != 0 {
		t.Fatalf("%d dead letters during an outage", n)
	}
	if err := svc.Ready(); err == nil {
		t.Fatal("ready while every produce to the target topic fails with NOT_ENOUGH_REPLICAS")
	}
	if up := logs.FilterMessageSnippet("target broker reachable again").Len(); up != 0 {
		t.Fatalf("logged the Kafka target reachable again %d times while it took no produce (NATS deliveries cleared it)", up)
	}
	if down := logs.FilterMessageSnippet("target broker unreachable").Len(); down != 1 {
		t.Fatalf("logged the Kafka target unreachable %d times, want once", down)
	}

	fault.Remove()
	e.advanceUntil("the delivery after the outage", func(ds []delivery) bool { return len(byValue(ds, kafkaOut)["kafka-down"]) > 0 })
	eventually(t, "readiness after the outage", func() bool { return svc.Ready() == nil })
	if up := logs.FilterMessageSnippet("target broker reachable again").Len(); up != 1 {
		t.Fatalf("logged the Kafka target reachable again %d times after the outage, want once", up)
	}
}

// TestHeldKafkaProduceDoesNotHoldNATS: a Kafka target broker that takes a
// produce and never answers (a hung broker, a black-holed leader; kafka-go
// waits WriteTimeout per attempt, 10 min here) must not hold the NATS
// tasks of the same shard: once the Kafka batch has been in the sink for
// the lane grace (2 s), the NATS task due after it is delivered, and the
// Kafka task is delivered once the broker answers.
func TestHeldKafkaProduceDoesNotHoldNATS(t *testing.T) {
	e := newEnv(t, "shards: 1\n")
	hold := e.holdProduceTo(kafkaOut)
	svc, _ := e.startWith(func(c *kafka.Config) { c.WriteTimeout = 10 * time.Minute })
	e.publishKafka(0, time.Time{}, []byte("k"), []byte("to-kafka"), "delay-after", "0", "delay-target", kafkaOut)
	e.awaitHeld(hold)
	e.publishNATS("delay.hol", []byte("to-nats"), "delay-after", "1s", "delay-target", "orders.hol")
	waitIngested(t, svc, 2)
	e.clk.Advance(2 * time.Second)
	e.waitFor("the NATS delivery while the Kafka produce is held", func(ds []delivery) bool {
		return len(byValue(ds, "orders.hol")["to-nats"]) > 0
	})
	if n := len(byValue(e.deliveries(), kafkaOut)); n != 0 {
		t.Fatalf("%d Kafka deliveries while its produce is held", n)
	}
	hold.Release(false)
	e.advanceUntil("the Kafka delivery once the broker answers", func(ds []delivery) bool {
		return len(byValue(ds, kafkaOut)["to-kafka"]) > 0
	})
}
