package codec

import (
	"bytes"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode"
)

// FuzzParse feeds Parse arbitrary header names and values. Whatever comes
// in, Parse must not panic and must return a task the engine can store:
// a known kind, dead letters with a §3 code and their three headers,
// schedules with a due in range, a valid target and exactly the delivered
// header set of CONTRACT §2.
func FuzzParse(f *testing.F) {
	f.Add(uint8(1), "delay-after", "90s", "delay-target", "orders", "delay-id", "x", []byte("k"), false, int64(1795000000000), int64(0))
	f.Add(uint8(2), "DELAY-AT", "2026-11-22T15:04:05.123Z", "Nats-Msg-Id", "m", "delay-target", "kafka:o", []byte(nil), false, int64(0), int64(0))
	f.Add(uint8(1), "delay-after", "99999999999d", "delay-at", "1", "x", "y", []byte("k"), false, int64(-1), int64(3600_000))
	f.Add(uint8(1), "delay-cancel", "TRUE", "delay-id", "", "delay-key", "", []byte(""), true, int64(9e18), int64(1))
	f.Add(uint8(2), "delay-after", "2d12h", "delay-target", "nats:a.*", "delay-origin", "o", []byte("k"), false, int64(1e12), int64(0))
	f.Add(uint8(1), "delay-after", "1500", "delay-target", "foo:bar", "Delay-Cancel", "maybe", []byte("k"), true, int64(1e12), int64(1))
	// The other forms of CONTRACT §1: delay-at in Unix milliseconds, a Go
	// duration of several units, whole days, delay-key, a Kafka tombstone
	// without control headers (a cancel by key), and a look-alike name.
	f.Add(uint8(1), "delay-at", "1795000000000", "delay-key", "k2", "delay-target", "kafka:orders", []byte("k"), false, int64(1794999999000), int64(0))
	f.Add(uint8(2), "delay-after", "1h30m", "Nats-Msg-Id", "n1", "delay-target", "nats:a.b", []byte(nil), false, int64(1e12), int64(365*24*3600_000_000_000))
	f.Add(uint8(1), "delay-after", "3d", "delay-id", "tenant/42", "x", "y", []byte("k"), false, int64(1e12), int64(0))
	f.Add(uint8(1), "traceparent", "00-1", "x", "y", "z", "w", []byte("k"), true, int64(1e12), int64(0))
	f.Add(uint8(1), "Delay_At", "1795000000000", "X-Delay-After", "5s", "delay-target", "o", []byte("k"), false, int64(1e12), int64(0))
	f.Fuzz(func(t *testing.T, tr uint8, k1, v1, k2, v2, k3, v3 string, key []byte, tomb bool, ms, maxDelay int64) {
		m := &Message{
			Transport:   Transport(1 + tr%2),
			Source:      "src",
			Partition:   int32(ms),
			Incarnation: uint32(maxDelay),
			Offset:      ms,
			Key:         key,
			Value:       []byte(v3),
			Tombstone:   tomb,
			Headers:     []Header{h(k1, v1), h(k2, v2), h(k3, v3), h("delay-target", "fallback")},
			Time:        time.UnixMilli(ms),
		}
		// Odd rules as well: the fuzzer picks them from the same inputs.
		r := &Rules{
			DefaultTarget: v2,
			DLQ:           "dlq",
			MaxDelay:      time.Duration(maxDelay),
			MaxBytes:      int(maxDelay % 4096),
			Transports:    func(t Transport) bool { return tr&4 != 0 },
			Allow:         func(_ Transport, name string) bool { return !strings.Contains(name, "deny") },
		}
		if tr&8 != 0 {
			m.Headers = m.Headers[:3] // no fallback target: exercise the default
		}
		orig := slices.Clone(m.Headers)
		got := Parse(m, r)
		checkTask(t, m, r, got)
		if !slices.EqualFunc(orig, m.Headers, func(a, b Header) bool { return a.Key == b.Key && bytes.Equal(a.Value, b.Value) }) {
			t.Fatal("Parse changed the message headers")
		}
		// Whatever Parse returns must survive the store.
		var back Task
		if err := DecodeTask(AppendTask(nil, &got), &back); err != nil || !equalTask(back, got) {
			t.Fatalf("envelope round trip: %v\n%s\n%s", err, dump(got), dump(back))
		}
		// A look-alike is a header of the message that is not a control
		// header and reads as one once its separators are dropped and its
		// letters lower-cased.
		if key, name, ok := Misspelled(m); ok {
			if !slices.ContainsFunc(m.Headers, func(hd Header) bool { return hd.Key == key }) || classify(key).isControl() {
				t.Fatalf("Misspelled = %q, %q: not a non-control header of the message", key, name)
			}
			squeezed := strings.Map(func(r rune) rune {
				if strings.ContainsRune("-_. ", r) {
					return -1
				}
				return unicode.ToLower(r)
			}, key)
			if want := strings.ReplaceAll(name, "-", ""); squeezed != want && squeezed != "x"+want {
				t.Fatalf("Misspelled = %q, %q: reads as %q", key, name, squeezed)
			}
		}
	})
}

