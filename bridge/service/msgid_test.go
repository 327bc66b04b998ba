package service

import (
	"context"
	"errors"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/delaybridge/delaybridge/shard"
)

// TestNATSReplaceAndCancelByMsgID: on NATS the default task id is the
// Nats-Msg-Id header (CONTRACT §1), and JetStream drops a message that
// repeats a Nats-Msg-Id within the stream's duplicate window before the
// bridge sees it. The stream the bridge creates has the smallest window
// (100 ms), so a replace and a cancel that carry only the schedule's
// Nats-Msg-Id reach the bridge once it has passed: the replacement fires
// at its own time, the cancelled task never. (With the server's default
// window of 2 min both would be dropped and the old schedules would fire.)
func TestNATSReplaceAndCancelByMsgID(t *testing.T) {
	e := newEnv(t, "")
	svc, _ := e.start()
	eventually(t, "bridge ready", func() bool { return svc.Ready() == nil })
	js, err := jetstream.New(e.nc)
	if err != nil {
		t.Fatal(err)
	}
	// publish returns whether JetStream stored the message (false: dropped
	// as a duplicate of an earlier Nats-Msg-Id).
	publish := func(value, msgID string, headers ...string) bool {
		t.Helper()
		m := natsgo.NewMsg("delay.orders")
		m.Data = []byte(value)
		m.Header.Set("Nats-Msg-Id", msgID)
		for i := 0; i+1 < len(headers); i += 2 {
			m.Header.Set(headers[i], headers[i+1])
		}
		ack, err := js.PublishMsg(context.Background(), m)
		if err != nil {
			t.Fatalf("publish %s: %v", value, err)
		}
		return !ack.Duplicate
	}
	// publishAfterWindow publishes until the duplicate window of the first
	// message with msgID has passed and JetStream stores this one.
	publishAfterWindow := func(value, msgID string, headers ...string) {
		t.Helper()
		eventually(t, value+" stored by JetStream", func() bool { return publish(value, msgID, headers...) })
	}

	if !publish("first", "order-9", "delay-after", "1h", "delay-target", "orders.closed") ||
		!publish("to-cancel", "order-10", "delay-after", "10s", "delay-target", "orders.closed") {
		t.Fatal("the first schedules were dropped as duplicates")
	}
	waitIngested(t, svc, 2)
	publishAfterWindow("rescheduled", "order-9", "delay-after", "10s", "delay-target", "orders.closed")
	publishAfterWindow("", "order-10", "delay-cancel", "true")
	eventually(t, "order-9 replaced and order-10 cancelled", func() bool {
		ti, err := svc.Engine().Lookup("DELAY", "order-9")
		_, cerr := svc.Engine().Lookup("DELAY", "order-10")
		return err == nil && ti.Due.Before(e.clk.Now().Add(time.Minute)) && errors.Is(cerr, shard.ErrNotFound)
	})

	e.advance(svc, 20*time.Second, time.Second)
	ds := e.waitFor("the replacement's delivery", func(ds []delivery) bool {
		return len(byValue(ds, "orders.closed")["rescheduled"]) > 0
	})
	got := byValue(ds, "orders.closed")
	if len(got["first"]) != 0 || len(got["to-cancel"]) != 0 {
		t.Fatalf("replaced or cancelled schedule delivered: %v", got)
	}
}
