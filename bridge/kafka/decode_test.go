package kafka

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"slices"
	"testing"
	"time"

	"github.com/segmentio/kafka-go/protocol"
	fetchAPI "github.com/segmentio/kafka-go/protocol/fetch"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/delaybridge/delaybridge/codec"
)

// wireBatch encodes one v2 record batch as a broker sends it in a fetch
// response and reads it back with kafka-go, so decodeRecords sees exactly
// what a fetch would give it.
func wireBatch(t *testing.T, base int64, attrs int16, firstTS, maxTS int64, lastDelta int32, recs []kmsg.Record) protocol.RecordReader {
	t.Helper()
	return readRecordSet(t, encodeBatch(base, attrs, firstTS, maxTS, lastDelta, recs))
}

// encodeBatch is one v2 record batch as a broker stores and sends it.
func encodeBatch(base int64, attrs int16, firstTS, maxTS int64, lastDelta int32, recs []kmsg.Record) []byte {
	return encodeProducerBatch(base, -1, attrs, firstTS, maxTS, lastDelta, recs)
}

// Batch attributes of transactions.
const (
	attrTransactional = 0x10
	attrControl       = 0x20
)

// txnBatch is a transactional batch of producer pid at base.
func txnBatch(base, pid int64, recs ...kmsg.Record) []byte {
	return encodeProducerBatch(base, pid, attrTransactional, 1, 1, int32(len(recs)-1), recs)
}

// txnMarker is producer pid's commit or abort marker at base.
func txnMarker(base, pid int64, commit bool) []byte {
	typ := byte(controlAbort)
	if commit {
		typ = 1
	}
	return encodeProducerBatch(base, pid, attrTransactional|attrControl, 1, 1, 0,
		[]kmsg.Record{{Key: []byte{0, 0, 0, typ}, Value: []byte{0, 0, 0, 0, 0, 0}}})
}

// encodeProducerBatch is encodeBatch by producer pid (-1: none).
func encodeProducerBatch(base, pid int64, attrs int16, firstTS, maxTS int64, lastDelta int32, recs []kmsg.Record) []byte {
	var body []byte
	for i, r := range recs {
		if r.OffsetDelta == 0 {
			r.OffsetDelta = int32(i)
		}
		r.Length = int32(len(r.AppendTo(nil)) - 1)
		body = r.AppendTo(body)
	}
	b := kmsg.RecordBatch{
		FirstOffset: base, Magic: 2, Attributes: attrs, LastOffsetDelta: lastDelta,
		FirstTimestamp: firstTS, MaxTimestamp: maxTS, ProducerID: pid, ProducerEpoch: -1, FirstSequence: -1,
		NumRecords: int32(len(recs)), Records: body,
	}
	raw := b.AppendTo(nil)
	binary.BigEndian.PutUint32(raw[8:12], uint32(len(raw)-12))                                          // batch length
	binary.BigEndian.PutUint32(raw[17:21], crc32.Checksum(raw[21:], crc32.MakeTable(crc32.Castagnoli))) // crc
	return raw
}

// readRecordSet reads the batches of a fetch response's record set with
// kafka-go, as the source does.
func readRecordSet(t *testing.T, batches []byte) protocol.RecordReader {
	t.Helper()
	set := binary.BigEndian.AppendUint32(nil, uint32(len(batches)))
	var rs protocol.RecordSet
	if _, err := rs.ReadFrom(bytes.NewReader(append(set, batches...))); err != nil {
		t.Fatalf("read record set: %v", err)
	}
	return rs.Records
}

func delayRecord(after string) kmsg.Record {
	return kmsg.Record{Key: []byte("k"), Value: []byte("v"),
		Headers: []kmsg.Header{{Key: "delay-after", Value: []byte(after)}, {Key: "delay-target", Value: []byte("out")}}}
}

