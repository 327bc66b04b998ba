package bridgetest

import (
	"bytes"
	"context"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/bridge"
	"github.com/delaybridge/delaybridge/codec"
)

// contractCase is one source message of CONTRACT §1 and what §2 says its
// target receives.
type contractCase struct {
	name string
	only codec.Transport // 0: both transports
	msg  Msg
	// One of afterMs (due = broker time + afterMs) and at (absolute due).
	afterMs int64
	at      int64
	// wantID is the task id; "" means the message's origin.
	wantID string
	// wantKey is the delivered Kafka key (Kafka targets only).
	wantKey []byte
	// kind: a cancel (tombstone, delay-cancel) or a dead letter is only
	// parsed, not delivered.
	kind codec.Kind
	code codec.Code
}

// dueFormat is delay-due as CONTRACT §2 writes it: RFC 3339, milliseconds,
// UTC.
var dueFormat = regexp.MustCompile(`^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$`)

func contractCases(tr codec.Transport, target string) []contractCase {
	tg := func(v string) codec.Header { return codec.Header{Key: "delay-target", Value: []byte(v)} }
	h := func(k, v string) codec.Header { return codec.Header{Key: k, Value: []byte(v)} }
	at := time.Date(2026, 11, 22, 15, 4, 5, 100_000_000, time.UTC).UnixMilli()
	binary := []byte{0x00, 0xff, 0xfe, 'k', 0x80}
	all := make([]byte, 256)
	for i := range all {
		all[i] = byte(i)
	}
	cs := []contractCase{
		{name: "mixed-case control headers, repeated and empty application headers",
			msg: Msg{Key: []byte("k-mixed"), Value: []byte("mixed"), Headers: []codec.Header{
				h("X-App", "shop"), h("DELAY-AFTER", "2s"), h("x-multi", "a"), h("Delay-Target", target),
				h("x-multi", "b"), h("x-empty", ""), h("X-Delay-Note", "not a control header")}},
			afterMs: 2000, wantID: "k-mixed", wantKey: []byte("k-mixed")},
		{name: "one control header twice in two cases: the last (Kafka) or upper case first (NATS) wins",
			msg: Msg{Key: []byte("k-twice"), Value: []byte("twice"), Headers: []codec.Header{
				h("Delay-After", "1h"), h("delay-after", "3s"), tg(target)}},
			afterMs: 3000, wantID: "k-twice", wantKey: []byte("k-twice")},
		{name: "a control header twice in two cases on Kafka: the last one wins", only: codec.TransportKafka,
			msg: Msg{Key: []byte("k-twice-k"), Value: []byte("twice-kafka"), Headers: []codec.Header{
				h("delay-after", "3s"), h("Delay-After", "4s"), tg(target)}},
			afterMs: 4000, wantID: "k-twice-k", wantKey: []byte("k-twice-k")},
		{name: "a control header twice in two cases on NATS: by name, upper case first, the last one wins", only: codec.TransportNATS,
			msg: Msg{Value: []byte("twice-nats"), Headers: []codec.Header{
				h("delay-after", "3s"), h("Delay-After", "4s"), tg(target)}},
			afterMs: 3000},
		{name: "whitespace around values",
			msg: Msg{Key: []byte("k-ws"), Value: []byte("ws"), Headers: []codec.Header{
				h("delay-after", " 1500 "), tg(" " + target + " ")}},
			afterMs: 1500, wantID: "k-ws", wantKey: []byte("k-ws")},
		{name: "days and hours",
			msg: Msg{Key: []byte("k-days"), Value: []byte("days"), Headers: []codec.Header{
				h("delay-after", "2d12h"), tg(target)}},
			afterMs: (2*24 + 12) * 3600 * 1000, wantID: "k-days", wantKey: []byte("k-days")},
		{name: "delay-at with an offset and nanoseconds is delivered in UTC milliseconds",
			msg: Msg{Key: []byte("k-at"), Value: []byte("at-offset"), Headers: []codec.Header{
				h("delay-at", "2026-11-22T20:34:05.100999999+05:30"), tg(target)}},
			at: at, wantID: "k-at", wantKey: []byte("k-at")},
		{name: "delay-at in epoch milliseconds",
			msg: Msg{Key: []byte("k-at-ms"), Value: []byte("at-ms"), Headers: []codec.Header{
				h("delay-at", fmt.Sprint(at)), tg(target)}},
			at: at, wantID: "k-at-ms", wantKey: []byte("k-at-ms")},
		{name: "publisher copies of the added headers are not passed through twice",
			msg: Msg{Key: []byte("k-stale"), Value: []byte("stale"), Headers: []codec.Header{
				h("Delay-Origin", "kafka:elsewhere/0@1"), h("DELAY-DUE", "2000-01-01T00:00:00.000Z"),
				h("Delay-Id", "pub-id"), h("delay-after", "1s"), tg(target), h("Delay-Key", "routed")}},
			afterMs: 1000, wantID: "pub-id", wantKey: []byte("routed")},
		{name: "empty value",
			msg:     Msg{Key: []byte("k-empty"), Value: []byte{}, Headers: []codec.Header{h("delay-after", "0"), tg(target)}},
			afterMs: 0, wantID: "k-empty", wantKey: []byte("k-empty")},
		{name: "binary value",
			msg:     Msg{Key: []byte("k-bin"), Value: all, Headers: []codec.Header{h("delay-after", "1s"), tg(target)}},
			afterMs: 1000, wantID: "k-bin", wantKey: []byte("k-bin")},
		{name: "binary key and header values", only: codec.TransportKafka,
			msg: Msg{Key: binary, Value: []byte("bin-key"), Headers: []codec.Header{
				{Key: "x-bin", Value: binary}, {Key: "x-null"}, h("", "no name"), h("delay-after", "1s"), tg(target)}},
			afterMs: 1000, wantID: string(binary), wantKey: binary},
		{name: "empty key: the id is the origin, the key stays empty", only: codec.TransportKafka,
			msg:     Msg{Key: []byte{}, Value: []byte("empty-key"), Headers: []codec.Header{h("delay-after", "1s"), tg(target)}},
			afterMs: 1000, wantKey: []byte{}},
		{name: "empty delay-key is an empty key", only: codec.TransportKafka,
			msg: Msg{Key: []byte("k-ek"), Value: []byte("empty-delay-key"), Headers: []codec.Header{
				h("delay-key", ""), h("delay-after", "1s"), tg(target)}},
			afterMs: 1000, wantID: "k-ek", wantKey: []byte{}},
		{name: "Nats-Msg-Id is the id", only: codec.TransportNATS,
			msg: Msg{Value: []byte("msg-id"), Headers: []codec.Header{
				h("Nats-Msg-Id", "n-7"), h("delay-after", "1s"), tg(target)}},
			afterMs: 1000, wantID: "n-7"},
		{name: "no id at all (a null Kafka key): the origin, the key stays null",
			msg:     Msg{Value: []byte("no-id"), Headers: []codec.Header{h("delay-after", "1s"), tg(target)}},
			afterMs: 1000},
		{name: "tombstone with a key cancels", only: codec.TransportKafka,
			msg: Msg{Key: []byte("k-tomb")}, kind: codec.KindCancel, wantID: "k-tomb"},
		{name: "tombstone without a key", only: codec.TransportKafka,
			msg: Msg{}, kind: codec.KindDeadLetter, code: codec.CodeMissingDue},
		{name: "delay-cancel TRUE", msg: Msg{Key: []byte("k-c"), Value: []byte("c"), Headers: []codec.Header{
			h("Delay-Cancel", "TRUE"), h("delay-id", "c-1")}}, kind: codec.KindCancel, wantID: "c-1"},
		{name: "delay-cancel yes", msg: Msg{Key: []byte("k-c"), Value: []byte("c"), Headers: []codec.Header{
			h("delay-cancel", "yes"), h("delay-id", "c-2")}}, kind: codec.KindDeadLetter, code: codec.CodeBadDue},
		{name: "delay-cancel false schedules", msg: Msg{Key: []byte("k-cf"), Value: []byte("cancel-false"), Headers: []codec.Header{
			h("delay-cancel", "false"), h("delay-after", "1s"), tg(target)}}, afterMs: 1000, wantID: "k-cf", wantKey: []byte("k-cf")},
	}
	out := cs[:0]
	for _, c := range cs {
		if c.only == 0 || c.only == tr {
			if c.kind == 0 {
				c.kind = codec.KindSchedule
			}
			if tr == codec.TransportNATS {
				// NATS has no key: an id that was the key is the origin.
				if len(c.msg.Key) > 0 && c.wantID == string(c.msg.Key) {
					c.wantID = ""
				}
				c.wantKey = nil
			}
			out = append(out, c)
		}
	}
	return out
}

