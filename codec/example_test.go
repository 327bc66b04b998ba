package codec_test

import (
	"errors"
	"fmt"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

func ExampleParse() {
	m := &codec.Message{
		Transport: codec.TransportKafka,
		Source:    "delay",
		Partition: 0,
		Offset:    17,
		Key:       []byte("order-1"),
		Value:     []byte(`{"order":1}`),
		Headers: []codec.Header{
			{Key: "delay-after", Value: []byte("30m")},
			{Key: "delay-target", Value: []byte("orders.expire")},
			{Key: "traceparent", Value: []byte("00-abc-01")},
		},
		Time: time.Date(2026, 11, 22, 15, 0, 0, 0, time.UTC),
	}
	t := codec.Parse(m, &codec.Rules{DLQ: "delay.dlq", MaxDelay: 365 * 24 * time.Hour})
	fmt.Println(t.Kind, t.ID, t.Transport, t.Target, codec.FormatDue(t.Due))
	for _, h := range t.Headers {
		fmt.Printf("%s: %s\n", h.Key, h.Value)
	}

	m.Headers[0].Value = []byte("soon")
	t = codec.Parse(m, &codec.Rules{DLQ: "delay.dlq"})
	fmt.Println(t.Kind, t.Target, t.Code, "-", t.Detail)
	// Output:
	// schedule order-1 kafka orders.expire 2026-11-22T15:30:00.000Z
	// traceparent: 00-abc-01
	// delay-id: order-1
	// delay-origin: kafka:delay/0@17
	// delay-due: 2026-11-22T15:30:00.000Z
	// dead-letter delay.dlq bad-due - delay-after "soon" is not a duration, days or milliseconds
}

func ExampleDecodeTask() {
	in := codec.Task{Kind: codec.KindCancel, ID: "order-1", Source: "delay", Transport: codec.TransportKafka}
	b := codec.AppendTask(nil, &in)
	var out codec.Task
	if err := codec.DecodeTask(b, &out); err != nil {
		fmt.Println(err)
	}
	fmt.Println(out.Kind, out.ID)
	b[len(b)-1] ^= 1
	err := codec.DecodeTask(b, &out)
	fmt.Println(errors.Is(err, codec.ErrCorrupt))
	// Output:
	// cancel order-1
	// true
}
