package nats

import (
	"errors"
	"testing"

	"github.com/delaybridge/delaybridge/codec"
)

// TestDeliveryID: the Nats-Msg-Id names the source (transport and delay
// topic or stream), the id and the due time, and no two distinct triples
// share one, whatever the ids contain.
func TestDeliveryID(t *testing.T) {
	const due = int64(1795359845123) // 2026-11-22T15:04:05.123Z
	mk := func(tr codec.Transport, source, id string, hs ...codec.Header) *codec.Task {
		return &codec.Task{Kind: codec.KindSchedule, ID: id, Source: source, Origin: "origin", Due: due,
			Transport: codec.TransportNATS, Target: "out.x", Headers: hs, DLQTransport: tr}
	}
	K, N := codec.TransportKafka, codec.TransportNATS
	dl := mk(N, "DELAY", "")
	dl.Kind, dl.Origin = codec.KindDeadLetter, "nats:DELAY#7"
	// A dead letter made at the due time keeps the task's id, for logs.
	fdl := mk(N, "DELAY", "order-1", hdr("delay-due", "2026-11-22T15:04:05.123Z"))
	fdl.Kind, fdl.Origin = codec.KindDeadLetter, "nats:DELAY#9"
	cases := []struct {
		name string
		task *codec.Task
		want string
	}{
		{"nats source", mk(N, "DELAY", "order-1"), "nats:DELAY|order-1|2026-11-22T15:04:05.123Z"},
		{"kafka source", mk(K, "orders-delay", "order-1"), "kafka:orders-delay|order-1|2026-11-22T15:04:05.123Z"},
		{"same name, other transport", mk(K, "DELAY", "order-1"), "kafka:DELAY|order-1|2026-11-22T15:04:05.123Z"},
		{"due from the delay-due header", mk(N, "DELAY", "order-1", hdr("x", "y"), hdr("Delay-Due", "2030-01-01T00:00:00.000Z")),
			"nats:DELAY|order-1|2030-01-01T00:00:00.000Z"},
		{"due from the field, epoch", func() *codec.Task { tk := mk(N, "DELAY", "x"); tk.Due = 0; return tk }(),
			"nats:DELAY|x|1970-01-01T00:00:00.000Z"},
		{"dead letter without id: its origin", dl, "nats:DELAY|nats:DELAY#7|2026-11-22T15:04:05.123Z"},
		// Not the task id: another message of the id and due that fails
		// too is another dead letter, not a redelivery of this one.
		{"dead letter made at the due time: its origin", fdl, "nats:DELAY|nats:DELAY#9|2026-11-22T15:04:05.123Z"},
		{"separator in the id", mk(N, "DELAY", "a|b"), "nats:DELAY|a%7Cb|2026-11-22T15:04:05.123Z"},
		{"separator in the source", mk(K, "a|b", "c"), "kafka:a%7Cb|c|2026-11-22T15:04:05.123Z"},
		{"id ending in separator", mk(K, "a", "b|"), "kafka:a|b%7C|2026-11-22T15:04:05.123Z"},
		{"escape character in the id", mk(N, "DELAY", "a%7Cb"), "nats:DELAY|a%257Cb|2026-11-22T15:04:05.123Z"},
		{"white space and controls", mk(N, "DELAY", " a\r\nb\t\x7f "), "nats:DELAY|%20a%0D%0Ab%09%7F%20|2026-11-22T15:04:05.123Z"},
		{"separator in the due header", mk(N, "DELAY", "a", hdr("delay-due", "x|y")), "nats:DELAY|a|x%7Cy"},
		{"utf-8 kept", mk(N, "DELAY", "bestellung-ä"), "nats:DELAY|bestellung-ä|2026-11-22T15:04:05.123Z"},
	}
	for _, c := range cases {
		if got := DeliveryID(c.task); got != c.want {
			t.Errorf("%s: DeliveryID = %q, want %q", c.name, got, c.want)
		}
	}

	// Distinct (source, id, due) never collide, separators and escapes
	// anywhere.
	parts := []string{"", "a", "b", "|", "a|", "|b", "a|b", "%", "%7C", "a%7Cb", " ", "a ", "\n", "%20"}
	seen := map[string]string{}
	for _, tr := range []codec.Transport{K, N} {
		for _, src := range parts {
			for _, id := range parts {
				if id == "" {
					continue // the origin stands in
				}
				for _, d := range parts {
					tk := mk(tr, src, id, hdr("delay-due", d))
					key := tr.String() + "\x00" + src + "\x00" + id + "\x00" + d
					got := DeliveryID(tk)
					if other, ok := seen[got]; ok {
						t.Fatalf("DeliveryID %q for both %q and %q", got, other, key)
					}
					seen[got] = key
				}
			}
		}
	}
}