// copyHandler keeps deep copies of what it is handed: header values too.
type copyHandler struct {
	mu   sync.Mutex
	msgs []codec.Message
}

func (c *copyHandler) Handle(_ context.Context, b *bridge.Batch) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, it := range b.Items {
		m := it.Msg
		m.Key, m.Value = cloneNil(m.Key), cloneNil(m.Value)
		m.Headers = slices.Clone(m.Headers)
		for i := range m.Headers {
			m.Headers[i].Value = cloneNil(m.Headers[i].Value)
		}
		c.msgs = append(c.msgs, m)
	}
	return nil
}

func (c *copyHandler) Checkpoint(string) (int64, bool, error) { return 0, false, nil }

func (c *copyHandler) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.msgs)
}

func cloneNil(b []byte) []byte {
	if b == nil {
		return nil
	}
	return append([]byte{}, b...)
}

// added names the headers a delivery gets from the bridge, and those it
// never passes through from the source.
func added(k string) bool {
	for _, n := range []string{codec.HeaderAt, codec.HeaderAfter, codec.HeaderTarget, codec.HeaderKey,
		codec.HeaderID, codec.HeaderCancel, codec.HeaderOrigin, codec.HeaderDue, codec.HeaderIDEncoding,
		codec.HeaderError, codec.HeaderErrorDetail} {
		if strings.EqualFold(k, n) {
			return true
		}
	}
	return false
}

