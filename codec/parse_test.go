package codec

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// now is the broker timestamp of every test message: 2026-11-22T15:04:05.123Z.
var now = time.Date(2026, 11, 22, 15, 4, 5, 123_000_000, time.UTC)

var nowMs = now.UnixMilli()

// delaySource: the Kafka topic "delay" is the bridge's delay source.
func delaySource(t Transport, name string) bool { return t == TransportKafka && name == "delay" }

// at is a clock that reads t.
func at(t time.Time) func() time.Time { return func() time.Time { return t } }

func h(k, v string) Header { return Header{Key: k, Value: []byte(v)} }

func kafkaMsg(hs ...Header) *Message {
	return &Message{
		Transport: TransportKafka,
		Source:    "delay",
		Partition: 3,
		Offset:    42,
		Key:       []byte("order-1"),
		Value:     []byte("payload"),
		Headers:   hs,
		Time:      now,
	}
}

func natsMsg(hs ...Header) *Message {
	return &Message{
		Transport: TransportNATS,
		Source:    "DELAY",
		Offset:    7,
		Value:     []byte("payload"),
		Headers:   hs,
		Time:      now,
	}
}

func both(t Transport) bool { return t == TransportKafka || t == TransportNATS }

func mustMs(s string) int64 {
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		panic(err)
	}
	return t.UnixMilli()
}

