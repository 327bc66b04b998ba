package kafka

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/delaybridge/delaybridge/bridge"
	"github.com/delaybridge/delaybridge/codec"
)

func TestFetchSizer(t *testing.T) {
	const mib = 1 << 20
	type fetch struct {
		decoded           int
		stepped, caughtUp bool
	}
	step := fetch{stepped: true}
	tests := []struct {
		name    string
		target  int
		cur     int // 0: the initial limit
		fetches []fetch
		want    int
	}{
		{name: "starts at a sixteenth of the target", target: mib, want: 64 << 10},
		{name: "a sixteenth over the floor", target: 100 << 10, want: 100 << 10 / 16},
		{name: "starts at the floor", target: 8 << 10, want: minFetchBytes},
		{name: "a target under the floor is the limit", target: 512, want: 512},
		{name: "incompressible records grow it to the target", target: mib, cur: 64 << 10, fetches: []fetch{{decoded: 64 << 10}}, want: mib},
		{name: "records decoding to 14 times their size", target: mib, cur: mib, fetches: []fetch{{decoded: 14 * mib}}, want: mib / 14},
		{name: "never under the floor", target: mib, cur: 64 << 10, fetches: []fetch{{decoded: 1 << 30}}, want: minFetchBytes},
		{name: "never over the target", target: mib, cur: 512 << 10, fetches: []fetch{{decoded: 1 << 10}}, want: mib},
		{name: "nothing decoded leaves it", target: mib, cur: 200 << 10, fetches: []fetch{{}}, want: 200 << 10},
		{name: "caught up: a trickle does not grow it", target: mib, cur: 64 << 10, fetches: []fetch{{decoded: 1 << 10, caughtUp: true}}, want: 64 << 10},
		{name: "caught up: it may shrink", target: mib, cur: mib, fetches: []fetch{{decoded: 14 * mib, caughtUp: true}}, want: mib / 14},
		{name: "caught up, then a backlog grows it", target: mib, cur: 64 << 10,
			fetches: []fetch{{decoded: 1 << 10, caughtUp: true}, {decoded: 64 << 10}}, want: mib},
		{name: "a step past a compacted tail doubles it", target: mib, cur: 200 << 10, fetches: []fetch{step}, want: 400 << 10},
		{name: "steps double it past the target", target: mib, cur: mib, fetches: []fetch{step, step, step}, want: 8 * mib},
		{name: "stepping is bounded", target: mib, cur: 40 * mib, fetches: []fetch{step}, want: stepGrowthLimit * mib},
		{name: "stepping is bounded below 2^31", target: 64 << 20, cur: 1 << 30, fetches: []fetch{step}, want: 1 << 30},
		{name: "the batch after the steps: back to the limit before them", target: mib, cur: 200 << 10,
			fetches: []fetch{step, step, step, {decoded: 3 * mib}}, want: 200 << 10},
		{name: "an empty fetch after the steps: back too", target: mib, cur: 200 << 10,
			fetches: []fetch{step, step, {caughtUp: true}}, want: 200 << 10},
		{name: "then sized as before", target: mib, cur: 200 << 10,
			fetches: []fetch{step, {decoded: 3 * mib}, {decoded: 400 << 10}}, want: 512 << 10},
		{name: "no overflow of cur times target", target: 1 << 30, cur: 1 << 30, fetches: []fetch{{decoded: 1 << 29}}, want: 1 << 30},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFetchSizer(tt.target)
			if tt.cur != 0 {
				f.cur = tt.cur
			}
			for _, ft := range tt.fetches {
				f.next(ft.decoded, ft.stepped, ft.caughtUp)
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
		items, next, err := decodeRecords(readRecordSet(t, set), "delay", 0, offset, &codec.Rules{}, nil, nil, time.Now(), &notes)
		if err != nil {
			t.Fatal(err)
		}
		if len(items) == 0 && !notes.stepped {
			t.Fatalf("fetch %d at %d: no items, not stepped", fetches, offset)
		}
		size.next(decodedBytes(items), notes.stepped && len(items) == 0, false)
		if len(items) > 0 {
			if items[0].Msg.Offset != 10000 || len(items[0].Msg.Value) != 1<<20 {
				t.Fatalf("fetch %d at %d: first item at %d, %d bytes", fetches, offset, items[0].Msg.Offset, len(items[0].Msg.Value))
			}
			if fetches > 8 {
				t.Fatalf("%d fetches to pass the compacted tail", fetches)
			}
			// stepped is a fact of one fetch: the next one starts clean.
			if _, _, err := decodeRecords(readRecordSet(t, second), "delay", 0, 10000, &codec.Rules{}, nil, nil, time.Now(), &notes); err != nil || notes.stepped {
				t.Fatalf("a fetch after the steps: stepped %v (%v)", notes.stepped, err)
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
			cl := batchingProducer(t, c)
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
			produceFull(t, cl, rs...)

			cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
			cfg.FetchMaxBytes = target
			s, err := NewSource(cfg)
			if err != nil {
				t.Fatal(err)
			}
			fetches := recordFetches(s, true) // per fetch that read records
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
			limits, decoded := fetches.get()
			t.Logf("per fetch: limits %v, decoded %v", limits, decoded)
			if most := slices.Max(decoded); most > 2*target {
				t.Errorf("a fetch decoded %d bytes, over twice FetchMaxBytes (%d); per fetch: %v", most, target, decoded)
			}
			// The first fetch, at the starting limit, decodes over the
			// target here: the next asks for less.
			if compressible && (len(decoded) < 2 || decoded[0] <= target || limits[1] >= limits[0]) {
				t.Errorf("limits %v for decoded %v: want the first over the target and the second limit smaller", limits, decoded)
			}
			// n*size is 2 MiB, eight times the target: about eight fetches
			// at the full limit, a few more while it grows.
			if !compressible && len(decoded) > 12 {
				t.Errorf("%d fetches for %d bytes of incompressible records at a %d byte target: %v", len(decoded), n*size, target, decoded)
			}
		})
	}
}

// After a partition caught up with its log, a fetch returns less than its
// limit and tells nothing of the compression ratio: a trickle must not
// raise the limit, or the next burst of compressible records is read at
// FetchMaxBytes stored bytes and decodes to many times that (review
// finding: 0.6-1.8 MiB per fetch at a 256 KiB target).
func TestSourceFetchSizeAfterCatchingUp(t *testing.T) {
	const target = 256 << 10
	const size = 2 << 10
	c := newCluster(t)
	if err := c.CreateTopic("delay", 1, nil); err != nil {
		t.Fatal(err)
	}
	cl := batchingProducer(t, c)
	records := func(from, n int) []*kgo.Record {
		rs := make([]*kgo.Record, n)
		for i := range rs {
			rs[i] = &kgo.Record{Topic: "delay", Value: bytes.Repeat([]byte{byte(from + i)}, size)}
		}
		return rs
	}
	produceFull(t, cl, records(0, 1000)...) // a backlog: the worker learns the ratio
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
	cfg.FetchMaxBytes = target
	s, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	fetches := recordFetches(s, false)
	h := newMemHandler()
	stop := runSource(t, s, h)
	waitFor(t, "the backlog", func() bool { return h.count() == 1000 })
	for i := range 3 { // a trickle, read while caught up
		produceFull(t, cl, records(1000+i, 1)...)
		waitFor(t, "a trickle record", func() bool { return h.count() == 1001+i })
	}
	mark := fetches.count()
	produceFull(t, cl, records(1003, 1000)...) // a burst
	waitFor(t, "the burst", func() bool { return h.count() == 2003 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	limits, decoded := fetches.get()
	for i := mark; i < len(decoded); i++ {
		if decoded[i] > 2*target {
			t.Errorf("fetch %d of the burst (limit %d) decoded %d bytes, over twice FetchMaxBytes %d; limits %v, decoded %v",
				i-mark, limits[i], decoded[i], target, limits, decoded)
		}
	}
}

// The identity check fetches the checkpointed record alone: the broker
// returns its batch whole at any limit, and at start every partition
// checks at once, so it asks for the smallest limit, not FetchMaxBytes
// (review finding: 2 MB decoded per partition to compare one record).
func TestIdentityCheckFetchesOneBatch(t *testing.T) {
	c, _, cp := consumedLog(t)
	s, err := NewSource(testConfig(t, c.ListenAddrs(), "g", "delay"))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var asked []int32
	c.ControlKey(int16(kmsg.Fetch), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		req := kreq.(*kmsg.FetchRequest)
		mu.Lock()
		defer mu.Unlock()
		asked = append(asked, req.MaxBytes)
		for _, rt := range req.Topics {
			for _, rp := range rt.Partitions {
				asked = append(asked, rp.PartitionMaxBytes)
			}
		}
		return nil, nil, false
	})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	got, err := s.checkIdentity(ctx, "delay", 0, cp)
	if err != nil || got.verdict != identitySame {
		t.Fatalf("checkIdentity = %+v, %v; want the same record", got, err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(asked) == 0 {
		t.Fatal("no fetch seen")
	}
	for _, n := range asked {
		if n > minFetchBytes {
			t.Fatalf("identity check fetches asked for %v bytes, want at most %d", asked, minFetchBytes)
		}
	}
}

// Steps past a compacted tail double the limit (a batch after the tail
// might not have fit), a step that reaches the end of the log does not,
// and the idle polls after it are back at the limit from before the steps
// (review finding: idle polls after steps kept doubling it, 64 MiB after a
// second). Here the steps 1->2->3->4 each double it and 4->5 reaches the
// end. TestFetchItemsClearsTheStepNote covers the note of a step short of
// the end surviving into a failed fetch.
func TestFetchSizeAfterStepsToTheLogEnd(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	now := time.Now().UnixMilli()
	batch := encodeBatch(0, 0, now, now, 4, []kmsg.Record{delayRecord("1m")}) // offsets 1..4 compacted away
	var askedMu sync.Mutex
	asked := map[int64]int32{} // the limit of the first fetch at each offset
	c.ControlKey(int16(kmsg.Fetch), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		req := kreq.(*kmsg.FetchRequest)
		if len(req.Topics) != 1 || len(req.Topics[0].Partitions) != 1 {
			return nil, nil, false
		}
		askedMu.Lock()
		if qp := req.Topics[0].Partitions[0]; asked[qp.FetchOffset] == 0 {
			asked[qp.FetchOffset] = qp.PartitionMaxBytes
		}
		askedMu.Unlock()
		resp := req.ResponseKind().(*kmsg.FetchResponse)
		rt := kmsg.NewFetchResponseTopic()
		rt.Topic, rt.TopicID = req.Topics[0].Topic, req.Topics[0].TopicID
		rp := kmsg.NewFetchResponseTopicPartition()
		rp.HighWatermark, rp.LastStableOffset, rp.LogStartOffset = 5, 5, 0
		if req.Topics[0].Partitions[0].FetchOffset < 5 {
			rp.RecordBatches = batch
		}
		rt.Partitions = append(rt.Partitions, rp)
		resp.Topics = append(resp.Topics, rt)
		return resp, nil, true
	})
	s, err := NewSource(testConfig(t, c.ListenAddrs(), "g", "delay"))
	if err != nil {
		t.Fatal(err)
	}
	fetches := recordFetches(s, false)
	h := newMemHandler()
	stop := runSource(t, s, h)
	waitFor(t, "record 0", func() bool { return h.count() == 1 })
	waitFor(t, "ten more fetches", func() bool { return fetches.count() >= 12 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	limits, _ := fetches.get()
	if most := slices.Max(limits); most > 8*s.cfg.FetchMaxBytes {
		t.Fatalf("a fetch asked for %d bytes, over 8 times FetchMaxBytes (three doublings): limits %v", most, limits)
	}
	for i, l := range limits[len(limits)-5:] {
		if l > s.cfg.FetchMaxBytes {
			t.Fatalf("idle poll %d asked for %d bytes, over FetchMaxBytes %d: limits %v", i, l, s.cfg.FetchMaxBytes, limits)
		}
	}
	askedMu.Lock()
	defer askedMu.Unlock()
	for at := int64(2); at <= 4; at++ {
		if asked[at] != 2*asked[at-1] {
			t.Errorf("the fetch at %d after a step asked for %d bytes, want twice the %d at %d (limits by offset %v)", at, asked[at], asked[at-1], at-1, asked)
		}
	}
	if asked[5] != asked[1] {
		t.Errorf("the fetch at the end of the log asked for %d bytes, want the %d from before the steps (limits by offset %v)", asked[5], asked[1], asked)
	}
}

// The step note is a fact of one fetch: a fetch that fails or comes back
// empty clears it too (it returns before decodeRecords), or a stale note
// would double the limit on every retry of a failing fetch.
func TestFetchItemsClearsTheStepNote(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	client, cfg, ctx := fetchClient(t, c)
	for _, tc := range []struct {
		name  string
		topic string
		fails bool
	}{{"empty", "delay", false}, {"failed", "no-such-topic", true}} {
		t.Run(tc.name, func(t *testing.T) {
			notes := decodeNotes{stepped: true}
			items, _, _, err := fetchItems(ctx, client, cfg, tc.topic, 0, 0, 10*time.Millisecond, 1<<10, nil, nil, &notes)
			if (err != nil) != tc.fails || len(items) != 0 {
				t.Fatalf("fetch: %d items, %v", len(items), err)
			}
			if notes.stepped {
				t.Fatal("the step note of an earlier fetch survived")
			}
		})
	}
}

// fetchLog keeps what a Source's testHookFetched reports: the limit asked
// for and the bytes decoded, one entry per fetch.
type fetchLog struct {
	mu              sync.Mutex
	limits, decoded []int
}

// batchingProducer writes snappy batches of up to 32 KiB of records, and
// only when produceFull flushes it.
func batchingProducer(t testing.TB, c *kfake.Cluster) *kgo.Client {
	return producer(t, c, kgo.ProducerBatchMaxBytes(32<<10), kgo.ProducerBatchCompression(kgo.SnappyCompression()), kgo.ManualFlushing())
}

// produceFull writes rs through a batchingProducer: every record is
// buffered before any is sent, so each batch is filled to the limit and
// the stored log (its batches, their compression ratio) is the same every
// run. ProduceSync sends the first records while the rest are added, so
// how many went into a batch depended on the scheduling: under CPU load
// the first fetch of TestSourceFetchesAboutFetchMaxBytesDecoded decoded
// 246 or 254 KiB at its starting limit in 2 of 41 runs, under its 256 KiB
// target, where it decodes 270 KiB from full batches.
func produceFull(t testing.TB, cl *kgo.Client, rs ...*kgo.Record) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, len(rs))
	for _, r := range rs {
		wg.Add(1)
		cl.Produce(ctx, r, func(_ *kgo.Record, err error) {
			if err != nil {
				errs <- err
			}
			wg.Done()
		})
	}
	if err := cl.Flush(ctx); err != nil {
		t.Fatalf("produce: flush: %v", err)
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		t.Fatalf("produce: %v", err)
	}
}

// recordFetches logs the fetches of s; withRecords keeps only those that
// decoded records.
func recordFetches(s *Source, withRecords bool) *fetchLog {
	f := &fetchLog{}
	s.testHookFetched = func(limit, decoded int) {
		if withRecords && decoded == 0 {
			return
		}
		f.mu.Lock()
		defer f.mu.Unlock()
		f.limits, f.decoded = append(f.limits, limit), append(f.decoded, decoded)
	}
	return f
}

func (f *fetchLog) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.limits)
}

func (f *fetchLog) get() (limits, decoded []int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.limits), slices.Clone(f.decoded)
}

