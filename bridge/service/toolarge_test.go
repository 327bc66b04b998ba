package service

import (
	"context"
	"strings"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// setTopicMaxBytes sets a topic's max.message.bytes on kfake.
func setTopicMaxBytes(t *testing.T, e *env, topic, v string) {
	t.Helper()
	req := kmsg.NewPtrIncrementalAlterConfigsRequest()
	r := kmsg.NewIncrementalAlterConfigsRequestResource()
	r.ResourceType = kmsg.ConfigResourceTypeTopic
	r.ResourceName = topic
	c := kmsg.NewIncrementalAlterConfigsRequestResourceConfig()
	c.Name = "max.message.bytes"
	c.Value = &v
	r.Configs = append(r.Configs, c)
	req.Resources = append(req.Resources, r)
	resp, err := req.RequestWith(context.Background(), e.kcl)
	if err != nil {
		t.Fatal(err)
	}
	for _, rr := range resp.Resources {
		if rr.ErrorCode != 0 {
			t.Fatalf("alter %s: code %d", topic, rr.ErrorCode)
		}
	}
}

// TestTooLargeDeadLetterReachesRoomyDLQ: a too-large dead letter is the
// whole source message, as big as the delay topic allows; with delay and
// DLQ topics raised past 1 MiB (max_message_bytes at its default) it goes
// to its DLQ. The Kafka sink refused every record over its batch limit
// itself, before any broker saw it, so it was parked for good, not ready.
func TestTooLargeDeadLetterReachesRoomyDLQ(t *testing.T) {
	e := newEnv(t, "retry: {initial: 1s, max: 2s, multiplier: 2, jitter: 0, max_attempts: 2}\n")
	setTopicMaxBytes(t, e, kafkaDelay, "8388608")
	setTopicMaxBytes(t, e, kafkaDLQ, "8390656")
	big, err := kgo.NewClient(kgo.SeedBrokers(e.kc.ListenAddrs()...), kgo.RecordPartitioner(kgo.ManualPartitioner()),
		kgo.ProducerBatchMaxBytes(16<<20))
	if err != nil {
		t.Fatal(err)
	}
	defer big.Close()
	svc, _ := e.start()
	value := strings.Repeat("x", 2<<20) // 2 MiB: over max_message_bytes (64 KiB here)
	r := &kgo.Record{Topic: kafkaDelay, Partition: 0, Key: []byte("big"), Value: []byte(value),
		Headers: []kgo.RecordHeader{{Key: "delay-after", Value: []byte("1s")}, {Key: "delay-target", Value: []byte("orders")}}}
	if err := big.ProduceSync(context.Background(), r).FirstErr(); err != nil {
		t.Fatalf("produce: %v", err)
	}
	e.advanceUntil("the too-large dead letter in the DLQ, or it parked", func(ds []delivery) bool {
		if len(byValue(ds, kafkaDLQ)[value]) > 0 {
			return true
		}
		if err := svc.Engine().Err(); err != nil && strings.Contains(err.Error(), "parked") {
			t.Fatalf("too-large dead letter parked instead of written to a DLQ that takes 8 MiB: %v", err)
		}
		return false
	})
	d := byValue(e.deliveries(), kafkaDLQ)[value][0]
	if code := d.header("delay-error"); code != "too-large" {
		t.Fatalf("delay-error %q", code)
	}
}

// TestNATSDeadLetterOverHeaderLimitParked (hunt H127): a NATS delay
// message with a header block just under JetStream's 64 KiB is stored by
// the delay stream; for a NATS target it is too-large (its headers as
// delivered go over), and its dead letter, with the error headers added,
// goes over too, which no NATS DLQ takes (error 10097). That refusal is of
// the message itself: the dead letter is parked after the retry policy and
// the source moves on. It used to be retried for ever, holding the NATS
// source: nothing published after it was delivered.
func TestNATSDeadLetterOverHeaderLimitParked(t *testing.T) {
	e := newEnv(t, "retry: {initial: 1s, max: 2s, multiplier: 2, jitter: 0, max_attempts: 2}\n")
	svc, _ := e.start()
	e.publishNATS("delay.big", []byte("big-headers"), "delay-after", "1s", "delay-target", "orders.x", "big", strings.Repeat("h", 65400))
	e.advanceUntil("the dead letter parked", func([]delivery) bool {
		err := svc.Engine().Err()
		return err != nil && strings.Contains(err.Error(), "parked") && strings.Contains(err.Error(), "10097")
	})
	e.publishNATS("delay.ok", []byte("after"), "delay-after", "1s", "delay-target", "orders.ok")
	e.advanceUntil("a message published after it delivered", func(ds []delivery) bool {
		return len(byValue(ds, "orders.ok")["after"]) > 0
	})
	if n := len(byValue(e.deliveries(), "")["big-headers"]); n != 0 {
		t.Fatalf("the message with a 64 KiB header block arrived %d times", n)
	}
}