func TestParseDue(t *testing.T) {
	day := int64(24 * time.Hour / time.Millisecond)
	tests := []struct {
		name  string
		hs    []Header
		rules Rules
		due   int64 // when code is empty
		code  Code
	}{
		// delay-at, RFC 3339
		{name: "at utc", hs: []Header{h("delay-at", "2026-11-22T16:00:00Z")}, due: mustMs("2026-11-22T16:00:00Z")},
		{name: "at millis", hs: []Header{h("delay-at", "2026-11-22T16:00:00.123Z")}, due: mustMs("2026-11-22T16:00:00.123Z")},
		{name: "at nanos truncated", hs: []Header{h("delay-at", "2026-11-22T16:00:00.123999999Z")}, due: mustMs("2026-11-22T16:00:00.123Z")},
		{name: "at offset", hs: []Header{h("delay-at", "2026-11-22T18:00:00+02:00")}, due: mustMs("2026-11-22T16:00:00Z")},
		{name: "at negative offset", hs: []Header{h("delay-at", "2026-11-22T11:30:00-04:30")}, due: mustMs("2026-11-22T16:00:00Z")},
		{name: "at in the past fires", hs: []Header{h("delay-at", "2020-01-01T00:00:00Z")}, due: mustMs("2020-01-01T00:00:00Z")},
		{name: "at epoch", hs: []Header{h("delay-at", "1970-01-01T00:00:00Z")}, due: 0},
		{name: "at year 9999", hs: []Header{h("delay-at", "9999-12-31T23:59:59.999Z")}, due: MaxDue},
		{name: "at whitespace trimmed", hs: []Header{h("delay-at", " 2026-11-22T16:00:00Z\t")}, due: mustMs("2026-11-22T16:00:00Z")},
		{name: "at before 1970", hs: []Header{h("delay-at", "1969-12-31T23:59:59.999Z")}, code: CodeBadDue},
		{name: "at offset pushes past 9999", hs: []Header{h("delay-at", "9999-12-31T23:59:59Z-01:00")}, code: CodeBadDue},
		{name: "at without offset", hs: []Header{h("delay-at", "2026-11-22T16:00:00")}, code: CodeBadDue},
		// RFC 3339 5.6: "T" and "Z" may be lower case; 5.7: a leap second.
		{name: "at lower-case t and z", hs: []Header{h("delay-at", "2026-11-22t16:00:00z")}, due: mustMs("2026-11-22T16:00:00Z")},
		{name: "at lower-case t, offset", hs: []Header{h("delay-at", "2026-11-22t18:00:00+02:00")}, due: mustMs("2026-11-22T16:00:00Z")},
		{name: "at leap second", hs: []Header{h("delay-at", "2016-12-31T23:59:60Z")}, due: mustMs("2017-01-01T00:00:00Z")},
		{name: "at second 61", hs: []Header{h("delay-at", "2016-12-31T23:59:61Z")}, code: CodeBadDue},
		{name: "at leap second, offset", hs: []Header{h("delay-at", "2017-01-01T00:59:60+01:00")}, due: mustMs("2017-01-01T00:00:00Z")},
		{name: "at second 60 not at 23:59 UTC", hs: []Header{h("delay-at", "2025-06-15T10:30:60Z")}, code: CodeBadDue},
		{name: "at second 60 at 23:59 local, not UTC", hs: []Header{h("delay-at", "2016-12-31T23:59:60+01:00")}, code: CodeBadDue},
		{name: "at date only", hs: []Header{h("delay-at", "2026-11-22")}, code: CodeBadDue},
		// RFC 3339 5.6: time-numoffset hours are 00-23, minutes 00-59,
		// and a fraction follows a "."; Go's parser takes +24:00, +00:60
		// and ",".
		{name: "at offset hour 24", hs: []Header{h("delay-at", "2026-11-22T00:00:00+24:00")}, code: CodeBadDue},
		{name: "at offset -24:00", hs: []Header{h("delay-at", "2026-11-22T00:00:00-24:00")}, code: CodeBadDue},
		{name: "at offset minute 60", hs: []Header{h("delay-at", "2026-11-22T16:00:00+00:60")}, code: CodeBadDue},
		{name: "at offset -23:60", hs: []Header{h("delay-at", "2026-11-22T16:00:00-23:60")}, code: CodeBadDue},
		{name: "at offset +23:59", hs: []Header{h("delay-at", "2026-11-22T23:59:00+23:59")}, due: mustMs("2026-11-22T00:00:00Z")},
		{name: "at offset +14:00", hs: []Header{h("delay-at", "2026-11-23T06:00:00+14:00")}, due: mustMs("2026-11-22T16:00:00Z")},
		{name: "at offset -12:00", hs: []Header{h("delay-at", "2026-11-22T04:00:00-12:00")}, due: mustMs("2026-11-22T16:00:00Z")},
		{name: "at comma fraction", hs: []Header{h("delay-at", "2026-11-22T16:00:00,5Z")}, code: CodeBadDue},
		{name: "at dot fraction", hs: []Header{h("delay-at", "2026-11-22T16:00:00.5Z")}, due: mustMs("2026-11-22T16:00:00.5Z")},
		{name: "at garbage", hs: []Header{h("delay-at", "tomorrow")}, code: CodeBadDue},
		{name: "at empty", hs: []Header{h("delay-at", "")}, code: CodeBadDue},
		// delay-at, Unix ms
		{name: "at unix ms", hs: []Header{h("delay-at", "1795000000000")}, due: 1795000000000},
		{name: "at unix ms zero", hs: []Header{h("delay-at", "0")}, due: 0},
		{name: "at unix ms max", hs: []Header{h("delay-at", "253402300799999")}, due: MaxDue},
		{name: "at unix ms past 9999", hs: []Header{h("delay-at", "253402300800000")}, code: CodeBadDue},
		{name: "at unix ms negative", hs: []Header{h("delay-at", "-1")}, code: CodeBadDue},
		{name: "at unix ms overflow", hs: []Header{h("delay-at", "99999999999999999999")}, code: CodeBadDue},
		{name: "at unix ms int64 max", hs: []Header{h("delay-at", "9223372036854775807")}, code: CodeBadDue},
		{name: "at unix seconds with fraction", hs: []Header{h("delay-at", "1795000000.5")}, code: CodeBadDue},
		// Unix seconds of 2001..5138 where milliseconds go: refused, not
		// fired at once as a time in 1970..1973. Around them, the past.
		{name: "at unix ms below seconds range", hs: []Header{h("delay-at", "999999999")}, due: 999999999},
		{name: "at unix seconds 2001", hs: []Header{h("delay-at", "1000000000")}, code: CodeBadDue},
		{name: "at unix seconds", hs: []Header{h("delay-at", "1795000000")}, code: CodeBadDue},
		{name: "at unix seconds leading zeros", hs: []Header{h("delay-at", "0001795000000")}, code: CodeBadDue},
		{name: "at unix seconds 5138", hs: []Header{h("delay-at", "99999999999")}, code: CodeBadDue},
		{name: "at unix ms above seconds range", hs: []Header{h("delay-at", "100000000000")}, due: 100000000000},
		// delay-after, Go durations
		{name: "after 90s", hs: []Header{h("delay-after", "90s")}, due: nowMs + 90_000},
		{name: "after 1h30m", hs: []Header{h("delay-after", "1h30m")}, due: nowMs + 5_400_000},
		{name: "after 500ms", hs: []Header{h("delay-after", "500ms")}, due: nowMs + 500},
		{name: "after sub-ms truncated", hs: []Header{h("delay-after", "1999us")}, due: nowMs + 1},
		{name: "after zero", hs: []Header{h("delay-after", "0s")}, due: nowMs},
		{name: "after negative", hs: []Header{h("delay-after", "-5s")}, code: CodeBadDue},
		{name: "after unknown unit", hs: []Header{h("delay-after", "5x")}, code: CodeBadDue},
		{name: "after empty", hs: []Header{h("delay-after", "")}, code: CodeBadDue},
		{name: "after whitespace trimmed", hs: []Header{h("delay-after", " 90s ")}, due: nowMs + 90_000},
		// delay-after, days
		{name: "after 3d", hs: []Header{h("delay-after", "3d")}, due: nowMs + 3*day},
		{name: "after 2d12h", hs: []Header{h("delay-after", "2d12h")}, due: nowMs + 2*day + day/2},
		{name: "after +1500 (one leading plus)", hs: []Header{h("delay-after", "+1500")}, due: nowMs + 1500},
		{name: "after +3d", hs: []Header{h("delay-after", "+3d")}, due: nowMs + 3*day},
		{name: "after 1d1h1m1s1ms", hs: []Header{h("delay-after", "1d1h1m1s1ms")}, due: nowMs + day + 3_661_001},
		{name: "after 0d", hs: []Header{h("delay-after", "0d")}, due: nowMs},
		{name: "after negative days", hs: []Header{h("delay-after", "-3d")}, code: CodeBadDue},
		{name: "after days then negative", hs: []Header{h("delay-after", "2d-5h")}, code: CodeBadDue},
		{name: "after fractional days", hs: []Header{h("delay-after", "1.5d")}, code: CodeBadDue},
		{name: "after bare d", hs: []Header{h("delay-after", "d")}, code: CodeBadDue},
		{name: "after days then junk", hs: []Header{h("delay-after", "2dx")}, code: CodeBadDue},
		{name: "after days then bare zero", hs: []Header{h("delay-after", "1d0")}, code: CodeBadDue},
		{name: "after days then bare digit", hs: []Header{h("delay-after", "1d5")}, code: CodeBadDue},
		{name: "after days then zero with unit", hs: []Header{h("delay-after", "1d0s")}, due: nowMs + day},
		{name: "after huge days", hs: []Header{h("delay-after", "99999999999d")}, code: CodeBadDue},
		{name: "after int64 days", hs: []Header{h("delay-after", "9223372036854775807d")}, code: CodeBadDue},
		{name: "after too many days", hs: []Header{h("delay-after", "99999999999999999999d")}, code: CodeBadDue},
		{name: "after past year 9999", hs: []Header{h("delay-after", "3000000d")}, code: CodeBadDue},
		{name: "after 7000 years ok without max", hs: []Header{h("delay-after", "2000000d")}, due: nowMs + 2_000_000*day},
		// delay-after, integer ms
		{name: "after ms", hs: []Header{h("delay-after", "1500")}, due: nowMs + 1500},
		{name: "after ms zero", hs: []Header{h("delay-after", "0")}, due: nowMs},
		{name: "after ms overflow", hs: []Header{h("delay-after", "9223372036854775807")}, code: CodeBadDue},
		{name: "after ms beyond int64", hs: []Header{h("delay-after", "99999999999999999999")}, code: CodeBadDue},
		// presence
		{name: "neither", hs: []Header{h("x", "y")}, code: CodeMissingDue},
		{name: "both", hs: []Header{h("delay-at", "0"), h("delay-after", "1s")}, code: CodeAmbiguousDue},
		{name: "both even when one is empty", hs: []Header{h("delay-at", ""), h("delay-after", "1s")}, code: CodeAmbiguousDue},
		{name: "repeated: last wins", hs: []Header{h("delay-after", "garbage"), h("delay-after", "1s")}, due: nowMs + 1000},
		{name: "repeated: last wins even if bad", hs: []Header{h("delay-after", "1s"), h("delay-after", "garbage")}, code: CodeBadDue},
		// case-insensitive names
		{name: "upper case name", hs: []Header{h("DELAY-AFTER", "1s")}, due: nowMs + 1000},
		{name: "mixed case name", hs: []Header{h("Delay-At", "1795000000000")}, due: 1795000000000},
		{name: "mixed case both", hs: []Header{h("Delay-At", "0"), h("DELAY-after", "1s")}, code: CodeAmbiguousDue},
		// max_delay
		{name: "max delay ok", rules: Rules{MaxDelay: 365 * 24 * time.Hour}, hs: []Header{h("delay-after", "365d")}, due: nowMs + 365*day},
		{name: "max delay exceeded", rules: Rules{MaxDelay: 365 * 24 * time.Hour}, hs: []Header{h("delay-after", "365d1ms")}, code: CodeDelayTooLong},
		{name: "max delay at", rules: Rules{MaxDelay: time.Hour}, hs: []Header{h("delay-at", "2026-11-22T16:04:05.124Z")}, code: CodeDelayTooLong},
		{name: "max delay at past ok", rules: Rules{MaxDelay: time.Hour}, hs: []Header{h("delay-at", "2000-01-01T00:00:00Z")}, due: mustMs("2000-01-01T00:00:00Z")},
		// A well-formed delay-after too long for any due time is
		// delay-too-long under a max_delay (bad-due without one, above).
		{name: "overflowing days over max delay", rules: Rules{MaxDelay: time.Hour}, hs: []Header{h("delay-after", "99999999999d")}, code: CodeDelayTooLong},
		{name: "days past year 9999 over max delay", rules: Rules{MaxDelay: 365 * 24 * time.Hour}, hs: []Header{h("delay-after", "3000000d")}, code: CodeDelayTooLong},
		{name: "ms beyond int64 over max delay", rules: Rules{MaxDelay: time.Hour}, hs: []Header{h("delay-after", "99999999999999999999")}, code: CodeDelayTooLong},
		{name: "ms overflowing the due over max delay", rules: Rules{MaxDelay: time.Hour}, hs: []Header{h("delay-after", "9223372036854775807")}, code: CodeDelayTooLong},
		// time.ParseDuration does not tell an overflow from a malformed
		// value: a Go duration past 292 years stays bad-due.
		{name: "duration overflow stays bad due", rules: Rules{MaxDelay: time.Hour}, hs: []Header{h("delay-after", "9999999999999h")}, code: CodeBadDue},
		{name: "malformed stays bad due under max delay", rules: Rules{MaxDelay: time.Hour}, hs: []Header{h("delay-after", "99999999999x")}, code: CodeBadDue},
		{name: "negative stays bad due under max delay", rules: Rules{MaxDelay: time.Hour}, hs: []Header{h("delay-after", "-99999999999d")}, code: CodeBadDue},
		// max_delay with the bridge's clock: a message time ahead of it (a
		// producer's CreateTime) does not stretch how long a task is held.
		{name: "message time ahead: after bounded from now", rules: Rules{MaxDelay: 30 * 24 * time.Hour, Now: at(now.Add(-10 * 24 * time.Hour))},
			hs: []Header{h("delay-after", "25d")}, code: CodeDelayTooLong},
		{name: "message time ahead: after within", rules: Rules{MaxDelay: 30 * 24 * time.Hour, Now: at(now.Add(-10 * 24 * time.Hour))},
			hs: []Header{h("delay-after", "20d")}, due: nowMs + 20*day},
		{name: "message time ahead: at bounded from now", rules: Rules{MaxDelay: time.Hour, Now: at(now.Add(-time.Hour))},
			hs: []Header{h("delay-at", "2026-11-22T15:34:05.124Z")}, code: CodeDelayTooLong},
		{name: "message time ahead within the skew: from it", rules: Rules{MaxDelay: time.Hour, Now: at(now.Add(-time.Millisecond))},
			hs: []Header{h("delay-after", "1h")}, due: nowMs + 3_600_000},
		{name: "message time a minute ahead: from it", rules: Rules{MaxDelay: time.Hour, Now: at(now.Add(-MaxClockSkew))},
			hs: []Header{h("delay-after", "1h")}, due: nowMs + 3_600_000},
		{name: "message time past the skew: from now plus it", rules: Rules{MaxDelay: time.Hour, Now: at(now.Add(-MaxClockSkew - time.Millisecond))},
			hs: []Header{h("delay-after", "1h")}, code: CodeDelayTooLong},
		{name: "message time behind: bounded from it", rules: Rules{MaxDelay: 30 * 24 * time.Hour, Now: at(now.Add(10 * 24 * time.Hour))},
			hs: []Header{h("delay-after", "30d")}, due: nowMs + 30*day},
		{name: "message time behind: exceeded from it", rules: Rules{MaxDelay: 30 * 24 * time.Hour, Now: at(now.Add(10 * 24 * time.Hour))},
			hs: []Header{h("delay-after", "30d1ms")}, code: CodeDelayTooLong},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := tt.rules
			r.DefaultTarget = "orders"
			r.DLQ = "delay.dlq"
			got := Parse(kafkaMsg(tt.hs...), &r)
			if tt.code != "" {
				wantDeadLetter(t, got, tt.code)
				return
			}
			if got.Kind != KindSchedule {
				t.Fatalf("kind %v (%s: %s), want schedule", got.Kind, got.Code, got.Detail)
			}
			if got.Due != tt.due {
				t.Fatalf("due %d (%s), want %d (%s)", got.Due, FormatDue(got.Due), tt.due, FormatDue(tt.due))
			}
			if v := header(got.Headers, HeaderDue); v != FormatDue(tt.due) {
				t.Fatalf("delay-due %q, want %q", v, FormatDue(tt.due))
			}
		})
	}
}