func TestDecodeRecordsEdgeBatches(t *testing.T) {
	fetchedAt := time.Date(2026, 11, 22, 12, 0, 0, 0, time.UTC)
	ts := fetchedAt.Add(-time.Hour).UnixMilli()
	for _, c := range []struct {
		name       string
		base       int64
		attrs      int16
		firstTS    int64
		lastDelta  int32
		recs       []kmsg.Record
		from       int64
		wantItems  int
		wantNext   int64
		wantTime   time.Time // of the first item
		wantLAT    bool
		wantNoTime int
	}{
		// Compaction keeps an empty batch for an idempotent producer;
		// kafka-go drops its last offset, so the position steps past
		// what the batch surely covers instead of fetching it forever.
		{name: "empty batch at the fetch offset", base: 10, lastDelta: 4, from: 10, wantNext: 11},
		{name: "empty batch covering the fetch offset", base: 10, lastDelta: 4, from: 12, wantNext: 13},
		// Compaction removed a batch's last records and kept its last
		// offset: fetched at the offset after its last record, it holds
		// nothing from there, and the position steps past that offset.
		{name: "tail-compacted batch covering the fetch offset", base: 0, firstTS: ts, lastDelta: 9, recs: sixRecords(),
			from: 6, wantNext: 7},
		{name: "tail-compacted batch read from before its end", base: 0, firstTS: ts, lastDelta: 9, recs: sixRecords(),
			from: 3, wantItems: 3, wantNext: 6, wantTime: time.UnixMilli(ts)},
		{name: "plain record", base: 5, firstTS: ts, recs: []kmsg.Record{delayRecord("1m")}, from: 5,
			wantItems: 1, wantNext: 6, wantTime: time.UnixMilli(ts)},
		// No timestamp (-1, an old message format): the fetch time, not 1969.
		{name: "record without timestamp", base: 0, firstTS: -1, recs: []kmsg.Record{delayRecord("1h")}, from: 0,
			wantItems: 1, wantNext: 1, wantTime: fetchedAt, wantNoTime: 1},
		// LogAppendTime: noted so the source can warn; the record keeps
		// the producer time, the only one kafka-go reports.
		{name: "log append time", base: 0, attrs: attrLogAppendTime, firstTS: ts, recs: []kmsg.Record{delayRecord("1m")}, from: 0,
			wantItems: 1, wantNext: 1, wantTime: time.UnixMilli(ts), wantLAT: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			rr := wireBatch(t, c.base, c.attrs, c.firstTS, c.firstTS, c.lastDelta, c.recs)
			var notes decodeNotes
			items, next, err := decodeRecords(rr, "delay", 0, c.from, &codec.Rules{}, nil, nil, fetchedAt, &notes)
			if err != nil {
				t.Fatal(err)
			}
			if len(items) != c.wantItems || next != c.wantNext {
				t.Fatalf("%d items, next %d; want %d, %d", len(items), next, c.wantItems, c.wantNext)
			}
			if c.wantItems > 0 && !items[0].Msg.Time.Equal(c.wantTime) {
				t.Fatalf("time %v, want %v", items[0].Msg.Time, c.wantTime)
			}
			if notes.logAppendTime != c.wantLAT || notes.noTimestamp != c.wantNoTime {
				t.Fatalf("notes %+v", notes)
			}
		})
	}
}

// sixRecords are records at offset deltas 0..5.
func sixRecords() []kmsg.Record {
	recs := make([]kmsg.Record, 6)
	for i := range recs {
		recs[i] = delayRecord("1m")
		recs[i].OffsetDelta = int32(i)
	}
	return recs
}

// A fetch at the offset after a tail-compacted batch's last record returns
// that batch again, then as much of the next batch as fits in the fetch
// size, which kafka-go drops when it is cut short. The position must still
// move, or the partition is fetched at the same offset for good; stepping
// one offset per fetch reaches the next batch, which then comes first and
// whole.
func TestDecodeTailCompactedBatchBeforeATruncatedOne(t *testing.T) {
	first := encodeBatch(0, 0, 1, 1, 9, sixRecords()) // offsets 0..5 kept, 6..9 compacted away
	big := delayRecord("1m")
	big.Value = make([]byte, 1<<20)
	second := encodeBatch(10, 0, 1, 1, 0, []kmsg.Record{big})
	for _, cut := range []bool{false, true} {
		t.Run(fmt.Sprintf("next batch cut=%v", cut), func(t *testing.T) {
			offset := int64(6)
			for fetches := 1; ; fetches++ {
				set := append(slices.Clone(first), second...)
				if offset >= 10 {
					set = slices.Clone(second) // the broker starts at the batch holding the offset
				} else if cut {
					set = set[:len(first)+len(second)/2] // what a smaller fetch size returns
				}
				items, next, err := decodeRecords(readRecordSet(t, set), "delay", 0, offset, &codec.Rules{}, nil, nil, time.Now(), nil)
				if err != nil {
					t.Fatal(err)
				}
				if next <= offset {
					t.Fatalf("fetch %d at %d: %d items, next %d: no progress", fetches, offset, len(items), next)
				}
				if len(items) > 0 {
					if len(items) != 1 || items[0].Msg.Offset != 10 || len(items[0].Msg.Value) != 1<<20 {
						t.Fatalf("fetch %d at %d: %d items, first at %d", fetches, offset, len(items), items[0].Msg.Offset)
					}
					if next != 11 {
						t.Fatalf("next %d after the big record, want 11", next)
					}
					return
				}
				if fetches > 10 {
					t.Fatalf("no record after %d fetches", fetches)
				}
				offset = next
			}
		})
	}
}

