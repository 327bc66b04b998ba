package codec

import (
	"bytes"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"math"
	"math/rand/v2"
	"reflect"
	"strings"
	"testing"
)

// sampleTask is a schedule as Parse builds it, plus odd corners: nil and
// empty byte slices, a nil header value, extreme integers.
func sampleTask() Task {
	return Task{
		Kind: KindSchedule, ID: "job-9", Source: "delay", Origin: "kafka:delay/3@42",
		Stamp: nowMs, Partition: math.MaxInt32, Incarnation: math.MaxUint32, Offset: math.MaxInt64, Due: math.MinInt64,
		Transport: TransportNATS, Target: "orders.created",
		Key:   []byte{},
		Value: bytes.Repeat([]byte("v"), 1024),
		Headers: []Header{
			h("trace", "t1"),
			{Key: "null", Value: nil},
			{Key: "", Value: []byte{}},
			h("delay-due", "2026-11-22T15:05:35.123Z"),
		},
		Attempts: math.MaxUint32, DLQTransport: TransportKafka, DLQ: "delay.dlq",
		Code: CodePublishFailed, Detail: "détail",
	}
}

func TestEnvelopeRoundTrip(t *testing.T) {
	tasks := []Task{
		sampleTask(),
		{Kind: KindCancel},
		{Kind: KindDeadLetter, Headers: []Header{}},
		Parse(kafkaMsg(h("delay-after", "1s"), h("x", "y")), &Rules{DefaultTarget: "o", DLQ: "d"}),
		Parse(natsMsg(h("delay-after", "nope")), &Rules{DLQ: "d"}),
		Parse(tombstone(kafkaMsg(), "k"), nil),
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 500 {
		tasks = append(tasks, randomTask(rng))
	}
	for i, want := range tasks {
		b := AppendTask([]byte("prefix"), &want)
		if !bytes.HasPrefix(b, []byte("prefix")) {
			t.Fatalf("%d: AppendTask dropped dst", i)
		}
		var got Task
		if err := DecodeTask(b[len("prefix"):], &got); err != nil {
			t.Fatalf("%d: %v", i, err)
		}
		if !equalTask(got, want) || !reflect.DeepEqual(got, want) {
			t.Fatalf("%d:\ngot  %s\nwant %s", i, dump(got), dump(want))
		}
	}
}

func randomTask(rng *rand.Rand) Task {
	str := func() string {
		b := make([]byte, rng.IntN(20))
		for i := range b {
			b[i] = byte(rng.UintN(256))
		}
		return string(b)
	}
	bs := func() []byte {
		switch rng.IntN(4) {
		case 0:
			return nil
		case 1:
			return []byte{}
		}
		return []byte(str())
	}
	i64 := func() int64 { return int64(rng.Uint64()) >> rng.UintN(64) }
	t := Task{
		Kind: Kind(1 + rng.IntN(3)), ID: str(), Source: str(), Origin: str(),
		Stamp: i64(), Partition: int32(i64()), Offset: i64(), Due: i64(),
		Incarnation: uint32(i64()) >> rng.UintN(33), // 0 half the time or so
		Transport:   Transport(rng.IntN(3)), Target: str(), Key: bs(), Value: bs(),
		Attempts: rng.Uint32(), DLQTransport: Transport(rng.IntN(3)), DLQ: str(),
		Code: Code(str()), Detail: str(),
	}
	if n := rng.IntN(6); n > 0 {
		t.Headers = make([]Header, n-1)
		for i := range t.Headers {
			t.Headers[i] = Header{Key: str(), Value: bs()}
		}
	}
	return t
}

// TestEnvelopeCoversTask fails when a field is added to Task without being
// added to the envelope (and to this count).
func TestEnvelopeCoversTask(t *testing.T) {
	if n := reflect.TypeFor[Task]().NumField(); n != 19 {
		t.Fatalf("Task has %d fields; the envelope encodes 19: update AppendTask, DecodeTask and this test", n)
	}
	if n := reflect.TypeFor[Header]().NumField(); n != 2 {
		t.Fatalf("Header has %d fields; the envelope encodes 2", n)
	}
}

func TestDecodeTaskErrors(t *testing.T) {
	task := sampleTask()
	good := AppendTask(nil, &task)
	reseal := func(b []byte) []byte {
		body := b[:len(b)-4]
		return binary.BigEndian.AppendUint32(body[:len(body):len(body)], crc32.Checksum(body, castagnoli))
	}
	// patch returns good with the body edited and a valid checksum, to
	// reach the structural checks behind the CRC.
	patch := func(f func(body []byte) []byte) []byte {
		body := f(append([]byte(nil), good[:len(good)-4]...))
		return reseal(append(body, 0, 0, 0, 0))
	}
	tests := []struct {
		name string
		b    []byte
		want error
	}{
		{"nil", nil, ErrCorrupt},
		{"version only", []byte{1}, ErrCorrupt},
		{"short", []byte{1, 0, 0, 0}, ErrCorrupt},
		{"version 0", append([]byte{0}, good[1:]...), ErrVersion},
		{"version 3", append([]byte{3}, good[1:]...), ErrVersion},
		{"version 2 with incarnation 0", reseal(append([]byte{2, byte(KindSchedule), 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, 0, 0, 0, 0)), ErrCorrupt},
		{"incarnation overflow", reseal(append(binary.AppendUvarint([]byte{2, byte(KindSchedule), 1, 1, 0, 0, 0, 0, 0}, math.MaxUint32+1), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)), ErrCorrupt},
		{"trailing garbage", append(append([]byte(nil), good...), 0), ErrCorrupt},
		{"trailing garbage resealed", patch(func(b []byte) []byte { return append(b, 0) }), ErrCorrupt},
		{"bad checksum", append(append([]byte(nil), good[:len(good)-1]...), good[len(good)-1]^1), ErrCorrupt},
		{"kind 0", patch(func(b []byte) []byte { b[1] = 0; return b }), ErrCorrupt},
		{"kind 4", patch(func(b []byte) []byte { b[1] = 4; return b }), ErrCorrupt},
		{"transport 3", patch(func(b []byte) []byte { b[2] = 3; return b }), ErrCorrupt},
		{"dlq transport 9", patch(func(b []byte) []byte { b[3] = 9; return b }), ErrCorrupt},
		{"attempts overflow", patch(func(b []byte) []byte {
			return append(binary.AppendUvarint(b[:4:4], math.MaxUint32+1), b[4+5:]...)
		}), ErrCorrupt},
		{"non-minimal varint", patch(func(b []byte) []byte {
			return append(append(b[:4:4], b[4]|0x80, 0), b[5:]...)
		}), ErrCorrupt},
		{"unterminated varint", reseal(append([]byte{1, 1, 1, 1, 0x80, 0x80, 0x80}, 0, 0, 0, 0)), ErrCorrupt},
		{"body cut", reseal(append(append([]byte(nil), good[:len(good)/2]...), 0, 0, 0, 0)), ErrCorrupt},
		{"huge string length", reseal(buildBody(func(b []byte) []byte { return binary.AppendUvarint(b, math.MaxUint64) })), ErrCorrupt},
		{"huge header count", reseal(buildBody(func(b []byte) []byte {
			for range 7 {
				b = append(b, 0)
			}
			b = append(b, 0, 0) // nil key, nil value
			return binary.AppendUvarint(b, 1<<40)
		})), ErrCorrupt},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := sampleTask()
			got := before
			err := DecodeTask(tt.b, &got)
			if !errors.Is(err, tt.want) {
				t.Fatalf("err %v, want %v", err, tt.want)
			}
			if !strings.HasPrefix(err.Error(), "codec: ") {
				t.Fatalf("error %q lacks context", err)
			}
			if !equalTask(got, before) {
				t.Fatal("failed decode changed the task")
			}
		})
	}
}