func TestParseZeroTime(t *testing.T) {
	// An adapter that forgot the broker time must not produce a due in year 1.
	m := kafkaMsg(h("delay-after", "1s"), h("delay-target", "orders"))
	m.Time = time.Time{}
	wantDeadLetter(t, Parse(m, nil), CodeBadDue)
	m.Headers = []Header{h("delay-at", "2026-11-22T16:00:00Z"), h("delay-target", "orders")}
	// delay-at does not depend on the broker time, but max_delay does: the
	// due is two millennia after time zero.
	if got := Parse(m, nil); got.Kind != KindSchedule {
		t.Fatalf("no max_delay: %v %s", got.Kind, got.Detail)
	}
	wantDeadLetter(t, Parse(m, &Rules{MaxDelay: time.Hour}), CodeDelayTooLong)
}

func TestParseTargetRules(t *testing.T) {
	onlyKafka := func(t Transport) bool { return t == TransportKafka }
	tests := []struct {
		name   string
		msg    *Message
		rules  Rules
		code   Code
		tr     Transport
		target string
	}{
		{name: "bare kafka", msg: kafkaMsg(h("delay-target", "orders")), tr: TransportKafka, target: "orders"},
		{name: "bare nats", msg: natsMsg(h("delay-target", "orders.created")), tr: TransportNATS, target: "orders.created"},
		{name: "own prefix without transports", msg: kafkaMsg(h("delay-target", "kafka:orders")), tr: TransportKafka, target: "orders"},
		{name: "cross to nats", msg: kafkaMsg(h("delay-target", "nats:orders.created")), rules: Rules{Transports: both}, tr: TransportNATS, target: "orders.created"},
		{name: "cross to kafka", msg: natsMsg(h("delay-target", "kafka:orders")), rules: Rules{Transports: both}, tr: TransportKafka, target: "orders"},
		{name: "cross not configured (nil)", msg: kafkaMsg(h("delay-target", "nats:orders")), code: CodeBadTarget},
		{name: "cross not configured", msg: natsMsg(h("delay-target", "kafka:orders")), rules: Rules{Transports: func(t Transport) bool { return t == TransportNATS }}, code: CodeBadTarget},
		{name: "own always available", msg: kafkaMsg(h("delay-target", "orders")), rules: Rules{Transports: func(Transport) bool { return false }}, tr: TransportKafka, target: "orders"},
		{name: "nats subject with colon via prefix", msg: natsMsg(h("delay-target", "nats:a:b.c")), tr: TransportNATS, target: "a:b.c"},
		{name: "unknown prefix", msg: kafkaMsg(h("delay-target", "foo:bar")), code: CodeBadTarget},
		{name: "unknown prefix on nats", msg: natsMsg(h("delay-target", "foo:bar")), code: CodeBadTarget},
		{name: "prefix in any ASCII case", msg: kafkaMsg(h("delay-target", "Kafka:orders")), tr: TransportKafka, target: "orders"},
		{name: "prefix upper case across", msg: kafkaMsg(h("delay-target", "NATS:orders.created")), rules: Rules{Transports: both}, tr: TransportNATS, target: "orders.created"},
		{name: "prefix with Kelvin sign", msg: kafkaMsg(h("delay-target", "\u212aafka:orders")), code: CodeBadTarget},
		{name: "prefix case keeps the name's", msg: natsMsg(h("delay-target", "Nats:Orders.X")), tr: TransportNATS, target: "Orders.X"},
		{name: "whitespace trimmed", msg: kafkaMsg(h("delay-target", " orders ")), tr: TransportKafka, target: "orders"},
		{name: "empty header", msg: kafkaMsg(h("delay-target", "")), rules: Rules{DefaultTarget: "orders"}, code: CodeBadTarget},
		{name: "default target", msg: kafkaMsg(), rules: Rules{DefaultTarget: "orders"}, tr: TransportKafka, target: "orders"},
		{name: "default target crossing", msg: kafkaMsg(), rules: Rules{DefaultTarget: "nats:a.b", Transports: both}, tr: TransportNATS, target: "a.b"},
		{name: "header beats default", msg: kafkaMsg(h("delay-target", "mine")), rules: Rules{DefaultTarget: "orders"}, tr: TransportKafka, target: "mine"},
		{name: "missing", msg: kafkaMsg(), code: CodeMissingTarget},
		{name: "a delay source", msg: kafkaMsg(h("delay-target", "delay")), rules: Rules{DelaySource: delaySource}, code: CodeTargetNotAllowed},
		{name: "a delay source across", msg: natsMsg(h("delay-target", "kafka:delay")), rules: Rules{DelaySource: delaySource, Transports: both}, code: CodeTargetNotAllowed},
		{name: "a delay source by default", msg: kafkaMsg(), rules: Rules{DefaultTarget: "delay", DelaySource: delaySource}, code: CodeTargetNotAllowed},
		{name: "same name on the other transport", msg: natsMsg(h("delay-target", "delay")), rules: Rules{DelaySource: delaySource}, tr: TransportNATS, target: "delay"},
		{name: "not a delay source", msg: kafkaMsg(h("delay-target", "orders")), rules: Rules{DelaySource: delaySource}, tr: TransportKafka, target: "orders"},
		{name: "bad default", msg: kafkaMsg(), rules: Rules{DefaultTarget: "a b"}, code: CodeBadTarget},
		{name: "kafka illegal char", msg: kafkaMsg(h("delay-target", "or ders")), code: CodeBadTarget},
		{name: "kafka slash", msg: kafkaMsg(h("delay-target", "a/b")), code: CodeBadTarget},
		{name: "kafka dot", msg: kafkaMsg(h("delay-target", ".")), code: CodeBadTarget},
		{name: "kafka dotdot", msg: kafkaMsg(h("delay-target", "..")), code: CodeBadTarget},
		{name: "kafka dots ok", msg: kafkaMsg(h("delay-target", "...")), tr: TransportKafka, target: "..."},
		{name: "kafka 249", msg: kafkaMsg(h("delay-target", strings.Repeat("a", 249))), tr: TransportKafka, target: strings.Repeat("a", 249)},
		{name: "kafka 250", msg: kafkaMsg(h("delay-target", strings.Repeat("a", 250))), code: CodeBadTarget},
		{name: "kafka prefix empty", msg: kafkaMsg(h("delay-target", "kafka:")), code: CodeBadTarget},
		{name: "kafka unicode", msg: kafkaMsg(h("delay-target", "ordérs")), code: CodeBadTarget},
		{name: "nats empty token", msg: natsMsg(h("delay-target", "a..b")), code: CodeBadTarget},
		{name: "nats leading dot", msg: natsMsg(h("delay-target", ".a")), code: CodeBadTarget},
		{name: "nats trailing dot", msg: natsMsg(h("delay-target", "a.")), code: CodeBadTarget},
		{name: "nats star", msg: natsMsg(h("delay-target", "a.*")), code: CodeBadTarget},
		{name: "nats gt", msg: natsMsg(h("delay-target", "a.>")), code: CodeBadTarget},
		{name: "nats lone gt", msg: natsMsg(h("delay-target", ">")), code: CodeBadTarget},
		{name: "nats star inside token is literal", msg: natsMsg(h("delay-target", "a.b*c")), tr: TransportNATS, target: "a.b*c"},
		{name: "nats space", msg: natsMsg(h("delay-target", "a b")), code: CodeBadTarget},
		{name: "nats tab", msg: natsMsg(h("delay-target", "a\tb")), code: CodeBadTarget},
		{name: "nats control", msg: natsMsg(h("delay-target", "a\x00b")), code: CodeBadTarget},
		{name: "nats prefix empty", msg: natsMsg(h("delay-target", "nats:")), code: CodeBadTarget},
		{name: "nats URL", msg: natsMsg(h("delay-target", "nats://orders.x")), code: CodeBadTarget},
		{name: "nats URL from kafka", msg: kafkaMsg(h("delay-target", "nats://orders.x")), rules: Rules{Transports: both}, code: CodeBadTarget},
		{name: "kafka URL", msg: kafkaMsg(h("delay-target", "kafka://orders")), code: CodeBadTarget},
		{name: "bare URL remains", msg: natsMsg(h("delay-target", "//orders.x")), code: CodeBadTarget},
		{name: "nats slash inside is literal", msg: natsMsg(h("delay-target", "a/b./c")), tr: TransportNATS, target: "a/b./c"},
		{name: "nats 1024 bytes", msg: natsMsg(h("delay-target", "a."+strings.Repeat("b", 1022))), tr: TransportNATS, target: "a." + strings.Repeat("b", 1022)},
		{name: "nats 1025 bytes", msg: natsMsg(h("delay-target", "a."+strings.Repeat("b", 1023))), code: CodeBadTarget},
		{name: "allow refuses", msg: kafkaMsg(h("delay-target", "secret")), rules: Rules{Allow: func(_ Transport, n string) bool { return n != "secret" }}, code: CodeTargetNotAllowed},
		{name: "allow accepts", msg: kafkaMsg(h("delay-target", "public")), rules: Rules{Allow: func(_ Transport, n string) bool { return n != "secret" }}, tr: TransportKafka, target: "public"},
		{name: "allow sees resolved transport and name", msg: kafkaMsg(h("delay-target", "nats:a.b")), rules: Rules{Transports: both, Allow: func(t Transport, n string) bool { return t == TransportNATS && n == "a.b" }}, tr: TransportNATS, target: "a.b"},
		{name: "bad target beats allow", msg: kafkaMsg(h("delay-target", "nats:a.b")), rules: Rules{Transports: onlyKafka, Allow: func(Transport, string) bool { return false }}, code: CodeBadTarget},
		{name: "repeated: last wins", msg: kafkaMsg(h("delay-target", "first"), h("DELAY-TARGET", "second")), tr: TransportKafka, target: "second"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.msg.Headers = append(tt.msg.Headers, h("delay-after", "1s"))
			r := tt.rules
			r.DLQ = "dlq"
			got := Parse(tt.msg, &r)
			if tt.code != "" {
				wantDeadLetter(t, got, tt.code)
				return
			}
			if got.Kind != KindSchedule || got.Transport != tt.tr || got.Target != tt.target {
				t.Fatalf("got %v %v %q (%s: %s), want schedule %v %q", got.Kind, got.Transport, got.Target, got.Code, got.Detail, tt.tr, tt.target)
			}
		})
	}
}