// A record without a timestamp is delayed from when it was read, not
// from 1970 (which would fire it at once).
func TestNoTimestampDelayedFromFetch(t *testing.T) {
	fetchedAt := time.Now()
	rr := wireBatch(t, 0, 0, -1, -1, 0, []kmsg.Record{delayRecord("1h")})
	items, _, err := decodeRecords(rr, "delay", 0, 0, &codec.Rules{MaxDelay: 24 * time.Hour}, nil, nil, fetchedAt, nil)
	if err != nil || len(items) != 1 {
		t.Fatalf("decode: %v, %d items", err, len(items))
	}
	task := codec.Parse(&items[0].Msg, items[0].Rules)
	if want := fetchedAt.Add(time.Hour).UnixMilli(); task.Kind != codec.KindSchedule || task.Due != want {
		t.Fatalf("%v due %s, want a schedule due %s", task.Kind, codec.FormatDue(task.Due), codec.FormatDue(want))
	}
}

// TestDecodeTransactions filters like a read_committed Java consumer: a
// batch of a producer whose transaction the broker lists as aborted is
// dropped until that producer's abort marker, including when the fetch
// starts at the marker (the aborted batch read by an earlier fetch).
func TestDecodeTransactions(t *testing.T) {
	rec := func(v string) kmsg.Record { r := delayRecord("1m"); r.Value = []byte(v); return r }
	abortedAt := func(pid, first int64) []fetchAPI.ResponseTransaction {
		return []fetchAPI.ResponseTransaction{{ProducerID: pid, FirstOffset: first}}
	}
	for _, c := range []struct {
		name     string
		set      []byte
		aborted  []fetchAPI.ResponseTransaction
		from     int64
		want     []string
		wantNext int64
	}{
		{name: "aborted, then committed",
			set:     slices.Concat(txnBatch(0, 7, rec("a")), txnMarker(1, 7, false), txnBatch(2, 7, rec("c")), txnMarker(3, 7, true)),
			aborted: abortedAt(7, 0), from: 0, want: []string{"c"}, wantNext: 4},
		{name: "the fetch starts at the abort marker",
			set:     slices.Concat(txnMarker(1, 7, false), txnBatch(2, 7, rec("c")), txnMarker(3, 7, true)),
			aborted: abortedAt(7, 0), from: 1, want: []string{"c"}, wantNext: 4},
		{name: "two producers interleaved, one aborts",
			set: slices.Concat(txnBatch(0, 7, rec("a")), txnBatch(1, 8, rec("b")), txnMarker(2, 7, false),
				txnMarker(3, 8, true), txnBatch(4, 7, rec("c")), txnMarker(5, 7, true)),
			aborted: abortedAt(7, 0), from: 0, want: []string{"b", "c"}, wantNext: 6},
		{name: "an abort listed for a later transaction only",
			set:     slices.Concat(txnBatch(0, 7, rec("c")), txnMarker(1, 7, true), txnBatch(2, 7, rec("a")), txnMarker(3, 7, false)),
			aborted: abortedAt(7, 2), from: 0, want: []string{"c"}, wantNext: 4},
	} {
		t.Run(c.name, func(t *testing.T) {
			items, next, err := decodeRecords(readRecordSet(t, c.set), "delay", 0, c.from, &codec.Rules{}, c.aborted, nil, time.Now(), nil)
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, it := range items {
				got = append(got, string(it.Msg.Value))
			}
			if !slices.Equal(got, c.want) || next != c.wantNext {
				t.Fatalf("read %q, next %d; want %q, next %d", got, next, c.want, c.wantNext)
			}
		})
	}
}
