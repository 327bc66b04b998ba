package service

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// TestDLQNotAuthorizedHoldsCommitAcrossRestart is
// TestDLQNotAuthorizedHoldsCommit with a restart while the DLQ topic may
// not be written (CONTRACT §3): the bad message's checkpoint is stored
// with its dead letter, so the restarted bridge resumes past it, but it
// holds the partition until the DLQ took the dead letter: the group's
// offset stays at the bad message and the good messages after it are not
// read, while the other partitions go on. Once the DLQ may be written, the
// dead letter goes out, the commit moves past and the good messages are
// delivered.
func TestDLQNotAuthorizedHoldsCommitAcrossRestart(t *testing.T) {
	e := newEnv(t, "retry: {initial: 1s, max: 2s, multiplier: 2, jitter: 0, max_attempts: 2}\n")
	svc, stop := e.start()
	committed := e.committedOffset
	e.publishKafka(0, time.Time{}, []byte("k0"), []byte("good"), "delay-after", "1h", "delay-target", "orders")
	eventually(t, "the good message's commit", func() bool { return committed(0) == 1 })

	deny := e.kc.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: kafkaDLQ, Err: kerr.TopicAuthorizationFailed, Count: -1})
	e.publishKafka(0, time.Time{}, []byte("k1"), []byte("bad"), "delay-target", "orders") // missing-due
	eventually(t, "readiness to report the DLQ", func() bool { return svc.Ready() != nil })
	e.advanceUntil("refused produces", func([]delivery) bool { return deny.Hits() >= 2 })
	if off := committed(0); off != 1 {
		t.Fatalf("committed offset %d while the DLQ topic may not be written, want 1", off)
	}

	stop() // Handle gives up its wait; nothing committed
	if off := committed(0); off != 1 {
		t.Fatalf("committed offset %d after the stop, want 1", off)
	}
	svc2, _ := e.start()
	e.publishKafka(0, time.Time{}, []byte("k2"), []byte("after-0"), "delay-after", "1s", "delay-target", "orders")
	e.publishKafka(1, time.Time{}, []byte("k3"), []byte("other-1"), "delay-after", "1s", "delay-target", "orders")
	// The restarted bridge runs: it retries the dead letter, and reads
	// and delivers partition 1.
	hits := deny.Hits()
	e.advanceUntil("partition 1 delivered and the dead letter retried", func(ds []delivery) bool {
		return len(byValue(ds, kafkaOut)["other-1"]) > 0 && deny.Hits() >= hits+3
	})
	eventually(t, "partition 1's commit", func() bool { return committed(1) == 1 })
	if off := committed(0); off != 1 {
		t.Fatalf("committed offset %d after the restart while the DLQ topic may not be written, want 1 (not past the bad message)", off)
	}
	if n := len(byValue(e.deliveries(), kafkaOut)["after-0"]); n != 0 {
		t.Fatalf("%d deliveries of a message after the held bad message", n)
	}
	if err := svc2.Ready(); err == nil {
		t.Fatal("ready after the restart while the DLQ topic may not be written")
	}

	deny.Remove()
	e.advanceUntil("the dead letter and the message after it", func(ds []delivery) bool {
		return len(byValue(ds, kafkaDLQ)["bad"]) > 0 && len(byValue(ds, kafkaOut)["after-0"]) > 0
	})
	eventually(t, "the commit past the bad message", func() bool { return committed(0) == 3 })
	eventually(t, "readiness after the DLQ took it", func() bool { return svc2.Ready() == nil })
}

// TestNATSDLQOutageHoldsAckAcrossRestart is TestNATSDLQOutageHoldsAck
// (the DLQ stream full, DiscardNew: it fails as a whole) with a restart
// meanwhile: the stored floor is past the bad message, but the restarted
// consumer holds until the DLQ took its dead letter, so neither the
// redelivered bad message nor a message after it is acked; then both go
// through.
func TestNATSDLQOutageHoldsAckAcrossRestart(t *testing.T) {
	e := newEnv(t, "retry: {initial: 1s, max: 2s, multiplier: 2, jitter: 0, max_attempts: 2}\n")
	svc, stop := e.start()
	js, ackFloor, tried := watchNATSHold(t, e)
	ctx := context.Background()
	e.publishNATS("delay.o", []byte("good"), "delay-after", "1h", "delay-target", "orders.o")
	eventually(t, "the good message's ack", func() bool { return ackFloor() == 1 })

	dlqStream := func(limit int64) {
		t.Helper()
		cfg := jetstream.StreamConfig{Name: "DLQ", Subjects: []string{"dlq.>"}, MaxMsgs: limit, Discard: jetstream.DiscardNew}
		if _, err := js.UpdateStream(ctx, cfg); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := js.Publish(ctx, "dlq.filler", []byte("filler")); err != nil {
		t.Fatal(err)
	}
	dlqStream(1)
	e.publishNATS("delay.o", []byte("bad"), "delay-target", "orders.o") // missing-due
	eventually(t, "readiness to report the DLQ", func() bool { return svc.Ready() != nil })
	e.advanceUntil("failed attempts", func([]delivery) bool { return tried() >= 2 })

	stop()
	if f := ackFloor(); f != 1 {
		t.Fatalf("ack floor %d after the stop, want 1", f)
	}
	svc2, _ := e.start()
	e.publishNATS("delay.o", []byte("after"), "delay-after", "1s", "delay-target", "orders.o")
	n := tried()
	e.advanceUntil("the dead letter retried after the restart", func([]delivery) bool { return tried() >= n+3 })
	if f := ackFloor(); f != 1 {
		t.Fatalf("ack floor %d after the restart while the DLQ cannot be written, want 1 (the bad message not acked)", f)
	}
	if k := len(byValue(e.deliveries(), "orders.o")["after"]); k != 0 {
		t.Fatalf("%d deliveries of a message after the held bad message", k)
	}
	if err := svc2.Ready(); err == nil {
		t.Fatal("ready after the restart while the DLQ cannot be written")
	}

	dlqStream(-1)
	e.advanceUntil("the dead letter and the message after it", func(ds []delivery) bool {
		return len(byValue(ds, "dlq.delay")["bad"]) > 0 && len(byValue(ds, "orders.o")["after"]) > 0
	})
	eventually(t, "the acks past the bad message", func() bool { return ackFloor() == 3 })
	eventually(t, "readiness after the DLQ recovered", func() bool { return svc2.Ready() == nil })
}

// watchNATSHold returns a JetStream handle and what the NATS dead-letter
// hold tests watch: the bridge consumer's ack floor on stream DELAY (0
// while it cannot be read) and how many publishes of dead letters reached
// a core subscriber of dlq.delay, stored by the DLQ stream or not (the
// attempts).
func watchNATSHold(t *testing.T, e *env) (js jetstream.JetStream, ackFloor func() uint64, tried func() int) {
	t.Helper()
	js, err := jetstream.New(e.nc)
	if err != nil {
		t.Fatal(err)
	}
	ackFloor = func() uint64 {
		ctx := context.Background()
		c, err := js.Consumer(ctx, "DELAY", "bridge")
		if err != nil {
			return 0
		}
		info, err := c.Info(ctx)
		if err != nil {
			return 0
		}
		return info.AckFloor.Stream
	}
	attempts, err := e.nc.SubscribeSync("dlq.delay")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = attempts.Unsubscribe() })
	tried = func() int { n, _, _ := attempts.Pending(); return n }
	return js, ackFloor, tried
}