func TestParseTooLarge(t *testing.T) {
	m := kafkaMsg(h("delay-after", "1s"), h("delay-target", "orders"))
	// key 7 + value 7 + "delay-after" 11 + "1s" 2 + "delay-target" 12 + "orders" 6,
	// and what delivery adds: "delay-id" 8 + "order-1" 7, "delay-origin" 12 +
	// "kafka:delay/3@42" 16, "delay-due" 9 + 24 (RFC 3339 ms UTC); and the
	// framing of those 5 headers, 4 bytes each; and what a NATS target
	// adds: "Nats-Msg-Id" 11 + "kafka:" 6 + 3×"delay" 15 + "|" + 3×"order-1"
	// 21 + "|" + 24, framed 4, and the 12 bytes of "NATS/1.0" and CRLFs.
	natsID := 11 + 6 + 15 + 1 + 21 + 1 + 24 + 4 + 12
	size := 7 + 7 + 11 + 2 + 12 + 6 + 8 + 7 + 12 + 16 + 9 + 24 + 5*4 + natsID
	if got := Parse(m, &Rules{MaxBytes: size}); got.Kind != KindSchedule {
		t.Fatalf("at the limit: %v %s %s", got.Kind, got.Code, got.Detail)
	}
	wantDeadLetter(t, Parse(m, &Rules{MaxBytes: size - 1}), CodeTooLarge)
	// The estimate bounds the delivered record: its key, value and headers
	// (the control headers gone, the three added) fit.
	task := Parse(m, &Rules{MaxBytes: size})
	delivered := len(task.Key) + len(task.Value)
	for _, hd := range task.Headers {
		delivered += len(hd.Key) + len(hd.Value) + headerFraming(len(hd.Key), len(hd.Value))
	}
	if delivered > size {
		t.Fatalf("delivered %d bytes, over the limit %d", delivered, size)
	}
	// A dead letter's detail is bounded, so its DLQ copy stays within
	// the source size plus DeadLetterOverhead and its origin.
	dl := DeadLetter(&task, CodePublishFailed, strings.Repeat("é", MaxDetail))
	if len(dl.Detail) > MaxDetail || !utf8.ValidString(dl.Detail) {
		t.Fatalf("detail of %d bytes (valid UTF-8: %v)", len(dl.Detail), utf8.ValidString(dl.Detail))
	}
	dlSize := len(dl.Key) + len(dl.Value)
	for _, hd := range dl.Headers {
		dlSize += len(hd.Key) + len(hd.Value) + headerFraming(len(hd.Key), len(hd.Value))
	}
	if max := size + DeadLetterOverhead; dlSize > max {
		t.Fatalf("dead letter of %d bytes, over %d", dlSize, max)
	}
	// A cancel carries no payload, so the bound does not apply.
	m.Headers = append(m.Headers, h("delay-cancel", "true"))
	if got := Parse(m, &Rules{MaxBytes: 1}); got.Kind != KindCancel {
		t.Fatalf("cancel: %v %s", got.Kind, got.Code)
	}
}

// TestHeaderFraming: a header's framing is counted as the larger of
// Kafka's two zig-zag varint lengths and NATS's ": " and CRLF.
func TestHeaderFraming(t *testing.T) {
	for _, tc := range []struct{ k, v, want int }{
		{0, 0, 4},         // NATS's 4 over Kafka's 1 + 1
		{1, 63, 4},        // 1 + 1
		{64, 64, 4},       // 2 + 2
		{70, 10000, 5},    // 2 + 3
		{8192, 8192, 6},   // 3 + 3
		{1, 1 << 20, 5},   // 1 + 4
		{1, 1<<20 - 1, 4}, // 1 + 3
	} {
		if got := headerFraming(tc.k, tc.v); got != tc.want {
			t.Errorf("headerFraming(%d, %d) = %d, want %d", tc.k, tc.v, got, tc.want)
		}
	}
}

// TestParseTooLargeManyHeaders: every header's framing counts, so a
// message of many small headers just under the limit by names and values
// alone is too large as delivered.
func TestParseTooLargeManyHeaders(t *testing.T) {
	m := kafkaMsg(h("delay-after", "1s"), h("delay-target", "orders"))
	for i := 0; i < 600; i++ {
		m.Headers = append(m.Headers, h("x", ""))
	}
	bare := len(m.Key) + len(m.Value)
	for _, hd := range m.Headers {
		bare += len(hd.Key) + len(hd.Value)
	}
	bare += 8 + 7 + 12 + 16 + 9 + 24 // the added headers
	bare += natsAddedSize("delay", "order-1", TransportKafka)
	wantDeadLetter(t, Parse(m, &Rules{MaxBytes: bare + 600*4}), CodeTooLarge)
	if got := Parse(m, &Rules{MaxBytes: bare + 605*4}); got.Kind != KindSchedule {
		t.Fatalf("at the limit with framing: %v %s %s", got.Kind, got.Code, got.Detail)
	}
}

func TestParseCancel(t *testing.T) {
	tests := []struct {
		name string
		msg  *Message
		kind Kind
		id   string
		code Code
	}{
		{name: "true", msg: kafkaMsg(h("delay-cancel", "true")), kind: KindCancel, id: "order-1"},
		{name: "TRUE with spaces", msg: kafkaMsg(h("Delay-Cancel", " TRUE ")), kind: KindCancel, id: "order-1"},
		{name: "cancel ignores due and target", msg: kafkaMsg(h("delay-cancel", "true"), h("delay-at", "x"), h("delay-after", "y"), h("delay-target", "a b")), kind: KindCancel, id: "order-1"},
		{name: "cancel by delay-id", msg: kafkaMsg(h("delay-id", "job-9"), h("delay-cancel", "true")), kind: KindCancel, id: "job-9"},
		{name: "nats cancel by msg id", msg: natsMsg(h("Nats-Msg-Id", "m-1"), h("delay-cancel", "true")), kind: KindCancel, id: "m-1"},
		{name: "false schedules", msg: kafkaMsg(h("delay-cancel", "false"), h("delay-after", "1s")), kind: KindSchedule, id: "order-1"},
		{name: "False schedules", msg: kafkaMsg(h("delay-cancel", "False"), h("delay-after", "1s")), kind: KindSchedule, id: "order-1"},
		{name: "empty schedules", msg: kafkaMsg(h("delay-cancel", ""), h("delay-after", "1s")), kind: KindSchedule, id: "order-1"},
		{name: "other value", msg: kafkaMsg(h("delay-cancel", "yes"), h("delay-after", "1s")), code: CodeBadDue},
		{name: "one", msg: kafkaMsg(h("delay-cancel", "1")), code: CodeBadDue},
		{name: "repeated: last wins", msg: kafkaMsg(h("delay-cancel", "true"), h("delay-cancel", "false"), h("delay-after", "1s")), kind: KindSchedule, id: "order-1"},
		{name: "tombstone with key", msg: tombstone(kafkaMsg(), "k1"), kind: KindCancel, id: "k1"},
		{name: "tombstone with delay-id", msg: tombstone(kafkaMsg(h("delay-id", "job-9")), "k1"), kind: KindCancel, id: "job-9"},
		{name: "tombstone without key, with delay-id", msg: tombstone(kafkaMsg(h("delay-id", "job-9")), ""), kind: KindCancel, id: "job-9"},
		{name: "tombstone with an encoded delay-id", msg: tombstone(kafkaMsg(h("delay-id", "50%25off"), h("delay-id-encoding", "percent")), "k1"), kind: KindCancel, id: "50%off"},
		{name: "tombstone with schedule headers still cancels", msg: tombstone(kafkaMsg(h("delay-after", "1s")), "k1"), kind: KindCancel, id: "k1"},
		{name: "tombstone without key", msg: tombstone(kafkaMsg(h("delay-after", "1s")), ""), code: CodeMissingDue},
		{name: "cancel without any id is a dead letter", msg: func() *Message { m := kafkaMsg(h("delay-cancel", "true")); m.Key = nil; return m }(), code: CodeMissingDue},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Parse(tt.msg, &Rules{DefaultTarget: "orders", DLQ: "dlq"})
			if tt.code != "" {
				wantDeadLetter(t, got, tt.code)
				return
			}
			if got.Kind != tt.kind || got.ID != tt.id {
				t.Fatalf("got %v id %q (%s %s), want %v id %q", got.Kind, got.ID, got.Code, got.Detail, tt.kind, tt.id)
			}
			if got.Kind != KindCancel {
				return
			}
			want := Task{
				Kind: KindCancel, ID: tt.id, Source: tt.msg.Source, Origin: tt.msg.Origin(),
				Stamp: nowMs, Partition: tt.msg.Partition, Offset: tt.msg.Offset, Due: nowMs,
				Transport: tt.msg.Transport, DLQTransport: tt.msg.Transport, DLQ: "dlq",
			}
			if !equalTask(got, want) {
				t.Fatalf("got  %+v\nwant %+v", got, want)
			}
		})
	}
}