// A fetch response without records reports the end of the log a
// read_committed reader can reach: the last stable offset while a
// transaction is open, as one with records does (review finding: the
// high watermark was returned, so idle polls at the last stable offset
// did not count as caught up and the lag gauge counted the open
// transaction's records).
func TestFetchItemsEmptyResponseEndsAtTheLastStableOffset(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	c.ControlKey(int16(kmsg.Fetch), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		req := kreq.(*kmsg.FetchRequest)
		resp := req.ResponseKind().(*kmsg.FetchResponse)
		for _, qt := range req.Topics {
			rt := kmsg.NewFetchResponseTopic()
			rt.Topic, rt.TopicID = qt.Topic, qt.TopicID
			for _, qp := range qt.Partitions {
				rp := kmsg.NewFetchResponseTopicPartition()
				rp.Partition = qp.Partition
				rp.HighWatermark, rp.LastStableOffset, rp.LogStartOffset = 10, 5, 0
				rt.Partitions = append(rt.Partitions, rp)
			}
			resp.Topics = append(resp.Topics, rt)
		}
		return resp, nil, true
	})
	client, cfg, ctx := fetchClient(t, c)
	var notes decodeNotes
	items, next, hw, err := fetchItems(ctx, client, cfg, "delay", 0, 5, 10*time.Millisecond, 1<<10, nil, nil, &notes)
	if err != nil || len(items) != 0 || next != 5 {
		t.Fatalf("fetch at 5: %d items, next %d, %v", len(items), next, err)
	}
	if hw != 5 {
		t.Fatalf("end of the log %d, want the last stable offset 5 (high watermark 10)", hw)
	}
}

