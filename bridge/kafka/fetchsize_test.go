package kafka

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/delaybridge/delaybridge/codec"
)

func TestFetchSizer(t *testing.T) {
	const mib = 1 << 20
	tests := []struct {
		name    string
		target  int
		cur     int // 0: the initial limit
		decoded int
		stepped bool
		want    int
	}{
		{name: "starts at a sixteenth of the target", target: mib, want: 64 << 10},
		{name: "starts at the floor", target: 100 << 10, want: minFetchBytes},
		{name: "a target under the floor is the limit", target: 4 << 10, want: 4 << 10},
		{name: "incompressible records grow it to the target", target: mib, cur: 64 << 10, decoded: 64 << 10, want: mib},
		{name: "partly full fetch grows it, bounded by the target", target: mib, cur: 64 << 10, decoded: 1 << 10, want: mib},
		{name: "records decoding to 14 times their size", target: mib, cur: mib, decoded: 14 * mib, want: mib / 14},
		{name: "never under the floor", target: mib, cur: 64 << 10, decoded: 1 << 30, want: minFetchBytes},
		{name: "nothing decoded leaves it", target: mib, cur: 200 << 10, want: 200 << 10},
		{name: "a step past a compacted tail doubles it", target: mib, cur: 200 << 10, stepped: true, want: 400 << 10},
		{name: "past the target while stepping", target: mib, cur: mib, stepped: true, want: 2 * mib},
		{name: "stepping is bounded", target: mib, cur: 40 * mib, stepped: true, want: stepGrowthLimit * mib},
		{name: "stepping is bounded below 2^31", target: 64 << 20, cur: 1 << 30, stepped: true, want: 1 << 30},
		{name: "records read win over a step", target: mib, cur: 4 * mib, decoded: 2 * mib, stepped: true, want: mib},
		{name: "no overflow of cur times target", target: 1 << 30, cur: 1 << 30, decoded: 1 << 29, want: 1 << 30},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFetchSizer(tt.target)
			if tt.cur != 0 {
				f.cur = tt.cur
				f.next(tt.decoded, tt.stepped)
			}
			if got := f.limit(); got != tt.want {
				t.Fatalf("limit %d, want %d", got, tt.want)
			}
		})
	}
}

// The broker returns the first batch of a fetch whole and the next ones
// only as far as the limit allows; kafka-go drops a batch cut short. After
// a batch whose last records compaction removed (its last offset far past
// its last record, which kafka-go does not report) the position steps past
// the fetch offset one at a time until the next batch comes whole: the
// limit must grow for that, or 10 000 compacted offsets before a 1 MiB
// batch take 10 000 fetches (review finding on ad0bc05).
func TestFetchSizerPassesACompactedTail(t *testing.T) {
	first := encodeBatch(0, 0, 1, 1, 9999, []kmsg.Record{delayRecord("1m")}) // offsets 1..9999 compacted away
	big := delayRecord("1m")
	big.Value = make([]byte, 1<<20)
	second := encodeBatch(10000, 0, 1, 1, 0, []kmsg.Record{big})
	size := newFetchSizer(1 << 20)
	offset := int64(1)
	var notes decodeNotes
	for fetches := 1; ; fetches++ {
		set := slices.Clone(second)
		if offset < 10000 {
			set = append(slices.Clone(first), second[:min(len(second), max(0, size.limit()-len(first)))]...)
		}
		notes.stepped = false
		items, next, err := decodeRecords(readRecordSet(t, set), "delay", 0, offset, &codec.Rules{}, nil, nil, time.Now(), &notes)
		if err != nil {
			t.Fatal(err)
		}
		size.next(decodedBytes(items), notes.stepped && len(items) == 0)
		if len(items) > 0 {
			if items[0].Msg.Offset != 10000 || len(items[0].Msg.Value) != 1<<20 {
				t.Fatalf("fetch %d at %d: first item at %d, %d bytes", fetches, offset, items[0].Msg.Offset, len(items[0].Msg.Value))
			}
			if fetches > 8 {
				t.Fatalf("%d fetches to pass the compacted tail", fetches)
			}
			return
		}
		if next <= offset || fetches > 100 {
			t.Fatalf("fetch %d at %d (limit %d): next %d", fetches, offset, size.limit(), next)
		}
		offset = next
	}
}

// A partition worker asks for as many stored bytes as decode to about
// FetchMaxBytes. Records that compress well (here snappy over repeated
// bytes) no longer fill the worker with many times FetchMaxBytes of decoded
// records per fetch; records that do not compress are read at the full
// limit, not at the starting one.
func TestSourceFetchesAboutFetchMaxBytesDecoded(t *testing.T) {
	const target = 256 << 10
	const n, size = 1000, 2 << 10
	for _, compressible := range []bool{true, false} {
		t.Run(fmt.Sprintf("compressible=%v", compressible), func(t *testing.T) {
			c := newCluster(t)
			if err := c.CreateTopic("delay", 1, nil); err != nil {
				t.Fatal(err)
			}
			cl := producer(t, c, kgo.ProducerBatchMaxBytes(32<<10), kgo.ProducerBatchCompression(kgo.SnappyCompression()))
			rng := rand.New(rand.NewPCG(3, 4))
			values := make([][]byte, n)
			rs := make([]*kgo.Record, n)
			for i := range values {
				v := bytes.Repeat([]byte{byte(i)}, size)
				if !compressible {
					for j := range v {
						v[j] = byte(rng.Uint32())
					}
				}
				values[i] = v
				rs[i] = &kgo.Record{Topic: "delay", Value: v}
			}
			produce(t, cl, rs...)

			cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
			cfg.FetchMaxBytes = target
			s, err := NewSource(cfg)
			if err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			var decoded []int // per fetch that read records
			s.testHookFetched = func(_, d int) {
				if d > 0 {
					mu.Lock()
					decoded = append(decoded, d)
					mu.Unlock()
				}
			}
			h := newMemHandler()
			stop := runSource(t, s, h)
			waitFor(t, "all messages", func() bool { return h.count() == n })
			if err := stop(); err != nil {
				t.Fatalf("Run: %v", err)
			}
			for i, m := range h.snapshot() {
				if m.Offset != int64(i) || !bytes.Equal(m.Value, values[i]) {
					t.Fatalf("message %d: offset %d, %d bytes", i, m.Offset, len(m.Value))
				}
			}
			mu.Lock()
			defer mu.Unlock()
			if most := slices.Max(decoded); most > 2*target {
				t.Errorf("a fetch decoded %d bytes, over twice FetchMaxBytes (%d); per fetch: %v", most, target, decoded)
			}
			// n*size is 2 MiB, eight times the target: about eight fetches
			// at the full limit, a few more while it grows.
			if !compressible && len(decoded) > 12 {
				t.Errorf("%d fetches for %d bytes of incompressible records at a %d byte target: %v", len(decoded), n*size, target, decoded)
			}
		})
	}
}
