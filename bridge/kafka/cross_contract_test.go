package kafka

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/bridge/bridgetest"
	"github.com/delaybridge/delaybridge/codec"
)

// TestNATSSourceToKafkaTargetContract: CONTRACT §2 across transports, a
// NATS source's message (as the NATS source hands it over: headers sorted
// by name, the values of one name in order) scheduled for "kafka:NAME" and
// delivered by the real sink. The record has the value, the delay-key as
// its key (a NATS message has none of its own: without delay-key the key
// is null), every non-control header including the source's Nats-Msg-Id,
// and one delay-id (the Nats-Msg-Id), delay-origin and delay-due each.
func TestNATSSourceToKafkaTargetContract(t *testing.T) {
	c := newCluster(t)
	b := &kfakeBroker{c: c, prod: producer(t, c)}
	target := b.NewTarget(t)
	now := time.Date(2026, 11, 28, 12, 0, 0, 0, time.UTC)
	rules := &codec.Rules{DLQ: "dlq", Transports: func(codec.Transport) bool { return true }}
	h := func(k, v string) codec.Header { return codec.Header{Key: k, Value: []byte(v)} }
	msg := func(seq int64, hs ...codec.Header) codec.Message {
		return codec.Message{Transport: codec.TransportNATS, Source: "DELAY", Offset: seq, Value: []byte("v" + string(rune('0'+seq))),
			Time: now, Headers: append([]codec.Header{h("Delay-After", "2s"), h("Delay-Target", "kafka:"+target),
				h("Nats-Msg-Id", "n-"+string(rune('0'+seq))), h("X-Multi", "b"), h("X-Multi", "a")}, hs...)}
	}
	ms := []codec.Message{msg(1, h("delay-key", "routed")), msg(2)}
	var tasks []*codec.Task
	for i := range ms {
		task := codec.Parse(&ms[i], rules)
		if task.Kind != codec.KindSchedule || task.Transport != codec.TransportKafka || task.Target != target {
			t.Fatalf("parsed %v %s to %s:%s (%s)", task.Kind, task.Code, task.Transport, task.Target, task.Detail)
		}
		tasks = append(tasks, bridgetest.Stored(t, task))
	}
	bridgetest.DeliverAll(t, b.NewSink(t), tasks)
	got := b.Consume(t, target, len(tasks))
	due := codec.FormatDue(now.UnixMilli() + 2000)
	for _, g := range got {
		seq := int64(g.Value[1] - '0')
		wantKey := []byte(nil)
		if seq == 1 {
			wantKey = []byte("routed")
		}
		if !bytes.Equal(g.Key, wantKey) || (g.Key == nil) != (wantKey == nil) {
			t.Errorf("%s: key %q (nil %v), want %q (nil %v)", g.Value, g.Key, g.Key == nil, wantKey, wantKey == nil)
		}
		id := "n-" + string(rune('0'+seq))
		want := []string{"Nats-Msg-Id=" + id, "X-Multi=b", "X-Multi=a", "delay-id=" + id,
			"delay-origin=nats:DELAY#" + string(rune('0'+seq)), "delay-due=" + due}
		var gotS []string
		for _, x := range g.Headers {
			gotS = append(gotS, x.Key+"="+string(x.Value))
		}
		if strings.Join(gotS, "\n") != strings.Join(want, "\n") {
			t.Errorf("%s: headers\n got  %q\n want %q", g.Value, gotS, want)
		}
	}
}
