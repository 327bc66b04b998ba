package nats

import (
	"bytes"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/bridge/bridgetest"
	"github.com/delaybridge/delaybridge/codec"
)

// TestKafkaSourceToNATSTargetContract: CONTRACT §2 across transports, a
// Kafka source's message (as the Kafka source hands it over: record
// headers in order, byte values) scheduled for "nats:SUBJECT" and delivered
// by the real sink. The target gets the value, every non-control header
// (a name NATS cannot carry percent-encoded, repeated headers in order),
// one delay-id, delay-origin and delay-due each, and no key: the Kafka key
// arrives as the delay-id.
func TestKafkaSourceToNATSTargetContract(t *testing.T) {
	s := startServer(t, jsOptions(t))
	nc := connect(t, testConfig(t, serverURL(s)))
	b := &natsBroker{s: s, nc: nc, js: newJS(t, nc)}
	target := b.NewTarget(t)
	now := time.Date(2026, 11, 28, 12, 0, 0, 0, time.UTC)
	rules := &codec.Rules{DLQ: "dlq", Transports: func(codec.Transport) bool { return true }}
	h := func(k, v string) codec.Header { return codec.Header{Key: k, Value: []byte(v)} }
	m := codec.Message{Transport: codec.TransportKafka, Source: "delay", Partition: 2, Offset: 41,
		Key: []byte("order-9"), Value: []byte{0, 1, 0xff, 'v'}, Time: now,
		Headers: []codec.Header{
			h("x-multi", "b"), h("Delay-After", "1500ms"), h("trace id", "t1"), h("x-multi", "a"),
			h("DELAY-TARGET", "nats:"+target), h("Delay-Key", "ignored-on-nats"), h("delay-origin", "stale"),
			{Key: "x-bin", Value: []byte{0x80, 0xfe}}, h("x-empty", ""), h("Nats-Msg-Id", "publisher-id"),
		}}
	task := codec.Parse(&m, rules)
	if task.Kind != codec.KindSchedule || task.Transport != codec.TransportNATS || task.Target != target {
		t.Fatalf("parsed %v %s to %s:%s (%s)", task.Kind, task.Code, task.Transport, task.Target, task.Detail)
	}
	bridgetest.DeliverAll(t, b.NewSink(t), []*codec.Task{bridgetest.Stored(t, task)})
	got := b.Consume(t, target, 1)[0]
	if !bytes.Equal(got.Value, m.Value) {
		t.Errorf("value %q, want %q", got.Value, m.Value)
	}
	due := codec.FormatDue(now.UnixMilli() + 1500)
	want := []string{
		"Nats-Msg-Id=kafka:delay|order-9|" + due,
		"delay-due=" + due, "delay-id=order-9", "delay-origin=kafka:delay/2@41",
		"trace%20id=t1", "x-bin=\x80\xfe", "x-empty=", "x-multi=b", "x-multi=a",
	}
	// A map: sorted by name, the values of one name in their order.
	hs := slices.Clone(got.Headers)
	slices.SortStableFunc(hs, func(a, b codec.Header) int { return strings.Compare(a.Key, b.Key) })
	var gotS []string
	for _, x := range hs {
		gotS = append(gotS, x.Key+"="+string(x.Value))
	}
	if strings.Join(gotS, "\n") != strings.Join(want, "\n") {
		t.Errorf("headers\n got  %q\n want %q", gotS, want)
	}
}