func checkTask(t *testing.T, m *Message, r *Rules, got Task) {
	t.Helper()
	if got.Origin != m.Origin() || got.Source != m.Source || got.Stamp != m.Time.UnixMilli() || got.Offset != m.Offset || got.Partition != m.Partition || got.Incarnation != m.Incarnation {
		t.Fatalf("position fields wrong: %s", dump(got))
	}
	switch got.Kind {
	case KindDeadLetter:
		if !slices.Contains(Codes, got.Code) || got.Code == CodePublishFailed {
			t.Fatalf("dead letter with code %q", got.Code)
		}
		if got.Detail == "" || got.Target != r.DLQ || got.Transport != m.Transport || got.ID != m.Origin() {
			t.Fatalf("bad dead letter: %s", dump(got))
		}
		for _, k := range []string{HeaderError, HeaderErrorDetail, HeaderOrigin} {
			if n := countFold(got.Headers, k); n != 1 {
				t.Fatalf("%d %s headers in %s", n, k, dump(got))
			}
		}
		if !bytes.Equal(got.Value, m.Value) || !bytes.Equal(got.Key, m.Key) {
			t.Fatal("dead letter changed key or value")
		}
	case KindCancel:
		if got.ID == "" || got.Headers != nil || got.Value != nil {
			t.Fatalf("bad cancel: %s", dump(got))
		}
	case KindSchedule:
		if got.ID == "" || got.Due < MinDue || got.Due > MaxDue || got.Code != "" {
			t.Fatalf("bad schedule: %s", dump(got))
		}
		if r.MaxDelay > 0 && got.Due-got.Stamp > r.MaxDelay.Milliseconds() {
			t.Fatalf("due beyond max delay: %s", dump(got))
		}
		tr, name, err := ParseTarget(targetString(got.Transport, got.Target), got.Transport)
		if err != nil || tr != got.Transport || name != got.Target {
			t.Fatalf("invalid target %v:%q: %v", got.Transport, got.Target, err)
		}
		n := len(got.Headers) - 3
		if n < 0 {
			t.Fatalf("too few headers: %s", dump(got))
		}
		for _, hd := range got.Headers[:n] {
			switch c := classify(hd.Key); {
			case c.isControl(), c == hdrOrigin, c == hdrDue:
				t.Fatalf("delivered source header %q", hd.Key)
			}
		}
		for i, k := range []string{HeaderID, HeaderOrigin, HeaderDue} {
			if got.Headers[n+i].Key != k {
				t.Fatalf("added header %d is %q, want %q", i, got.Headers[n+i].Key, k)
			}
		}
		if header(got.Headers, HeaderID) != got.ID || header(got.Headers, HeaderDue) != FormatDue(got.Due) {
			t.Fatalf("added headers disagree with the task: %s", dump(got))
		}
	default:
		t.Fatalf("kind %v", got.Kind)
	}
}

func targetString(t Transport, name string) string { return t.String() + ":" + name }

func countFold(hs []Header, k string) int {
	n := 0
	for _, h := range hs {
		if strings.EqualFold(h.Key, k) {
			n++
		}
	}
	return n
}

