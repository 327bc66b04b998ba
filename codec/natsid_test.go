package codec

import (
	"net/url"
	"strings"
	"testing"
	"time"
)

// TestNATSHeaderID: a Kafka id that would not arrive on NATS as only it
// can (white space at either end, CR or LF anywhere: nats.go alters
// those; a '%': it would read as an encoding) is percent-encoded; any
// other is kept, as is a NATS source's id but one percent-decoded into
// what nats.go alters (white space at an end, CR or LF); a '%' alone in
// a NATS source's id is kept. The encoding decodes back
// to the id with a URL path decoder and a form decoder alike, and
// natsIDGrowth is what it adds, with the marker header.
func TestNATSHeaderID(t *testing.T) {
	for _, tc := range []struct {
		in   string
		from Transport
		want string
		enc  bool
	}{
		{"job-7", TransportKafka, "job-7", false},
		{"a b", TransportKafka, "a b", false},   // inner space: nats.go keeps it
		{"a\tb", TransportKafka, "a\tb", false}, // inner tab too
		{"a+b", TransportKafka, "a+b", false},
		{"", TransportKafka, "", false},
		{"job-7 ", TransportKafka, "job-7%20", true},
		{" job-7", TransportKafka, "%20job-7", true},
		{"job-7\t", TransportKafka, "job-7%09", true},
		{"a\nb", TransportKafka, "a%0Ab", true},
		{"a\r\nb", TransportKafka, "a%0D%0Ab", true},
		{"50%", TransportKafka, "50%25", true},
		{"job-7%20", TransportKafka, "job-7%2520", true}, // not "job-7 "'s form
		{"50% ", TransportKafka, "50%25%20", true},
		{"a+b ", TransportKafka, "a%2Bb%20", true},
		{"a b\n", TransportKafka, "a%20b%0A", true},
		{"x\x00\x7f\n", TransportKafka, "x%00%7F%0A", true},
		{"50%", TransportNATS, "50%", false}, // a NATS header value already
		{"order-1", TransportNATS, "order-1", false},
		// Decoded from a NATS source's delay-id (delayID): nats.go would
		// alter it as it would a Kafka one; its '%' then encoded too.
		{"job-7 ", TransportNATS, "job-7%20", true},
		{"a\nb", TransportNATS, "a%0Ab", true},
		{"50% ", TransportNATS, "50%25%20", true},
	} {
		got, enc := NATSHeaderID([]byte(tc.in), tc.from)
		if string(got) != tc.want || enc != tc.enc {
			t.Errorf("NATSHeaderID(%q, %v) = %q, %v; want %q, %v", tc.in, tc.from, got, enc, tc.want, tc.enc)
			continue
		}
		growth := 0
		if enc {
			if back, err := url.PathUnescape(string(got)); err != nil || back != tc.in {
				t.Errorf("NATSHeaderID(%q) = %q: URL path decoding gives %q, %v", tc.in, got, back, err)
			}
			if back, err := url.QueryUnescape(string(got)); err != nil || back != tc.in {
				t.Errorf("NATSHeaderID(%q) = %q: form decoding gives %q, %v", tc.in, got, back, err)
			}
			growth = len(got) - len(tc.in) + len(HeaderIDEncoding) + len(IDEncodingPercent) + minHeaderFraming
		} else if strings.Contains(string(got), "%") && tc.from == TransportKafka {
			t.Errorf("NATSHeaderID(%q) = %q unmarked with a %%: it reads as an encoding", tc.in, got)
		}
		if g := natsIDGrowth(tc.in, tc.from); g != growth {
			t.Errorf("natsIDGrowth(%q) = %d, want %d", tc.in, g, growth)
		}
	}
}

// TestNATSHeaderIDInjective: no two Kafka ids give one delay-id value on
// NATS (the marker header aside: consumers dedup on the value), over ids
// built from the bytes that matter.
func TestNATSHeaderIDInjective(t *testing.T) {
	alphabet := []byte{'a', ' ', '%', '2', '0', '\n', '+', '\t'}
	seen := map[string]string{}
	var walk func(prefix []byte)
	walk = func(prefix []byte) {
		if len(prefix) > 0 {
			got, _ := NATSHeaderID(prefix, TransportKafka)
			if other, ok := seen[string(got)]; ok {
				t.Fatalf("ids %q and %q both arrive as delay-id %q", other, prefix, got)
			}
			seen[string(got)] = string(prefix)
		}
		if len(prefix) == 4 {
			return
		}
		for _, c := range alphabet {
			walk(append(prefix[:len(prefix):len(prefix)], c))
		}
	}
	walk(nil)
}

