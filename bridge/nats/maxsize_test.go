package nats

import (
	"strings"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/config"
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
	lo, hi := 0, config.DefaultMaxMessageBytes
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
	tk := codec.Parse(&m, rules)
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