// buildBody is a v1 body with zeroed fixed fields, then tail; a 4-byte
// checksum placeholder is appended.
func buildBody(tail func([]byte) []byte) []byte {
	b := []byte{1, byte(KindSchedule), 1, 1, 0, 0, 0, 0, 0}
	return append(tail(b), 0, 0, 0, 0)
}

// TestDecodeTaskEveryTruncation and ...EveryBitFlip: a torn write or a
// rotten bit anywhere is refused, never decoded into a different task.
func TestDecodeTaskEveryTruncation(t *testing.T) {
	task := sampleTask()
	good := AppendTask(nil, &task)
	for n := range len(good) {
		var got Task
		if err := DecodeTask(good[:n], &got); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("truncated to %d: err %v", n, err)
		}
	}
}

func TestDecodeTaskEveryBitFlip(t *testing.T) {
	task := sampleTask()
	task.Value = []byte("short value") // keep the loop small
	good := AppendTask(nil, &task)
	for i := range len(good) * 8 {
		b := append([]byte(nil), good...)
		b[i/8] ^= 1 << (i % 8)
		var got Task
		err := DecodeTask(b, &got)
		want := ErrCorrupt
		if i/8 == 0 {
			want = ErrVersion
		}
		if !errors.Is(err, want) {
			t.Fatalf("bit %d flipped: err %v, want %v", i, err, want)
		}
	}
}