// FuzzDecodeTask feeds the envelope decoder garbage. It must never panic,
// and what it accepts must encode back to an envelope that decodes equal.
// With reseal the input is treated as a body and given a valid checksum,
// so the fuzzer explores the structural checks behind the CRC instead of
// bouncing off it.
func FuzzDecodeTask(f *testing.F) {
	for _, task := range []Task{
		sampleTask(),
		{Kind: KindCancel, ID: "x"},
		{Kind: KindCancel, ID: "y", Incarnation: 5},
		Parse(kafkaMsg(h("delay-at", "x")), nil),
	} {
		enc := AppendTask(nil, &task)
		f.Add(enc, false)
		f.Add(enc[:len(enc)-4], true)
	}
	f.Add([]byte{}, false)
	f.Add([]byte{1}, true)
	f.Add([]byte{2, 0, 0, 0, 0}, false)
	f.Fuzz(func(t *testing.T, b []byte, reseal bool) {
		if reseal {
			b = binary.BigEndian.AppendUint32(b[:len(b):len(b)], crc32.Checksum(b, castagnoli))
		}
		var got Task
		if err := DecodeTask(b, &got); err != nil {
			if !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrVersion) {
				t.Fatalf("error %v wraps neither ErrCorrupt nor ErrVersion", err)
			}
			return
		}
		enc := AppendTask(nil, &got)
		if !bytes.Equal(enc, b) {
			// One envelope per task: anything else accepted is corruption
			// that happened to pass.
			t.Fatalf("accepted envelope is not the task's encoding:\n%x\n%x", b, enc)
		}
		var again Task
		if err := DecodeTask(enc, &again); err != nil {
			t.Fatalf("re-encoded task does not decode: %v", err)
		}
		if !equalTask(got, again) {
			t.Fatalf("round trip differs:\n%s\n%s", dump(got), dump(again))
		}
	})
}

// FuzzParseDelay: the delay-after, delay-at and config grammars never
// panic and refuse with errors wrapping ErrBadDelay; an accepted delay is
// non-negative, reads the same in milliseconds as delay-after counts it
// (delayMs) and reads back from FormatDelay (what the config prints); an
// accepted delay-at in range reads back from FormatDue (what delay-due
// carries), and agrees with time.Parse where both take an RFC 3339 value.
// The seeds are the forms of CONTRACT §1.
func FuzzParseDelay(f *testing.F) {
	for _, s := range []string{"365d", "2d12h", "90s", "1h30m", "3d", "1500", "-1s", "99999999999d", "1d-1h", "", "+5s", "1.5h",
		"2026-11-22T15:04:05.123Z", "2026-11-22T16:00:00.123+02:00", "2026-11-22t15:04:05z", "2016-12-31T23:59:60Z",
		"2026-11-22T15:04:05.123456789-23:59", "2026-11-22T15:04:05+24:00", "2026-11-22T15:04:05,5Z", "1795000000000", "1795000000", "-1", "9999-12-31T23:59:59.999Z"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		d, err := ParseDelay(s)
		if err != nil && !errors.Is(err, ErrBadDelay) {
			t.Fatalf("ParseDelay(%q): error %v does not wrap ErrBadDelay", s, err)
		}
		if err == nil {
			if d < 0 {
				t.Fatalf("ParseDelay(%q) = %v", s, d)
			}
			if ms, err := delayMs(s); err != nil || ms != d.Milliseconds() {
				t.Fatalf("ParseDelay(%q) = %v but delayMs = %d, %v", s, d, ms, err)
			}
			if back, err := ParseDelay(FormatDelay(d)); err != nil || back != d {
				t.Fatalf("ParseDelay(%q) = %v, formats as %q, which parses to %v, %v", s, d, FormatDelay(d), back, err)
			}
		}
		ms, err := delayMs(s)
		if err != nil && !errors.Is(err, ErrBadDelay) {
			t.Fatalf("delayMs(%q): error %v does not wrap ErrBadDelay", s, err)
		}
		if err == nil && ms < 0 {
			t.Fatalf("delayMs(%q) = %v", s, ms)
		}
		at, err := atMs(s)
		if err != nil {
			if !errors.Is(err, ErrBadDelay) {
				t.Fatalf("atMs(%q): error %v does not wrap ErrBadDelay", s, err)
			}
			return
		}
		if at >= MinDue && at <= MaxDue {
			if back, err := atMs(FormatDue(at)); err != nil || back != at {
				t.Fatalf("atMs(%q) = %d, formats as %q, which reads as %d, %v", s, at, FormatDue(at), back, err)
			}
		}
		if tt, err := time.Parse(time.RFC3339, s); err == nil && !isInteger(s) && tt.UnixMilli() != at {
			t.Fatalf("atMs(%q) = %d, time.Parse says %d", s, at, tt.UnixMilli())
		}
	})
}