func tombstone(m *Message, key string) *Message {
	m.Tombstone = true
	m.Value = nil
	m.Key = nil
	if key != "" {
		m.Key = []byte(key)
	}
	return m
}

func TestParseID(t *testing.T) {
	noKey := func(m *Message) *Message { m.Key = nil; return m }
	emptyKey := func(m *Message) *Message { m.Key = []byte{}; return m }
	inc := func(n uint32, m *Message) *Message { m.Incarnation = n; return m }
	tests := []struct {
		name string
		msg  *Message
		id   string
	}{
		{name: "kafka key", msg: kafkaMsg(), id: "order-1"},
		{name: "kafka delay-id beats key", msg: kafkaMsg(h("delay-id", "job-9")), id: "job-9"},
		{name: "kafka delay-id case-insensitive", msg: kafkaMsg(h("DELAY-ID", "job-9")), id: "job-9"},
		{name: "kafka empty delay-id ignored", msg: kafkaMsg(h("delay-id", "")), id: "order-1"},
		{name: "kafka no key", msg: noKey(kafkaMsg()), id: "kafka:delay/3@42"},
		{name: "kafka empty key", msg: emptyKey(kafkaMsg()), id: "kafka:delay/3@42"},
		{name: "kafka ignores Nats-Msg-Id", msg: noKey(kafkaMsg(h("Nats-Msg-Id", "m-1"))), id: "kafka:delay/3@42"},
		{name: "nats msg id", msg: natsMsg(h("Nats-Msg-Id", "m-1")), id: "m-1"},
		{name: "nats msg id case-insensitive", msg: natsMsg(h("nats-msg-id", "m-1")), id: "m-1"},
		{name: "nats delay-id beats msg id", msg: natsMsg(h("Nats-Msg-Id", "m-1"), h("delay-id", "job-9")), id: "job-9"},
		{name: "nats none", msg: natsMsg(), id: "nats:DELAY#7"},
		{name: "nats ignores key", msg: func() *Message { m := natsMsg(); m.Key = []byte("k"); return m }(), id: "nats:DELAY#7"},
		{name: "kafka no key, second log", msg: inc(1, noKey(kafkaMsg())), id: "kafka:delay/3@42~i1"},
		{name: "kafka no key, later log", msg: inc(4294967295, noKey(kafkaMsg())), id: "kafka:delay/3@42~i4294967295"},
		{name: "kafka key, second log", msg: inc(1, kafkaMsg()), id: "order-1"},
		{name: "nats none, second log", msg: inc(2, natsMsg()), id: "nats:DELAY#7~i2"},
		{name: "nats msg id, second log", msg: inc(2, natsMsg(h("Nats-Msg-Id", "m-1"))), id: "m-1"},
		{name: "repeated delay-id: last wins", msg: kafkaMsg(h("delay-id", "a"), h("delay-id", "b")), id: "b"},
		// A delivery's encoded id republished as it arrived keeps the id.
		{name: "delay-id percent-decoded", msg: kafkaMsg(h("delay-id", "50%25off%20"), h("Delay-Id-Encoding", "percent")), id: "50%off "},
		{name: "nats delay-id percent-decoded", msg: natsMsg(h("delay-id", "job%2D7"), h("delay-id-encoding", " percent ")), id: "job-7"},
		{name: "plus stays plus", msg: kafkaMsg(h("delay-id", "a+b%2B"), h("delay-id-encoding", "percent")), id: "a+b+"},
		{name: "other encoding: as is", msg: kafkaMsg(h("delay-id", "50%25off"), h("delay-id-encoding", "base64")), id: "50%25off"},
		{name: "no encoding header: as is", msg: kafkaMsg(h("delay-id", "50%25off")), id: "50%25off"},
		{name: "bad escape: as is", msg: kafkaMsg(h("delay-id", "50%zzoff"), h("delay-id-encoding", "percent")), id: "50%zzoff"},
		{name: "cut escape: as is", msg: kafkaMsg(h("delay-id", "50%2"), h("delay-id-encoding", "percent")), id: "50%2"},
		{name: "lone percent: as is", msg: kafkaMsg(h("delay-id", "%"), h("delay-id-encoding", "percent")), id: "%"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.msg.Headers = append(tt.msg.Headers, h("delay-after", "1s"))
			got := Parse(tt.msg, &Rules{DefaultTarget: "orders"})
			if got.Kind != KindSchedule || got.ID != tt.id {
				t.Fatalf("got %v id %q (%s), want id %q", got.Kind, got.ID, got.Detail, tt.id)
			}
			if v := header(got.Headers, HeaderID); v != tt.id {
				t.Fatalf("delay-id header %q, want %q", v, tt.id)
			}
			// The origin never carries the incarnation.
			if o := tt.msg.Origin(); got.Origin != o || header(got.Headers, HeaderOrigin) != o {
				t.Fatalf("origin %q, header %q, want %q", got.Origin, header(got.Headers, HeaderOrigin), o)
			}
			if _, err := time.Parse(time.RFC3339Nano, header(got.Headers, HeaderDue)); err != nil {
				t.Fatalf("delay-due header: %v", err)
			}
			// A cancel gets the same id; one without id names no task
			// (its own origin): a dead letter.
			c := *tt.msg
			c.Headers = append(slices.Clone(c.Headers), h("delay-cancel", "true"))
			got2 := Parse(&c, &Rules{DefaultTarget: "orders"})
			if tt.id == DefaultID(tt.msg.Origin(), tt.msg.Incarnation) {
				if got2.Kind != KindDeadLetter || got2.Code != CodeMissingDue {
					t.Fatalf("cancel without id: got %v code %q, want a missing-due dead letter", got2.Kind, got2.Code)
				}
			} else if got2.Kind != KindCancel || got2.ID != tt.id {
				t.Fatalf("cancel: got %v id %q, want id %q", got2.Kind, got2.ID, tt.id)
			}
		})
	}
}

// TestParseSchedule pins a whole schedule task, with the delivered headers
// of CONTRACT §2 in order.
func TestParseSchedule(t *testing.T) {
	m := kafkaMsg(
		h("trace", "t1"),
		h("Delay-After", "90s"),
		h("DELAY-TARGET", "orders"),
		h("delay-key", "new-key"),
		h("Delay-Id", "job-9"),
		h("delay-cancel", "false"),
		h("delay-origin", "stale"),
		h("DELAY-DUE", "stale"),
		h("Nats-Msg-Id", "m-1"),
		h("trace", "t2"),
		Header{Key: "null", Value: nil},
		h("delay-error", "bad-target"),
		h("Delay-Error-Detail", "a replayed dead letter's: dropped"),
	)
	got := Parse(m, &Rules{DLQ: "delay.dlq", DefaultTarget: "unused"})
	due := nowMs + 90_000
	want := Task{
		Kind: KindSchedule, ID: "job-9", Source: "delay", Origin: "kafka:delay/3@42",
		Stamp: nowMs, Partition: 3, Offset: 42, Due: due,
		Transport: TransportKafka, Target: "orders",
		Key: []byte("new-key"), Value: []byte("payload"),
		Headers: []Header{
			h("trace", "t1"),
			h("Nats-Msg-Id", "m-1"),
			h("trace", "t2"),
			{Key: "null", Value: nil},
			h("delay-id", "job-9"),
			h("delay-origin", "kafka:delay/3@42"),
			h("delay-due", "2026-11-22T15:05:35.123Z"),
		},
		DLQTransport: TransportKafka, DLQ: "delay.dlq",
	}
	if !equalTask(got, want) {
		t.Fatalf("got  %s\nwant %s", dump(got), dump(want))
	}

	// delay-key present but empty delivers an empty key; absent keeps the
	// source key.
	m = kafkaMsg(h("delay-after", "1s"), h("delay-key", ""))
	if got := Parse(m, &Rules{DefaultTarget: "o"}); got.Key == nil || len(got.Key) != 0 {
		t.Fatalf("empty delay-key: key %q", got.Key)
	}
	m = kafkaMsg(h("delay-after", "1s"))
	if got := Parse(m, &Rules{DefaultTarget: "o"}); string(got.Key) != "order-1" {
		t.Fatalf("source key: %q", got.Key)
	}

	// A NATS schedule: no key; its Nats-Msg-Id is the id and is delivered
	// (the NATS sink sets its own, a Kafka target keeps it as a header).
	m = natsMsg(h("Nats-Msg-Id", "m-1"), h("delay-at", "2026-11-22T16:00:00Z"), h("delay-target", "kafka:orders"), h("app", "1"))
	got = Parse(m, &Rules{DLQ: "dlq.delay", Transports: both})
	want = Task{
		Kind: KindSchedule, ID: "m-1", Source: "DELAY", Origin: "nats:DELAY#7",
		Stamp: nowMs, Offset: 7, Due: mustMs("2026-11-22T16:00:00Z"),
		Transport: TransportKafka, Target: "orders", Value: []byte("payload"),
		Headers: []Header{
			h("Nats-Msg-Id", "m-1"),
			h("app", "1"),
			h("delay-id", "m-1"),
			h("delay-origin", "nats:DELAY#7"),
			h("delay-due", "2026-11-22T16:00:00.000Z"),
		},
		DLQTransport: TransportNATS, DLQ: "dlq.delay",
	}
	if !equalTask(got, want) {
		t.Fatalf("got  %s\nwant %s", dump(got), dump(want))
	}
}