// TestDecodeTaskCopies: the decoded task must survive reuse of the input
// buffer (Pebble values live only until the iterator moves).
func TestDecodeTaskCopies(t *testing.T) {
	task := sampleTask()
	b := AppendTask(nil, &task)
	var got Task
	if err := DecodeTask(b, &got); err != nil {
		t.Fatal(err)
	}
	clear(b)
	if !equalTask(got, task) {
		t.Fatalf("decoded task aliased its input:\n%s", dump(got))
	}
	// Appending to a decoded slice must not overwrite its neighbours in the
	// shared arena.
	got.Headers[0].Value = append(got.Headers[0].Value, "XXXX"...)
	if string(got.Headers[2].Value) != "" || string(got.Headers[3].Value) != "2026-11-22T15:05:35.123Z" {
		t.Fatalf("append bled into the next field: %s", dump(got))
	}
}

func TestAppendTaskGrowsOnce(t *testing.T) {
	task := sampleTask()
	allocs := testing.AllocsPerRun(100, func() { AppendTask(nil, &task) })
	if allocs > 1 {
		t.Fatalf("AppendTask(nil) made %v allocations, want 1", allocs)
	}
	buf := make([]byte, 0, 4096)
	allocs = testing.AllocsPerRun(100, func() { AppendTask(buf[:0], &task) })
	if allocs != 0 {
		t.Fatalf("AppendTask into a large enough buffer made %v allocations", allocs)
	}
}

func benchTask() Task {
	m := kafkaMsg(h("delay-after", "90s"), h("delay-target", "orders"), h("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"))
	m.Value = bytes.Repeat([]byte("v"), 1024)
	t := Parse(m, &Rules{DLQ: "delay.dlq"})
	// Keep the three added headers (delay-id, delay-origin, delay-due), a
	// typical delivered set, and drop the traceparent.
	t.Headers = t.Headers[1:]
	return t
}

func BenchmarkAppendTask(b *testing.B) {
	t := benchTask()
	buf := make([]byte, 0, 2048)
	b.ReportAllocs()
	b.SetBytes(int64(len(AppendTask(nil, &t))))
	for b.Loop() {
		buf = AppendTask(buf[:0], &t)
	}
}

func BenchmarkDecodeTask(b *testing.B) {
	t := benchTask()
	enc := AppendTask(nil, &t)
	var got Task
	b.ReportAllocs()
	b.SetBytes(int64(len(enc)))
	for b.Loop() {
		if err := DecodeTask(enc, &got); err != nil {
			b.Fatal(err)
		}
	}
}

// TestAppendTaskManyIntoOneBuffer: appending envelope after envelope to one
// buffer grows it geometrically, not by exactly what each needs (which
// would copy the whole buffer on every append).
func TestAppendTaskManyIntoOneBuffer(t *testing.T) {
	task := benchTask()
	var buf []byte
	grows := 0
	for range 1000 {
		before := cap(buf)
		buf = AppendTask(buf, &task)
		if cap(buf) != before {
			grows++
		}
	}
	if grows > 20 {
		t.Fatalf("1000 appends grew the buffer %d times, want doubling growth (<= 20; exact-size growth would be 1000)", grows)
	}
}

// TestEnvelopeVersionByIncarnation: a task of a source partition's first
// log (incarnation 0) is written as version 1, byte for byte what releases
// before incarnations wrote and can read; only a later incarnation needs
// version 2.
func TestEnvelopeVersionByIncarnation(t *testing.T) {
	tests := []struct {
		inc  uint32
		want byte
	}{
		{0, EnvelopeVersion},
		{1, EnvelopeVersion2},
		{math.MaxUint32, EnvelopeVersion2},
	}
	for _, tt := range tests {
		task := sampleTask()
		task.Incarnation = tt.inc
		b := AppendTask(nil, &task)
		if b[0] != tt.want {
			t.Fatalf("incarnation %d: version %d, want %d", tt.inc, b[0], tt.want)
		}
		var got Task
		got.Incarnation = 7 // overwritten, also by a version 1 envelope
		if err := DecodeTask(b, &got); err != nil {
			t.Fatalf("incarnation %d: %v", tt.inc, err)
		}
		if got.Incarnation != tt.inc || !equalTask(got, task) {
			t.Fatalf("incarnation %d: got %s", tt.inc, dump(got))
		}
	}
	// Version 1 as releases before incarnations wrote it: without the
	// incarnation field, the same bytes as a version 2 envelope minus it.
	task := sampleTask()
	task.Incarnation = 0
	v1 := AppendTask(nil, &task)
	task.Incarnation = 1
	v2 := AppendTask(nil, &task)
	if len(v2) != len(v1)+1 {
		t.Fatalf("version 2 is %d bytes longer than version 1, want 1", len(v2)-len(v1))
	}
}
