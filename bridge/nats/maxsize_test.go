package nats

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/config"
	"github.com/delaybridge/delaybridge/shard"
)

// TestSinkMaxSizeKafkaRecord: a Kafka record the codec takes in at
// max_message_bytes (its default) reaches a NATS target with the default
// max_payload, even with header names NATS cannot carry, which grow when
// percent-encoded: too-large counts that growth. Before, it was refused at
// every try and became a publish-failed dead letter.
func TestSinkMaxSizeKafkaRecord(t *testing.T) {
	cfg, nc, stream := outServer(t)
	rules := &codec.Rules{
		MaxBytes:      config.DefaultMaxMessageBytes,
		DefaultTarget: "nats:out.x",
		Transports:    func(codec.Transport) bool { return true },
	}
	name := strings.Repeat("a b", 600) // a legal Kafka header name: 600 spaces
	msg := func(n int) codec.Message {
		return codec.Message{
			Transport: codec.TransportKafka, Source: "delay", Offset: 7,
			Key: []byte("k"), Value: []byte(strings.Repeat("v", n)), Time: time.Now(),
			Headers: []codec.Header{{Key: "delay-after", Value: []byte("0")}, {Key: name, Value: []byte("x")}},
		}
	}
	// The largest value Parse takes: the message is exactly at the limit.
	_, tk := largestScheduled(msg, rules, config.DefaultMaxMessageBytes)
	if tk.Kind != codec.KindSchedule {
		t.Fatalf("kind %v", tk.Kind)
	}
	if errs := newSink(t, nc, cfg).Deliver(ctxT(t), []*codec.Task{&tk}); errs != nil {
		t.Fatalf("a message taken in at max_message_bytes refused by a NATS target with default max_payload: %v", errs[0])
	}
	info, err := stream.Info(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 1 {
		t.Fatalf("target holds %d messages", info.State.Msgs)
	}
}

// TestSinkHeaderBlockOverLimitRefused: JetStream refuses a message whose
// header block is over 65535 bytes (error 10097), whatever the stream's
// limits. That is a refusal of the message itself (shard.ErrRefused), so
// a dead letter its DLQ refuses so is parked rather than holding its
// source for ever: a NATS delay message with headers just under the limit
// is stored, and its dead letter's added headers take it over.
func TestSinkHeaderBlockOverLimitRefused(t *testing.T) {
	cfg, nc, stream := outServer(t)
	tk := codec.Task{
		Kind: codec.KindSchedule, ID: "big", Source: "delay", Origin: "nats:DELAY#1",
		Transport: codec.TransportNATS, Target: "out.x", DLQTransport: codec.TransportNATS,
		Due: time.Now().UnixMilli(), Value: []byte("v"),
		Headers: []codec.Header{{Key: "big", Value: []byte(strings.Repeat("h", 66000))}},
	}
	errs := newSink(t, nc, cfg).Deliver(ctxT(t), []*codec.Task{&tk})
	if errs == nil || !errors.Is(errs[0], shard.ErrRefused) {
		t.Fatalf("a header block over 64 KiB: %v, want shard.ErrRefused", errs)
	}
	if info, err := stream.Info(ctxT(t)); err != nil || info.State.Msgs != 0 {
		t.Fatalf("target holds %v messages (%v)", info, err)
	}
}

// TestSinkHeaderBlockBound: the largest header block Parse takes for a
// NATS target (too-large above it, codec.NATSMaxHeaderBytes) is stored by
// a real JetStream, with a header name that grows when encoded and an id
// that is delivered encoded: the bound is never below what the sink
// writes.
func TestSinkHeaderBlockBound(t *testing.T) {
	cfg, nc, stream := outServer(t)
	rules := &codec.Rules{DefaultTarget: "nats:out.x", Transports: func(codec.Transport) bool { return true }}
	msg := func(n int) codec.Message {
		return codec.Message{
			Transport: codec.TransportKafka, Source: "delay", Offset: 7,
			Key: []byte("job 7\n"), Value: []byte("v"), Time: time.Now(),
			Headers: []codec.Header{{Key: "delay-after", Value: []byte("0")}, {Key: "a b", Value: []byte(strings.Repeat("h", n))}},
		}
	}
	lo, tk := largestScheduled(msg, rules, codec.NATSMaxHeaderBytes)
	if tk.Kind != codec.KindSchedule || lo < codec.NATSMaxHeaderBytes-400 {
		t.Fatalf("largest header value taken %d: %v %s", lo, tk.Code, tk.Detail)
	}
	if errs := newSink(t, nc, cfg).Deliver(ctxT(t), []*codec.Task{&tk}); errs != nil {
		t.Fatalf("the largest header block Parse takes for a NATS target is refused by JetStream: %v", errs[0])
	}
	got, err := stream.GetMsg(ctxT(t), 1)
	if err != nil {
		t.Fatal(err)
	}
	if id, enc := got.Header.Get(codec.HeaderID), got.Header.Get(codec.HeaderIDEncoding); id != "job%207%0A" || enc != codec.IDEncodingPercent {
		t.Fatalf("delay-id %q, delay-id-encoding %q; want %q, %q", id, enc, "job%207%0A", codec.IDEncodingPercent)
	}
}

// largestScheduled finds the largest n <= hi for which Parse schedules
// msg(n) (Parse refuses every larger one), and that task.
func largestScheduled(msg func(n int) codec.Message, rules *codec.Rules, hi int) (int, codec.Task) {
	lo := 0
	for lo < hi {
		mid := (lo + hi + 1) / 2
		m := msg(mid)
		if tk := codec.Parse(&m, rules); tk.Kind == codec.KindSchedule {
			lo = mid
		} else {
			hi = mid - 1
		}
	}
	m := msg(lo)
	return lo, codec.Parse(&m, rules)
}