// TestParseDoesNotModifyMessage: Parse reads the message; the added header
// values must not be written into the source's buffers.
func TestParseDoesNotModifyMessage(t *testing.T) {
	hs := make([]Header, 0, 16)
	hs = append(hs, h("delay-after", "1s"), h("delay-target", "o"), h("x", "y"))
	m := kafkaMsg(hs...)
	before := dump(Task{Headers: slices.Clone(m.Headers), Key: slices.Clone(m.Key), Value: slices.Clone(m.Value)})
	for _, r := range []*Rules{nil, {MaxBytes: 1}} {
		Parse(m, r)
		if after := dump(Task{Headers: m.Headers, Key: m.Key, Value: m.Value}); after != before {
			t.Fatalf("message changed:\n%s\n%s", before, after)
		}
	}
}

// TestParseDeadLetter pins a whole dead letter (CONTRACT §3).
func TestParseDeadLetter(t *testing.T) {
	m := kafkaMsg(
		h("trace", "t1"),
		h("Delay-At", "0"),
		h("delay-after", "1s"),
		h("delay-target", "orders"),
		h("delay-origin", "stale"),
		h("DELAY-ERROR", "stale"),
		h("delay-error-detail", "stale"),
		h("Nats-Msg-Id", "kept"),
	)
	got := Parse(m, &Rules{DLQ: "delay.dlq"})
	detail := "both delay-at and delay-after are set; set exactly one"
	want := Task{
		Kind: KindDeadLetter, ID: "kafka:delay/3@42", Source: "delay", Origin: "kafka:delay/3@42",
		Stamp: nowMs, Partition: 3, Offset: 42, Due: nowMs,
		Transport: TransportKafka, Target: "delay.dlq",
		Key: []byte("order-1"), Value: []byte("payload"),
		Headers: []Header{
			h("trace", "t1"),
			h("Delay-At", "0"),
			h("delay-after", "1s"),
			h("delay-target", "orders"),
			h("Nats-Msg-Id", "kept"),
			h("delay-error", "ambiguous-due"),
			h("delay-error-detail", detail),
			h("delay-origin", "kafka:delay/3@42"),
		},
		DLQTransport: TransportKafka, DLQ: "delay.dlq",
		Code: CodeAmbiguousDue, Detail: detail,
	}
	if !equalTask(got, want) {
		t.Fatalf("got  %s\nwant %s", dump(got), dump(want))
	}

	// With the bridge's clock, a dead letter is due when it was decided,
	// not at the message time a producer set (0: overdue since 1970).
	for _, stamp := range []time.Time{time.UnixMilli(0), now.Add(-time.Hour), now.Add(100 * 365 * 24 * time.Hour)} {
		m := kafkaMsg(h("delay-target", "orders"))
		m.Time = stamp
		got := Parse(m, &Rules{DLQ: "delay.dlq", Now: at(now)})
		if got.Kind != KindDeadLetter || got.Due != nowMs || got.Stamp != stamp.UnixMilli() {
			t.Errorf("message time %v: dead letter due %d, stamp %d; want due %d (the bridge's time), stamp the message's", stamp, got.Due, got.Stamp, nowMs)
		}
	}

	// A NATS message whose id is its Nats-Msg-Id keeps it in its dead
	// letter as delay-id: the DLQ's sink replaces Nats-Msg-Id, and a
	// replay must run under the same id. Not with a delay-id of its own,
	// not from Kafka, not for an id longer than maxMsgIDCopy.
	long := strings.Repeat("m", maxMsgIDCopy+1)
	for _, tc := range []struct {
		name string
		m    *Message
		want []string // delay-id values in the dead letter
	}{
		{"nats msg id", natsMsg(h("Nats-Msg-Id", "order-7")), []string{"order-7"}},
		{"nats delay-id of its own", natsMsg(h("Nats-Msg-Id", "order-7"), h("delay-id", "job-9")), []string{"job-9"}},
		{"nats msg id at the bound", natsMsg(h("Nats-Msg-Id", long[1:])), []string{long[1:]}},
		{"nats msg id over the bound", natsMsg(h("Nats-Msg-Id", long)), nil},
		{"nats no msg id", natsMsg(), nil},
		{"nats empty delay-id: the msg id is the id", natsMsg(h("Nats-Msg-Id", "order-7"), h("delay-id", "")), []string{"", "order-7"}},
		// A replay decodes the copy: it must give the msg id back.
		{"nats msg id with the encoding header", natsMsg(h("Nats-Msg-Id", "a%41 b"), h("delay-id-encoding", "percent")), []string{"a%2541%20b"}},
		{"nats msg id over the bound once encoded", natsMsg(h("Nats-Msg-Id", strings.Repeat("%", maxMsgIDCopy/3+1)), h("delay-id-encoding", "percent")), nil},
		{"kafka", kafkaMsg(h("Nats-Msg-Id", "order-7")), nil},
	} {
		got := Parse(tc.m, &Rules{DLQ: "dlq"})
		var ids []string
		for _, hd := range got.Headers {
			if strings.EqualFold(hd.Key, HeaderID) {
				ids = append(ids, string(hd.Value))
			}
		}
		if got.Kind != KindDeadLetter || !slices.Equal(ids, tc.want) {
			t.Errorf("%s: %v with delay-id %q, want a dead letter with %q", tc.name, got.Kind, ids, tc.want)
		}
		if tc.want == nil || tc.m.Transport != TransportNATS {
			continue
		}
		// Replayed as it is, with a due, the task has the id the message
		// would have had with one.
		withDue := func(hs []Header) *Message {
			return natsMsg(append(slices.Clone(hs), h("delay-after", "1s"))...)
		}
		wantID := Parse(withDue(tc.m.Headers), &Rules{DefaultTarget: "orders"}).ID
		if r := Parse(withDue(got.Headers), &Rules{DefaultTarget: "orders"}); r.Kind != KindSchedule || r.ID != wantID {
			t.Errorf("%s: the replayed dead letter is %v with id %q, want %q", tc.name, r.Kind, r.ID, wantID)
		}
	}

	// A NATS dead letter goes to the NATS DLQ, keeps the tombstone-free
	// value as is (nil stays nil).
	n := natsMsg(h("delay-after", "1s"))
	n.Value = nil
	got = Parse(n, &Rules{DLQ: "dlq.delay"})
	if got.Kind != KindDeadLetter || got.Transport != TransportNATS || got.Target != "dlq.delay" || got.Value != nil || got.ID != "nats:DELAY#7" {
		t.Fatalf("nats dead letter: %s", dump(got))
	}
}

// TestParseDetailsMisspelledID: a cancel that names no task because its
// delay-id header is misspelled says which header was not read.
func TestParseDetailsMisspelledID(t *testing.T) {
	const hint = `; header "delay_id" is not read: the name is delay-id (in any case)`
	m := kafkaMsg(h("delay-cancel", "true"), h("delay_id", "o-1"))
	m.Key = nil
	if got := Parse(m, nil); got.Code != CodeMissingDue || !strings.HasSuffix(got.Detail, hint) {
		t.Errorf("keyless cancel: %q %q, want missing-due ending %q", got.Code, got.Detail, hint)
	}
	m = kafkaMsg(h("delay_id", "o-1"))
	m.Key, m.Value, m.Tombstone = nil, nil, true
	if got := Parse(m, nil); got.Code != CodeMissingDue || !strings.HasSuffix(got.Detail, hint) {
		t.Errorf("keyless tombstone: %q %q, want missing-due ending %q", got.Code, got.Detail, hint)
	}
}

// TestParseMisspelledCost: the misspelled-header hint of a missing-due
// reads every header of the message, which are the publisher's: a message
// full of them (hundreds of thousands of short headers in a megabyte) made
// it allocate per header and take ten times the rest of Parse. It now
// allocates nothing per header.
func TestParseMisspelledCost(t *testing.T) {
	msg := func(n int) *Message {
		hs := make([]Header, n)
		for i := range hs {
			hs[i] = h("Delay-Attribute", "")
		}
		return kafkaMsg(hs...)
	}
	one, many := msg(1), msg(1000)
	if got := Parse(many, nil); got.Code != CodeMissingDue || got.Detail != "neither delay-at nor delay-after is set" {
		t.Fatalf("Parse: %q %q, want missing-due without a hint", got.Code, got.Detail)
	}
	base := testing.AllocsPerRun(20, func() { Parse(one, nil) })
	if n := testing.AllocsPerRun(20, func() { Parse(many, nil) }); n > base {
		t.Errorf("Parse of a missing-due with 1000 headers: %v allocations, with 1: %v", n, base)
	}
}