// BenchmarkParse is the ingest hot path: a Kafka message with a 1 KB value,
// two application headers and two control headers.
func BenchmarkParse(b *testing.B) {
	m := kafkaMsg(
		h("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
		h("content-type", "application/json"),
		h("delay-after", "90s"),
		h("delay-target", "orders"),
	)
	m.Value = bytes.Repeat([]byte("v"), 1024)
	// As the service's rules: the bridge's clock, the delay-source check.
	r := &Rules{DLQ: "delay.dlq", MaxDelay: 365 * 24 * time.Hour, MaxBytes: 1 << 20, Now: time.Now,
		DelaySource: func(t Transport, name string) bool { return t == TransportKafka && name == "delay" },
		Allow:       func(Transport, string) bool { return true }}
	b.ReportAllocs()
	for b.Loop() {
		if t := Parse(m, r); t.Kind != KindSchedule {
			b.Fatal(t.Detail)
		}
	}
}

func BenchmarkParseAt(b *testing.B) {
	m := kafkaMsg(h("delay-at", "2026-11-22T16:00:00.123+02:00"), h("delay-target", "orders"))
	b.ReportAllocs()
	for b.Loop() {
		if t := Parse(m, nil); t.Kind != KindSchedule {
			b.Fatal(t.Detail)
		}
	}
}

func BenchmarkParseDeadLetter(b *testing.B) {
	m := kafkaMsg(h("delay-after", "soon"), h("delay-target", "orders"))
	b.ReportAllocs()
	for b.Loop() {
		Parse(m, nil)
	}
}

// FuzzFastDelay: the allocation-free fast path of delay-after must agree
// with the general parser wherever it answers.
func FuzzFastDelay(f *testing.F) {
	for _, s := range []string{"90s", "1h30m", "500ms", "1999us", "3d", "2d12h", "1500", "1m5s", "1mss", "1.5h", "2562047h47m16s854ms", "2562047h47m16s854775807ns", "2562047h47m16s854775808ns", "106751d23h47m16s854ms"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if d, ok := fastDuration([]byte(s)); ok && s != "" {
			want, err := time.ParseDuration(s)
			if err != nil || d != want {
				t.Fatalf("fastDuration(%q) = %v; time.ParseDuration = %v, %v", s, d, want, err)
			}
		}
		if ms, ok := fastDelayMs([]byte(s)); ok {
			want, err := delayMs(s)
			if err != nil || ms != want {
				t.Fatalf("fastDelayMs(%q) = %v; delayMs = %v, %v", s, ms, want, err)
			}
		}
	})
}

// FuzzFormatDue: the hand-written formatter agrees with time's layout.
func FuzzFormatDue(f *testing.F) {
	for _, ms := range []int64{0, 1, MaxDue, nowMs, -1, MaxDue + 1, 951782400000} {
		f.Add(ms)
	}
	f.Fuzz(func(t *testing.T, ms int64) {
		want := time.UnixMilli(ms).UTC().Format(dueLayout)
		if got := FormatDue(ms); got != want {
			t.Fatalf("FormatDue(%d) = %q, want %q", ms, got, want)
		}
	})
}

// FuzzParseTarget: the string and byte forms agree, and an accepted target
// written with its explicit prefix resolves to itself.
func FuzzParseTarget(f *testing.F) {
	for _, s := range []string{"orders", "kafka:orders", "nats:a.b", "nats:a.*", "foo:bar", "..", "a..b", "nats:a:b", "", "Kafka:orders", "NATS:a.b", "kAfKa:x"} {
		f.Add(s, uint8(1))
	}
	f.Fuzz(func(t *testing.T, s string, own uint8) {
		tr, name, err := ParseTarget(s, Transport(own%3))
		btr, bname, berr := parseTarget([]byte(s), Transport(own%3))
		if (err == nil) != (berr == nil) || tr != btr || name != string(bname) {
			t.Fatalf("string and byte forms disagree on %q: %v %q %v / %v %q %v", s, tr, name, err, btr, bname, berr)
		}
		if err != nil {
			if !errors.Is(err, ErrBadTarget) {
				t.Fatalf("error %v does not wrap ErrBadTarget", err)
			}
			return
		}
		// targets.allow reads a pattern's prefix as ParseTarget does.
		if pt, rest, ok := CutTransportPrefix(s); ok && (pt != tr || rest != name) {
			t.Fatalf("%q resolved to %v:%q, but CutTransportPrefix gives %v:%q", s, tr, name, pt, rest)
		}
		tr2, name2, err := ParseTarget(targetString(tr, name), 0)
		if err != nil || tr2 != tr || name2 != name {
			t.Fatalf("%q resolved to %v:%q, which resolves to %v:%q (%v)", s, tr, name, tr2, name2, err)
		}
	})
}