// fetchClient is what fetchItems needs to fetch from c directly: a client,
// a Config with its defaults and a context ending with the test.
func fetchClient(t *testing.T, c *kfake.Cluster) (*kafkago.Client, *Config, context.Context) {
	t.Helper()
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
	cfg.setDefaults()
	client := &kafkago.Client{Addr: kafkago.TCP(c.ListenAddrs()...), Transport: cfg.transport()}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return client, &cfg, ctx
}

// TestDecodedBytesCountsHeaders: a header costs its codec.Header beside its
// bytes, so a record of many empty headers (3 bytes each on the wire, 40
// in memory) shrinks the next fetch as its memory does.
func TestDecodedBytesCountsHeaders(t *testing.T) {
	many := make([]codec.Header, 1000)
	for _, tc := range []struct {
		name  string
		items []bridge.Item
		want  int
	}{
		{"none", nil, 0},
		{"key and value", []bridge.Item{{Msg: codec.Message{Key: []byte("k"), Value: []byte("value")}}}, 6},
		{"headers", []bridge.Item{{Msg: codec.Message{Value: []byte("v"), Headers: []codec.Header{{Key: "a", Value: []byte("bc")}, {Key: "d"}}}}}, 1 + 3 + 1 + 2*codec.HeaderMemory},
		{"many empty headers", []bridge.Item{{Msg: codec.Message{Headers: many}}}, 1000 * codec.HeaderMemory},
	} {
		if got := decodedBytes(tc.items); got != tc.want {
			t.Errorf("%s: decodedBytes = %d, want %d", tc.name, got, tc.want)
		}
	}
}
