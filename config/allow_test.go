package config

import (
	"strings"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

func TestAllowTarget(t *testing.T) {
	const (
		K = codec.TransportKafka
		N = codec.TransportNATS
	)
	tests := []struct {
		allow []string
		tr    codec.Transport
		name  string
		want  bool
	}{
		{[]string{"*"}, K, "orders", true},
		{[]string{"*"}, N, "a.b.c", true},
		{[]string{"*"}, K, "", false},
		{nil, K, "orders", false},
		{[]string{}, N, "orders", false},

		{[]string{"orders"}, K, "orders", true},
		{[]string{"orders"}, N, "orders", true},
		{[]string{"orders"}, K, "orders2", false},

		// The transport prefix in any ASCII case, as a delay-target's.
		{[]string{"KAFKA:orders"}, K, "orders", true},
		{[]string{"Kafka:orders"}, N, "orders", false},
		{[]string{"Nats:a.*"}, N, "a.b", true},
		{[]string{"NATS:a.*"}, K, "a.b", false},

		// "*" within a token never crosses a dot.
		{[]string{"orders.*"}, K, "orders.created", true},
		{[]string{"orders.*"}, K, "orders.eu.created", false},
		{[]string{"orders.*"}, K, "orders", false},
		{[]string{"orders.*"}, K, "orders.", false},
		{[]string{"orders*"}, K, "orders-eu", true},
		{[]string{"orders*"}, K, "orders.eu", false},
		{[]string{"*.created"}, K, "orders.created", true},
		{[]string{"*.created"}, K, "a.b.created", false},
		{[]string{"o*s.*d"}, K, "orders.created", true},
		{[]string{"o*s.*d"}, K, "orders.creates", false},
		{[]string{"a*b*c"}, K, "aXbYbZc", true},
		{[]string{"a*b*c"}, K, "aXbYbZ", false},

		// ">" as last token: one or more tokens.
		{[]string{"events.>"}, N, "events.a", true},
		{[]string{"events.>"}, N, "events.a.b", true},
		{[]string{"events.>"}, N, "events", false},
		{[]string{"events.>"}, N, "eventsX.a", false},
		{[]string{"*.>"}, K, "a.b", true},
		{[]string{"*.>"}, K, "a", false},

		// Transport prefixes.
		{[]string{"kafka:orders.*"}, K, "orders.x", true},
		{[]string{"kafka:orders.*"}, N, "orders.x", false},
		{[]string{"nats:events.>"}, N, "events.x.y", true},
		{[]string{"nats:events.>"}, K, "events.x", false},
		{[]string{"kafka:*"}, K, "a.b.c", true},
		{[]string{"kafka:*"}, N, "a", false},
		{[]string{"nats:>"}, N, "a.b", true},
		{[]string{"kafka:a", "nats:b"}, N, "b", true},
		{[]string{"kafka:a", "nats:b"}, N, "a", false},

		// ? and classes, never a dot.
		{[]string{"order?"}, K, "orders", true},
		{[]string{"order?"}, K, "order", false},
		{[]string{"a?b"}, K, "a.b", false},
		{[]string{"v[0-9]"}, K, "v7", true},
		{[]string{"v[0-9]"}, K, "vx", false},
		{[]string{"v[^0-9]"}, K, "vx", true},
		{[]string{"v[!0-9]"}, K, "v1", false},
		{[]string{"[ab]x"}, K, "bx", true},
		{[]string{"é?"}, K, "éé", true},
		{[]string{`a\*`}, K, "a*", true},
		{[]string{`a\*`}, K, "ab", false},

		// NATS system and reply subjects: only a pattern naming them.
		{[]string{"*"}, N, "$JS.API.STREAM.DELETE.DELAY", false},
		{[]string{"nats:>"}, N, "$SYS.REQ.SERVER.PING", false},
		{[]string{"*.>"}, N, "$KV.cfg.a", false},
		{[]string{"?JS.>"}, N, "$JS.ACK.DELAY.bridge.1.1.1.1.0", false},
		{[]string{">"}, N, "_INBOX.abc", false},
		{[]string{"$KV.>"}, N, "$KV.cfg.a", true},
		{[]string{"nats:$KV.cfg.*"}, N, "$KV.cfg.a", true},
		{[]string{"_INBOX.>"}, N, "_INBOX.abc", true},
		{[]string{"*"}, K, "$weird", true}, // Kafka topics cannot start with $ anyway; not NATS
		{[]string{"*"}, N, "_INBOXES.x", true},
		// Kafka topics starting with "_" (cluster and tool internals):
		// likewise only a pattern naming them.
		{[]string{"*"}, K, "_schemas", false},
		{[]string{"kafka:*"}, K, "__consumer_offsets", false},
		{[]string{"?schemas"}, K, "_schemas", false},
		{[]string{"kafka:_schemas"}, K, "_schemas", true},
		{[]string{"_confluent-*"}, K, "_confluent-metrics", true},
		{[]string{"*"}, K, "orders_v2", true},
		{[]string{"*"}, N, "_private.x", true}, // only _INBOX. is reserved on NATS
	}
	for _, tt := range tests {
		c := &Config{Targets: Targets{Allow: tt.allow}}
		if got := c.AllowTarget(tt.tr, tt.name); got != tt.want {
			t.Errorf("allow %q: AllowTarget(%v, %q) = %v, want %v", tt.allow, tt.tr, tt.name, got, tt.want)
		}
	}
}

// A long hostile name must not make matching explode.
func TestAllowTargetLinear(t *testing.T) {
	c := &Config{Targets: Targets{Allow: []string{"*a*a*a*a*a*a*a*a*b"}}}
	name := strings.Repeat("a", 1<<20)
	start := time.Now()
	if c.AllowTarget(codec.TransportKafka, name) {
		t.Fatal("matched")
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("took %v", d)
	}
}

func TestCheckPattern(t *testing.T) {
	// A comma: a NATS subject may have one, a Kafka topic never.
	good := []string{"*", ">", "orders", "orders.*", "kafka:*", "nats:events.>", "v[0-9]", `a\*`, "nats:a,b", `nats:a\,b`, "a,b", "kafka:[,a]"}
	bad := []string{"", "kafka:", "nats:", "a..b", ".a", "a.", "a.>.b", "a>", "[", "[a", "a]", `a\`, "a b", "[]", "[^.x]", "kafka:a,b", `kafka:a\,b`, "KAFKA:", "Kafka:a,b"}
	for _, p := range good {
		if err := checkPattern(p); err != nil {
			t.Errorf("checkPattern(%q) = %v", p, err)
		}
	}
	for _, p := range bad {
		if checkPattern(p) == nil {
			t.Errorf("checkPattern(%q) accepted", p)
		}
	}
}

// TestParseAllocsWithDelaySource: the service's rules check every parsed
// target against the delay sources (DelaySource); for a NATS target that
// costs no allocation, so Parse keeps its budget (codec TestParseAllocs).
func TestParseAllocsWithDelaySource(t *testing.T) {
	c := &Config{NATS: &NATS{Stream: "DELAY", Sources: []NATSSource{{Subject: "delay.>", DLQ: "dlq"}, {Subject: "later.*", DLQ: "dlq2"}}},
		Targets: Targets{Allow: []string{"*"}}}
	m := &codec.Message{Transport: codec.TransportNATS, Source: "DELAY", Offset: 7, Time: time.Now(),
		Headers: []codec.Header{{Key: "delay-after", Value: []byte("90s")}, {Key: "delay-target", Value: []byte("orders.created")}}}
	r := &codec.Rules{DLQ: "dlq", MaxDelay: time.Hour, Now: time.Now, Allow: c.AllowTarget}
	base := testing.AllocsPerRun(100, func() { codec.Parse(m, r) })
	r.DelaySource = c.DelaySource
	if with := testing.AllocsPerRun(100, func() { codec.Parse(m, r) }); with > base {
		t.Errorf("Parse of a NATS schedule: %v allocations with DelaySource, %v without", with, base)
	}
}