// TestParseNATSTargetIDEncoded: a Kafka key that nats.go would trim,
// delivered to a NATS target, arrives encoded with the marker, while the
// task's id (replace, cancel, the admin API) stays the key itself; on a
// Kafka target nothing changes. A publisher's delay-id-encoding header is
// never delivered.
func TestParseNATSTargetIDEncoded(t *testing.T) {
	for _, tc := range []struct {
		key, target, wantID, wantEnc string
	}{
		{"job-7 ", "nats:orders.x", "job-7%20", IDEncodingPercent},
		{"job-7\n", "nats:orders.x", "job-7%0A", IDEncodingPercent},
		{"job-7", "nats:orders.x", "job-7", ""},
		{"job-7 ", "orders", "job-7 ", ""},
	} {
		m := &Message{
			Transport: TransportKafka, Source: "delay", Key: []byte(tc.key), Time: time.Unix(1, 0),
			Headers: []Header{
				{Key: "delay-after", Value: []byte("1s")},
				{Key: "delay-target", Value: []byte(tc.target)},
				{Key: "Delay-Id-Encoding", Value: []byte("forged")},
			},
		}
		task := Parse(m, &Rules{DLQ: "dlq", Transports: func(Transport) bool { return true }})
		if task.Kind != KindSchedule {
			t.Fatalf("key %q to %s: kind %v %s %s", tc.key, tc.target, task.Kind, task.Code, task.Detail)
		}
		if task.ID != tc.key {
			t.Errorf("key %q: task id %q, want the key", tc.key, task.ID)
		}
		var id, enc []string
		for _, h := range task.Headers {
			switch strings.ToLower(h.Key) {
			case HeaderID:
				id = append(id, string(h.Value))
			case HeaderIDEncoding:
				enc = append(enc, string(h.Value))
			}
		}
		if len(id) != 1 || id[0] != tc.wantID {
			t.Errorf("key %q to %s: delay-id %q, want %q", tc.key, tc.target, id, tc.wantID)
		}
		if want := []string{tc.wantEnc}; tc.wantEnc == "" && len(enc) != 0 || tc.wantEnc != "" && (len(enc) != 1 || enc[0] != want[0]) {
			t.Errorf("key %q to %s: delay-id-encoding %q, want %q", tc.key, tc.target, enc, tc.wantEnc)
		}
	}
}

// TestParseNATSHeaderBlock: a schedule for a NATS target whose header
// block as delivered would go over JetStream's 64 KiB is too-large at
// ingest (before, it failed at every publish, and then was a
// publish-failed dead letter); the same message for a Kafka target, which
// has no such limit, is scheduled. natsHeaderBlock bounds the block the
// sink writes from below nowhere: TestSinkHeaderBlockBound (bridge/nats)
// delivers the largest one Parse takes to a real server.
func TestParseNATSHeaderBlock(t *testing.T) {
	msg := func(target string, n int) *Message {
		return &Message{
			Transport: TransportKafka, Source: "delay", Key: []byte("k"), Time: time.Unix(1, 0),
			Headers: []Header{
				{Key: "delay-after", Value: []byte("1s")},
				{Key: "delay-target", Value: []byte(target)},
				{Key: "big", Value: []byte(strings.Repeat("h", n))},
			},
		}
	}
	rules := &Rules{DLQ: "dlq", Transports: func(Transport) bool { return true }}
	for _, tc := range []struct {
		target string
		n      int
		code   Code
	}{
		{"nats:orders.x", 1000, ""},
		{"nats:orders.x", 65400, CodeTooLarge},
		{"nats:orders.x", 70000, CodeTooLarge},
		{"orders", 70000, ""},
	} {
		task := Parse(msg(tc.target, tc.n), rules)
		switch {
		case tc.code == "" && task.Kind != KindSchedule:
			t.Errorf("%d bytes of headers to %s: %v %s %s, want a schedule", tc.n, tc.target, task.Kind, task.Code, task.Detail)
		case tc.code != "" && task.Code != tc.code:
			t.Errorf("%d bytes of headers to %s: %v %q, want %s", tc.n, tc.target, task.Kind, task.Code, tc.code)
		case tc.code != "" && !strings.Contains(task.Detail, "exceeds JetStream's limit of 65535"):
			t.Errorf("detail %q does not say why", task.Detail)
		}
	}
}