// TestSinkDeliveryIDPerSource: tasks of different sources with the same
// id and due time, delivered to the same JetStream stream within its
// duplicate window, are all stored: ids are scoped to their source, so one
// must not be taken for a redelivery of the other (it would be counted
// delivered and deleted from the store: lost). A redelivery of the same
// firing is still dropped, and a later firing is not.
func TestSinkDeliveryIDPerSource(t *testing.T) {
	cfg, nc, stream := outServer(t)
	sink := newSink(t, nc, cfg)
	const due = int64(1795359845123)
	from := func(tr codec.Transport, source, value string) *codec.Task {
		tk := task("order-1", "out.orders", value, due)
		tk.Source, tk.DLQTransport = source, tr
		return tk
	}
	tasks := []*codec.Task{
		from(codec.TransportKafka, "orders-delay", "kafka orders-delay"),
		from(codec.TransportNATS, "DELAY", "nats DELAY"),
		from(codec.TransportKafka, "payments-delay", "kafka payments-delay"),
		from(codec.TransportKafka, "DELAY", "kafka DELAY"),
	}
	msgs := func() uint64 {
		t.Helper()
		info, err := stream.Info(ctxT(t))
		if err != nil {
			t.Fatal(err)
		}
		return info.State.Msgs
	}
	// One at a time, as different shards or fire rounds deliver them.
	for _, tk := range tasks {
		if errs := sink.Deliver(ctxT(t), []*codec.Task{tk}); errs != nil {
			t.Fatalf("deliver %s: %v", tk.Value, errors.Join(errs...))
		}
	}
	if got := msgs(); got != uint64(len(tasks)) {
		t.Fatalf("stream holds %d messages, want %d: a task of another source was taken for a duplicate", got, len(tasks))
	}
	for i := range tasks {
		m, err := stream.GetMsg(ctxT(t), uint64(i+1))
		if err != nil {
			t.Fatal(err)
		}
		if string(m.Data) != string(tasks[i].Value) {
			t.Errorf("message %d = %q, want %q", i+1, m.Data, tasks[i].Value)
		}
	}

	// Redelivered after a crash: duplicates, dropped by the stream.
	if errs := sink.Deliver(ctxT(t), tasks); errs != nil {
		t.Fatalf("redeliver: %v", errors.Join(errs...))
	}
	if got := msgs(); got != uint64(len(tasks)) {
		t.Fatalf("after the redelivery the stream holds %d messages, want %d", got, len(tasks))
	}
	// A later firing of the same id is a new message.
	later := from(codec.TransportNATS, "DELAY", "nats DELAY later")
	later.Due += 60_000
	if errs := sink.Deliver(ctxT(t), []*codec.Task{later}); errs != nil {
		t.Fatalf("deliver the later firing: %v", errors.Join(errs...))
	}
	if got := msgs(); got != uint64(len(tasks)+1) {
		t.Fatalf("after a later firing the stream holds %d messages, want %d", got, len(tasks)+1)
	}
}