// testContract publishes CONTRACT §1 messages through the real broker,
// reads them with the adapter's source, parses them, delivers what they
// schedule (through the store's envelope) with the adapter's sink and checks what the target receives
// (§2): the same value and key, every source header but the control ones
// (in order on Kafka; NATS headers are a map), one delay-id, delay-origin
// and delay-due each, delay-due in RFC 3339 UTC milliseconds, and
// delay-after measured from the broker time, not the read time.
func testContract(t *testing.T, b Broker) {
	source, target := b.NewDelaySource(t), b.NewTarget(t)
	cases := contractCases(b.Transport(), target)
	before := time.Now()
	for _, c := range cases {
		b.Publish(t, source, c.msg)
	}
	published := time.Now()
	// A consumer backlog: the source reads the messages later than they
	// were published, which must not move a delay-after's due time.
	for time.Since(published) < 1100*time.Millisecond {
		time.Sleep(50 * time.Millisecond)
	}
	h := &copyHandler{}
	src := b.NewSource(t, source, "g-contract", &codec.Rules{DLQ: "dlq"})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx, h) }()
	for deadline := time.Now().Add(30 * time.Second); h.len() < len(cases); {
		if time.Now().After(deadline) {
			cancel()
			<-done
			t.Fatalf("read %d of %d messages in 30s", h.len(), len(cases))
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("source Run: %v", err)
	}
	if err := src.Close(); err != nil {
		t.Fatalf("source Close: %v", err)
	}
	msgs := h.msgs
	if len(msgs) != len(cases) {
		t.Fatalf("read %d messages, want %d", len(msgs), len(cases))
	}

	var batch []*codec.Task
	var want []int // case index of each task of batch
	for i, c := range cases {
		m := &msgs[i]
		if !bytes.Equal(m.Value, c.msg.Value) {
			t.Fatalf("%s: read value %q, want %q (order broken?)", c.name, m.Value, c.msg.Value)
		}
		if m.Time.Before(before.Add(-time.Second)) || m.Time.After(published.Add(time.Second)) {
			t.Errorf("%s: broker time %v, not the publish time (%v..%v)", c.name, m.Time, before, published)
		}
		task := codec.Parse(m, &codec.Rules{DLQ: "dlq"})
		if task.Kind != c.kind || task.Code != c.code {
			t.Errorf("%s: %v %q (%s), want %v %q", c.name, task.Kind, task.Code, task.Detail, c.kind, c.code)
			continue
		}
		wantID := c.wantID
		if wantID == "" && c.kind != codec.KindDeadLetter {
			wantID = m.Origin()
		}
		if c.kind != codec.KindDeadLetter && task.ID != wantID {
			t.Errorf("%s: task id %q, want %q", c.name, task.ID, wantID)
		}
		if c.kind != codec.KindSchedule {
			continue
		}
		wantDue := c.at
		if c.at == 0 {
			wantDue = m.Time.UnixMilli() + c.afterMs
		}
		if task.Due != wantDue {
			t.Errorf("%s: due %s, want %s (broker time %v)", c.name, codec.FormatDue(task.Due), codec.FormatDue(wantDue), m.Time)
		}
		if late := published.UnixMilli() + c.afterMs; c.at == 0 && task.Due > late {
			t.Errorf("%s: due %s after publish + delay %s: the read time stretched it", c.name, codec.FormatDue(task.Due), codec.FormatDue(late))
		}
		// Through the store's envelope, as the engine holds it.
		batch = append(batch, Stored(t, task))
		want = append(want, i)
	}
	if t.Failed() {
		t.FailNow()
	}

	DeliverAll(t, b.NewSink(t), batch)
	got := b.Consume(t, target, len(batch))
	byOrigin := map[string]Msg{}
	for _, g := range got {
		o, _ := Header(g.Headers, codec.HeaderOrigin)
		byOrigin[string(o)] = g
	}
	for i, task := range batch {
		c, m := cases[want[i]], &msgs[want[i]]
		g, ok := byOrigin[m.Origin()]
		if !ok {
			t.Errorf("%s: no delivery with delay-origin %s", c.name, m.Origin())
			continue
		}
		if !bytes.Equal(g.Value, c.msg.Value) || (b.Transport() == codec.TransportKafka && (g.Value == nil) != (c.msg.Value == nil)) {
			t.Errorf("%s: delivered value %q (nil %v), want %q (nil %v)", c.name, g.Value, g.Value == nil, c.msg.Value, c.msg.Value == nil)
		}
		if b.Transport() == codec.TransportKafka && (!bytes.Equal(g.Key, c.wantKey) || (g.Key == nil) != (c.wantKey == nil)) {
			t.Errorf("%s: delivered key %q (nil %v), want %q (nil %v)", c.name, g.Key, g.Key == nil, c.wantKey, c.wantKey == nil)
		}
		var wantHs []codec.Header
		for _, x := range c.msg.Headers {
			if !added(x.Key) && (b.Transport() != codec.TransportNATS || !strings.EqualFold(x.Key, codec.HeaderNatsMsgID)) {
				wantHs = append(wantHs, x)
			}
		}
		wantHs = append(wantHs,
			codec.Header{Key: codec.HeaderID, Value: []byte(task.ID)},
			codec.Header{Key: codec.HeaderOrigin, Value: []byte(m.Origin())},
			codec.Header{Key: codec.HeaderDue, Value: []byte(codec.FormatDue(task.Due))})
		gotHs := g.Headers
		if b.Transport() == codec.TransportNATS {
			// A map: compare sorted by name, values of a name in order;
			// the sink sets its own Nats-Msg-Id.
			gotHs = slices.DeleteFunc(slices.Clone(gotHs), func(x codec.Header) bool { return x.Key == codec.HeaderNatsMsgID })
			byName := func(a, b codec.Header) int { return strings.Compare(a.Key, b.Key) }
			slices.SortStableFunc(wantHs, byName)
			slices.SortStableFunc(gotHs, byName)
		}
		kafka := b.Transport() == codec.TransportKafka
		if !slices.EqualFunc(gotHs, wantHs, func(a, b codec.Header) bool {
			// Kafka tells a null header value from an empty one.
			return a.Key == b.Key && bytes.Equal(a.Value, b.Value) && (!kafka || (a.Value == nil) == (b.Value == nil))
		}) {
			t.Errorf("%s: delivered headers\n got  %s\n want %s", c.name, fmtHeaders(gotHs), fmtHeaders(wantHs))
		}
		due, _ := Header(g.Headers, codec.HeaderDue)
		if !dueFormat.Match(due) {
			t.Errorf("%s: delay-due %q is not RFC 3339 UTC with milliseconds", c.name, due)
		} else if p, err := time.Parse(time.RFC3339, string(due)); err != nil || p.UnixMilli() != task.Due {
			t.Errorf("%s: delay-due %q reads back as %v (%v), want %s", c.name, due, p, err, codec.FormatDue(task.Due))
		}
	}
}

func fmtHeaders(hs []codec.Header) string {
	var b strings.Builder
	for i, h := range hs {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s=%q", h.Key, h.Value)
	}
	return b.String()
}