func TestParseDetails(t *testing.T) {
	// Details are sentences naming the header and the value, cut short.
	long := strings.Repeat("x", 10_000)
	tests := []struct {
		hs   []Header
		want string
	}{
		{[]Header{h("delay-after", "-5s")}, `delay-after "-5s" is negative`},
		{[]Header{h("delay-at", "soon")}, `delay-at "soon" is neither RFC 3339 with an offset nor Unix milliseconds`},
		{[]Header{h("delay-after", long)}, `delay-after "` + strings.Repeat("x", 64) + `"... is not a duration, days or milliseconds`},
		{[]Header{h("delay-after", "1s"), h("delay-target", "foo:bar")}, `delay-target "foo:bar": unknown transport prefix "foo" (want kafka: or nats:)`},
		{[]Header{h("delay-after", "1s"), h("delay-target", "nats:x")}, `delay-target "nats:x" names transport nats, which is not configured`},
		{[]Header{h("delay-after", "1s"), h("delay-target", "nats://orders.x")}, `delay-target "nats://orders.x": a URL, not a target: write kafka:TOPIC or nats:SUBJECT, without "//"`},
		{[]Header{h("delay-cancel", "maybe")}, `delay-cancel must be true or false, got "maybe"`},
		{[]Header{h("Delay_At", "1795000000000"), h("delay-target", "orders")}, `neither delay-at nor delay-after is set; header "Delay_At" is not read: the name is delay-at (in any case)`},
		{[]Header{h("app", "1"), h("X-Delay-After", "30s")}, `neither delay-at nor delay-after is set; header "X-Delay-After" is not read: the name is delay-after (in any case)`},
		{[]Header{h("delayCancel", "true"), h("delay-id", "o-1")}, `neither delay-at nor delay-after is set; header "delayCancel" is not read: the name is delay-cancel (in any case)`},
		{[]Header{h("x-delayed", "1")}, `neither delay-at nor delay-after is set`},
		{[]Header{h("delay-after", "1s"), h("X-Delay-Target", "orders")}, `delay-target is not set and the source has no default target; header "X-Delay-Target" is not read: the name is delay-target (in any case)`},
		{[]Header{h("delay-after", "1s"), h("delay_after", "2s"), h("Delay_Target", "orders")}, `delay-target is not set and the source has no default target; header "Delay_Target" is not read: the name is delay-target (in any case)`},
		{[]Header{h("delay-after", "1s"), h("delay_id", "o-1")}, `delay-target is not set and the source has no default target`},
		{[]Header{h("delay-at", "1795000000")}, `delay-at "1795000000" has 10 digits: Unix seconds (2026-11-18T11:06:40Z), not milliseconds; multiply by 1000`},
		{[]Header{h("delay-at", "1795000000000000")}, `delay-at "1795000000000000" read as Unix milliseconds lies after 9999-12-31; its 16 digits look like Unix microseconds: divide by 1000`},
		{[]Header{h("delay-at", "1795000000000000000")}, `delay-at "1795000000000000000" read as Unix milliseconds lies after 9999-12-31; its 19 digits look like Unix nanoseconds: divide by 1000000`},
		{[]Header{h("delay-at", "253402300800000")}, `delay-at "253402300800000" read as Unix milliseconds lies after 9999-12-31`},
	}
	for _, tt := range tests {
		got := Parse(kafkaMsg(tt.hs...), nil)
		if got.Detail != tt.want {
			t.Errorf("detail %q\n      want %q", got.Detail, tt.want)
		}
	}
}

func TestDeadLetter(t *testing.T) {
	m := kafkaMsg(h("delay-after", "1s"), h("delay-target", "nats:orders.x"), h("app", "1"), h("delay-error", "stale"))
	task := Parse(m, &Rules{DLQ: "delay.dlq", Transports: both})
	task.Attempts = 10
	orig := dump(task)
	got := DeadLetter(&task, CodePublishFailed, "publish to nats:orders.x failed 10 times: no responders")
	if dump(task) != orig {
		t.Fatal("DeadLetter modified its input")
	}
	want := task
	want.Kind = KindDeadLetter
	want.Transport = TransportKafka
	want.Target = "delay.dlq"
	want.Attempts = 0
	want.Code = CodePublishFailed
	want.Detail = "publish to nats:orders.x failed 10 times: no responders"
	want.Headers = []Header{
		h("app", "1"),
		h("delay-id", "order-1"),
		h("delay-origin", "kafka:delay/3@42"),
		h("delay-due", FormatDue(nowMs+1000)),
		h("delay-error", "publish-failed"),
		h("delay-error-detail", want.Detail),
	}
	if !equalTask(got, want) {
		t.Fatalf("got  %s\nwant %s", dump(got), dump(want))
	}

	// A task without delay-origin (e.g. built by hand) gets one.
	bare := Task{Kind: KindSchedule, ID: "x", Origin: "nats:S#1", DLQTransport: TransportNATS, DLQ: "dlq"}
	got = DeadLetter(&bare, CodePublishFailed, "d")
	if header(got.Headers, HeaderOrigin) != "nats:S#1" || got.Transport != TransportNATS || got.Target != "dlq" {
		t.Fatalf("bare: %s", dump(got))
	}
}

func TestParseDelay(t *testing.T) {
	tests := []struct {
		in   string
		want time.Duration
		err  bool
	}{
		{in: "365d", want: 365 * 24 * time.Hour},
		{in: "2d12h", want: 60 * time.Hour},
		{in: "90s", want: 90 * time.Second},
		{in: "1h30m", want: 90 * time.Minute},
		{in: "500us", want: 500 * time.Microsecond},
		{in: "1500", want: 1500 * time.Millisecond},
		{in: "0", want: 0},
		{in: "106751d", want: 106751 * 24 * time.Hour},
		{in: "106752d", err: true},
		{in: "106751d23h59m59s", err: true},
		{in: "9223372036854775807", err: true},
		{in: "99999999999999999999d", err: true},
		{in: "-1s", err: true},
		{in: "-1d", err: true},
		{in: "", err: true},
		{in: "d", err: true},
		{in: "1w", err: true},
		{in: "1d-1h", err: true},
		{in: "1d0", err: true},
		{in: "1d0s", want: 24 * time.Hour},
		// One leading "+" in every form, as Go durations take it.
		{in: "+90s", want: 90 * time.Second},
		{in: "+1500", want: 1500 * time.Millisecond},
		{in: "+3d", want: 3 * 24 * time.Hour},
		{in: "+2d12h", want: 60 * time.Hour},
		{in: "+", err: true},
		{in: "++1s", err: true},
		{in: "+-1s", err: true},
		{in: "+d", err: true},
		{in: "2d+1h", err: true},
	}
	for _, tt := range tests {
		got, err := ParseDelay(tt.in)
		if tt.err {
			if err == nil || !errors.Is(err, ErrBadDelay) {
				t.Errorf("ParseDelay(%q) = %v, %v; want an ErrBadDelay", tt.in, got, err)
			}
			continue
		}
		if err != nil || got != tt.want {
			t.Errorf("ParseDelay(%q) = %v, %v; want %v", tt.in, got, err, tt.want)
		}
	}
}

func TestFormatDelay(t *testing.T) {
	const day = 24 * time.Hour
	for _, tt := range []struct {
		in   time.Duration
		want string
	}{
		{0, "0s"},
		{1500 * time.Millisecond, "1.5s"},
		{23 * time.Hour, "23h0m0s"},
		{day, "1d"},
		{365 * day, "365d"},
		{2*day + 12*time.Hour, "2d12h0m0s"},
		{-3 * day, "-3d"},
		{day + time.Millisecond, "1d1ms"},
	} {
		got := FormatDelay(tt.in)
		if got != tt.want {
			t.Errorf("FormatDelay(%v) = %q, want %q", tt.in, got, tt.want)
		}
		if tt.in >= 0 {
			if back, err := ParseDelay(got); err != nil || back != tt.in {
				t.Errorf("ParseDelay(%q) = %v, %v; want %v", got, back, err, tt.in)
			}
		}
	}
	// The delay-too-long detail names max_delay as the configuration does.
	m := kafkaMsg(h("delay-after", "366d"), h("delay-target", "orders"))
	got := Parse(m, &Rules{MaxDelay: 365 * day})
	wantDeadLetter(t, got, CodeDelayTooLong)
	if !strings.Contains(got.Detail, "max_delay 365d ") {
		t.Fatalf("detail %q does not name max_delay 365d", got.Detail)
	}
}

func TestParseTargetFunc(t *testing.T) {
	tr, name, err := ParseTarget("nats:a.b", TransportKafka)
	if err != nil || tr != TransportNATS || name != "a.b" {
		t.Fatalf("got %v %q %v", tr, name, err)
	}
	if _, _, err := ParseTarget("a b", TransportKafka); !errors.Is(err, ErrBadTarget) {
		t.Fatalf("err %v, want ErrBadTarget", err)
	}
	if _, _, err := ParseTarget("x", 0); !errors.Is(err, ErrBadTarget) {
		t.Fatalf("unknown own transport: err %v", err)
	}
}

