package kafka

import (
	"bytes"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/bridge/bridgetest"
	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/config"
)

// TestSinkMaxSizeRecordKafkaTarget: CONTRACT §2's "the same value" at the
// size limit. A message the codec takes in at max_message_bytes (its
// default) as delivered, from either transport and with many small headers
// (whose framing counts), reaches a Kafka target with its value whole.
func TestSinkMaxSizeRecordKafkaTarget(t *testing.T) {
	c := newCluster(t)
	b := &kfakeBroker{c: c, prod: producer(t, c)}
	target := b.NewTarget(t)
	rules := &codec.Rules{MaxBytes: config.DefaultMaxMessageBytes, DefaultTarget: "kafka:" + target,
		Transports: func(codec.Transport) bool { return true }}
	var tasks []*codec.Task
	for _, tr := range []codec.Transport{codec.TransportKafka, codec.TransportNATS} {
		msg := func(n int) codec.Message {
			m := codec.Message{Transport: tr, Source: "delay", Offset: 123456789, Value: bytes.Repeat([]byte{0xab}, n),
				Time: time.Now(), Headers: []codec.Header{{Key: "delay-after", Value: []byte("0")}}}
			if tr == codec.TransportKafka {
				m.Key = []byte("key-" + tr.String())
			}
			for i := range 1000 {
				m.Headers = append(m.Headers, codec.Header{Key: "h" + strconv.Itoa(i), Value: []byte(strings.Repeat("x", i%7))})
			}
			return m
		}
		lo, hi := 0, config.DefaultMaxMessageBytes
		for lo < hi {
			mid := (lo + hi + 1) / 2
			if m := msg(mid); codec.Parse(&m, rules).Kind == codec.KindSchedule {
				lo = mid
			} else {
				hi = mid - 1
			}
		}
		m := msg(lo)
		tk := codec.Parse(&m, rules)
		if tk.Kind != codec.KindSchedule || lo == 0 {
			t.Fatalf("%s: largest value %d: %v %s", tr, lo, tk.Kind, tk.Detail)
		}
		tasks = append(tasks, &tk)
	}
	// A refusal is a message taken in at max_message_bytes that a Kafka
	// target does not take.
	bridgetest.DeliverAll(t, b.NewSink(t), tasks)
	got := b.Consume(t, target, len(tasks))
	for _, g := range got {
		o, _ := bridgetest.Header(g.Headers, codec.HeaderOrigin)
		var want *codec.Task
		for _, tk := range tasks {
			if tk.Origin == string(o) {
				want = tk
			}
		}
		if want == nil || !bytes.Equal(g.Value, want.Value) || len(g.Headers) != len(want.Headers) {
			t.Errorf("delivery with origin %s: %d value bytes and %d headers, want the task's", o, len(g.Value), len(g.Headers))
		}
	}
}