func TestFormatDue(t *testing.T) {
	for ms, want := range map[int64]string{
		0:                                  "1970-01-01T00:00:00.000Z",
		mustMs("2026-11-22T15:04:05.123Z"): "2026-11-22T15:04:05.123Z",
		MaxDue:                             "9999-12-31T23:59:59.999Z",
		1:                                  "1970-01-01T00:00:00.001Z",
	} {
		if got := FormatDue(ms); got != want {
			t.Errorf("FormatDue(%d) = %q, want %q", ms, got, want)
		}
	}
}

func TestCodesComplete(t *testing.T) {
	seen := map[Code]bool{}
	for _, c := range Codes {
		if seen[c] {
			t.Fatalf("duplicate code %s", c)
		}
		seen[c] = true
	}
	if len(Codes) != 9 {
		t.Fatalf("%d codes, CONTRACT §3 has 9", len(Codes))
	}
}

func wantDeadLetter(t *testing.T, got Task, code Code) {
	t.Helper()
	if got.Kind != KindDeadLetter || got.Code != code {
		t.Fatalf("got %v code %q (%s), want dead letter %q", got.Kind, got.Code, got.Detail, code)
	}
	if got.Detail == "" {
		t.Fatal("dead letter without detail")
	}
	if v := header(got.Headers, HeaderError); v != string(code) {
		t.Fatalf("delay-error %q, want %q", v, code)
	}
	if v := header(got.Headers, HeaderErrorDetail); v != got.Detail {
		t.Fatalf("delay-error-detail %q, want %q", v, got.Detail)
	}
	if v := header(got.Headers, HeaderOrigin); v != got.Origin || v == "" {
		t.Fatalf("delay-origin %q, want %q", v, got.Origin)
	}
}

// header returns the value of the only header named k, or a marker when
// there are none or several.
func header(hs []Header, k string) string {
	v, n := "", 0
	for _, h := range hs {
		if h.Key == k {
			v, n = string(h.Value), n+1
		}
	}
	if n != 1 {
		return fmt.Sprintf("<%d headers %q>", n, k)
	}
	return v
}

// equalTask compares tasks field by field, telling nil from empty slices.
func equalTask(a, b Task) bool { return dump(a) == dump(b) }

func dump(t Task) string {
	q := func(b []byte) string {
		if b == nil {
			return "nil"
		}
		return fmt.Sprintf("%q", b)
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "{%v id=%q src=%q origin=%q stamp=%d p=%d inc=%d off=%d due=%d to=%v:%q key=%s value=%s attempts=%d dlq=%v:%q code=%q detail=%q headers=",
		t.Kind, t.ID, t.Source, t.Origin, t.Stamp, t.Partition, t.Incarnation, t.Offset, t.Due, t.Transport, t.Target,
		q(t.Key), q(t.Value), t.Attempts, t.DLQTransport, t.DLQ, t.Code, t.Detail)
	if t.Headers == nil {
		sb.WriteString("nil")
	}
	for _, h := range t.Headers {
		fmt.Fprintf(&sb, "[%q=%s]", h.Key, q(h.Value))
	}
	sb.WriteString("}")
	return sb.String()
}

func TestAppendOrigin(t *testing.T) {
	for _, m := range []*Message{
		kafkaMsg(), natsMsg(),
		{Transport: TransportKafka, Source: "t", Partition: -2147483648, Offset: -9223372036854775808},
		{Transport: TransportNATS, Source: strings.Repeat("s", 300), Offset: 9223372036854775807},
	} {
		got := string(m.appendOrigin(nil))
		if got != m.Origin() || len(got) > originSize(m) {
			t.Errorf("appendOrigin %q, Origin %q, bound %d", got, m.Origin(), originSize(m))
		}
	}
}

// TestParseAllocs pins the hot path's allocation budget (see Parse).
func TestParseAllocs(t *testing.T) {
	m := kafkaMsg(h("traceparent", "x"), h("delay-after", "90s"), h("delay-target", "orders"))
	r := &Rules{DLQ: "d", MaxDelay: time.Hour, Allow: func(Transport, string) bool { return true }}
	if n := testing.AllocsPerRun(100, func() { Parse(m, r) }); n > 3 {
		t.Errorf("Parse of a schedule: %v allocations, want 3", n)
	}
	m = kafkaMsg(h("delay-after", "90s"), h("delay-cancel", "true"))
	if n := testing.AllocsPerRun(100, func() { Parse(m, r) }); n > 2 {
		t.Errorf("Parse of a cancel: %v allocations, want 2 (id and origin)", n)
	}
}

func TestParseTargetNATSUTF8(t *testing.T) {
	tests := []struct {
		target string
		ok     bool
	}{
		{"orders.créées", true},
		{"orders.\xff\xfe", false},
		{"orders.a\xc3", false}, // truncated sequence
		{"orders.plain", true},
	}
	for _, tc := range tests {
		_, _, err := ParseTarget("nats:"+tc.target, TransportKafka)
		if (err == nil) != tc.ok {
			t.Errorf("ParseTarget(nats:%q) = %v, want ok %v", tc.target, err, tc.ok)
		}
		m := &Message{Transport: TransportNATS, Source: "DELAY", Offset: 1, Time: time.Date(2026, 11, 22, 0, 0, 0, 0, time.UTC),
			Headers: []Header{{Key: "delay-after", Value: []byte("1s")}, {Key: "delay-target", Value: []byte(tc.target)}}}
		task := Parse(m, &Rules{DLQ: "dlq"})
		if got := task.Kind == KindSchedule; got != tc.ok {
			t.Errorf("Parse with target %q: kind %v code %q, want schedule %v", tc.target, task.Kind, task.Code, tc.ok)
		}
		if !tc.ok && task.Code != CodeBadTarget {
			t.Errorf("target %q: code %q, want bad-target", tc.target, task.Code)
		}
	}
}

// TestNATSHeaderName: a header name NATS cannot carry is percent-encoded
// (each byte it cannot carry, and '%'), as is a Kafka name with a '%' in
// it, so two Kafka names never merge; a NATS source's valid names are
// kept. natsNameGrowth, which too-large counts, is exactly how much longer
// that makes a name.
func TestNATSHeaderName(t *testing.T) {
	for _, tc := range []struct {
		in   string
		from Transport
		want string
	}{
		{"x-app", TransportKafka, "x-app"},
		{"50%", TransportKafka, "50%25"}, // valid, but kept it could be another name's encoding
		{"a%20b", TransportKafka, "a%2520b"},
		{"trace id", TransportKafka, "trace%20id"},
		{"a:b", TransportKafka, "a%3Ab"},
		{"x/100%", TransportKafka, "x%2F100%25"},
		{"é", TransportKafka, "%C3%A9"},
		{"", TransportKafka, ""},
		{"x-app", TransportNATS, "x-app"},
		{"50%", TransportNATS, "50%"}, // a NATS name already: delivered as it came
		{"a%20b", TransportNATS, "a%20b"},
	} {
		got := NATSHeaderName(tc.in, tc.from)
		if got != tc.want {
			t.Errorf("NATSHeaderName(%q, %v) = %q, want %q", tc.in, tc.from, got, tc.want)
		}
		if g := natsNameGrowth(tc.in, tc.from); g != len(got)-len(tc.in) {
			t.Errorf("natsNameGrowth(%q, %v) = %d, want %d", tc.in, tc.from, g, len(got)-len(tc.in))
		}
	}
}

func TestTaskDestination(t *testing.T) {
	for _, tc := range []struct {
		task Task
		want string
	}{
		{Task{Transport: TransportKafka, Target: "orders"}, "kafka:orders"},
		{Task{Transport: TransportNATS, Target: "orders.created"}, "nats:orders.created"},
	} {
		if got := tc.task.Destination(); got != tc.want {
			t.Errorf("Destination() = %q, want %q", got, tc.want)
		}
	}
}

// TestMisspelled: the header that looks like a control header but is not
// one, and the control header it looks like; none for control headers in
// any case, for other headers, and for names that only start alike.
func TestMisspelled(t *testing.T) {
	for _, tc := range []struct {
		headers   []Header
		key, name string
	}{
		{[]Header{h("delay_id", "o-1")}, "delay_id", "delay-id"},
		{[]Header{h("content-type", "x"), h("X-Delay-After", "1s")}, "X-Delay-After", "delay-after"},
		{[]Header{h("DelayTarget", "orders")}, "DelayTarget", "delay-target"},
		{[]Header{h("_delay.key", "k")}, "_delay.key", "delay-key"},
		{[]Header{h("delay cancel", "true")}, "delay cancel", "delay-cancel"},
		{[]Header{h("Delay-Id", "o-1"), h("DELAY-AFTER", "1s")}, "", ""},
		{[]Header{h("delayed", "1"), h("x-delay", "1"), h("delay-idx", "1"), h("xdelay-atx", "1")}, "", ""},
		{[]Header{h("", "1"), h("--", "1"), h("trace-id", "1")}, "", ""},
	} {
		key, name, ok := Misspelled(&Message{Headers: tc.headers})
		if key != tc.key || name != tc.name || ok != (tc.key != "") {
			t.Errorf("%v: %q %q %v, want %q %q", tc.headers, key, name, ok, tc.key, tc.name)
		}
	}
}
