package shard

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/cockroachdb/pebble/v2"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/clock"
	"github.com/delaybridge/delaybridge/wheel"
)

const (
	benchBatch   = 128
	benchPayload = 1024
	benchWriters = 16 // concurrent ingest batches, as from many source partitions
	benchShards  = defaultShards
)

func benchTask(id string, due int64) codec.Task {
	return codec.Task{
		Kind: codec.KindSchedule, ID: id, Source: "bench", Origin: "kafka:bench/0@1",
		Stamp: due, Offset: 1, Due: due, Transport: codec.TransportKafka, Target: "out",
		Key: []byte(id), Value: make([]byte, benchPayload),
		Headers:      []codec.Header{{Key: "content-type", Value: []byte("application/json")}},
		DLQTransport: codec.TransportKafka, DLQ: "dlq",
	}
}

func benchParallel(b *testing.B, fn func(batch int64)) {
	var next atomic.Int64
	b.SetParallelism((benchWriters + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			fn(next.Add(1))
		}
	})
	b.StopTimer()
	b.ReportMetric(float64(b.N*benchBatch)/time.Since(start).Seconds(), "tasks/s")
}

// BenchmarkStoreIngest: 1 KB payloads in synced batches of 128 through
// Engine.Ingest (index lookups, index writes, envelope, counters). Every
// batch's tasks are due in the same 128 ms, a day ahead: each batch's t
// keys land among those of all earlier batches.
func BenchmarkStoreIngest(b *testing.B) { benchStoreIngest(b, false, dueSame) }

// BenchmarkStoreIngestRandomIDs is BenchmarkStoreIngest with ids spread over
// the key space like UUIDs or hashed order numbers: each index write and
// lookup lands at a random place in the memtable rather than next to the
// previous batch's.
func BenchmarkStoreIngestRandomIDs(b *testing.B) { benchStoreIngest(b, true, dueSame) }

// BenchmarkStoreIngestRisingDue is BenchmarkStoreIngest with due times
// that rise from batch to batch (batch n's 128 tasks are due 128 ms after
// batch n-1's), as "now + delay" does for a steady delay: t keys arrive in
// about key order, so flushed files overlap little. Compare it with
// BenchmarkPebbleRawSyncedBatchRisingDue.
func BenchmarkStoreIngestRisingDue(b *testing.B) { benchStoreIngest(b, false, dueRising) }

// BenchmarkStoreIngestMixedDue is BenchmarkStoreIngest with each task due
// at its own moment of the next day, as a source with mixed delays sends
// them: a batch's t keys come in no key order. Compare it with
// BenchmarkPebbleRawSyncedBatchMixedDue.
func BenchmarkStoreIngestMixedDue(b *testing.B) { benchStoreIngest(b, false, dueMixed) }

// dueShape is how the due times of a benchmark's batches relate.
type dueShape int

const (
	dueSame   dueShape = iota // every batch due in the same 128 ms: base+i
	dueRising                 // batch n 128 ms after batch n-1: base+n*benchBatch+i
	dueMixed                  // each task at a pseudo-random ms of the next day
)

// benchDue is the due time of task i of batch n.
func benchDue(base, n int64, i int, shape dueShape) int64 {
	switch shape {
	case dueRising:
		return base + n*benchBatch + int64(i)
	case dueMixed:
		var b [16]byte // on the stack: the harness allocates nothing per task
		binary.BigEndian.PutUint64(b[:8], uint64(n))
		binary.BigEndian.PutUint64(b[8:], uint64(i))
		h := xxhash.Sum64(b[:])
		return base + int64(h%uint64(24*time.Hour/time.Millisecond))
	}
	return base + int64(i)
}

func benchStoreIngest(b *testing.B, randomIDs bool, shape dueShape) {
	e, err := Open(Options{Dir: b.TempDir(), Logger: zap.NewNop()})
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	due := time.Now().Add(24 * time.Hour).UnixMilli()
	ctx := context.Background()
	// Batches are reused, as BenchmarkPebbleRawSyncedBatch reuses its
	// buffers: fresh 1 KB payloads for every task charged this benchmark
	// about a tenth of its CPU (allocation, zeroing, GC) that the raw one,
	// whose tasks stay on the stack, did not pay. A source's payloads are
	// its fetch buffers, not allocations of the engine.
	batches := sync.Pool{New: func() any {
		batch := make([]codec.Task, benchBatch)
		for i := range batch {
			batch[i] = benchTask("", 0)
		}
		return &batch
	}}
	benchParallel(b, func(n int64) {
		bp := batches.Get().(*[]codec.Task)
		batch := *bp
		for i := range batch {
			id := fmt.Sprintf("b%d-%d", n, i)
			if randomIDs {
				id = fmt.Sprintf("%016x", xxhash.Sum64String(id))
			}
			t := &batch[i]
			t.ID, t.Key = id, append(t.Key[:0], id...)
			t.Stamp = benchDue(due, n, i, shape)
			t.Due = t.Stamp
		}
		if err := e.Ingest(ctx, batch, []Checkpoint{{Key: fmt.Sprintf("kafka|bench|%d", n%benchWriters), Offset: n}}); err != nil {
			b.Fatal(err)
		}
		batches.Put(bp)
	})
}

// BenchmarkPebbleRawSyncedBatch writes the same envelopes under the same
// t keys in synced batches of 128 straight to Pebble (same options): the
// ceiling BenchmarkStoreIngest is compared with.
func BenchmarkPebbleRawSyncedBatch(b *testing.B) { benchRawSyncedBatch(b, rawOneKey, dueSame) }

// BenchmarkPebbleRawSyncedBatchRisingDue is BenchmarkPebbleRawSyncedBatch
// with the due times of BenchmarkStoreIngestRisingDue.
func BenchmarkPebbleRawSyncedBatchRisingDue(b *testing.B) {
	benchRawSyncedBatch(b, rawOneKey, dueRising)
}

// BenchmarkPebbleRawSyncedBatchMixedDue is BenchmarkPebbleRawSyncedBatch
// with the due times of BenchmarkStoreIngestMixedDue, written in task order.
func BenchmarkPebbleRawSyncedBatchMixedDue(b *testing.B) { benchRawSyncedBatch(b, rawOneKey, dueMixed) }

// BenchmarkPebbleRawSyncedBatchByID writes each envelope once, under a key
// ordered by a hash of its id: the single key per task of a layout that
// finds tasks by id without a separate index. It shows what such a layout
// would cost the one-key baseline before any engine work.
func BenchmarkPebbleRawSyncedBatchByID(b *testing.B) { benchRawSyncedBatch(b, rawByID, dueSame) }

// BenchmarkPebbleRawSyncedBatchWithIndex is the raw baseline writing
// exactly what Ingest writes for a batch of new ids (each envelope under
// its t key in its shard's range of the default 8, the 48-byte index
// entry under its i key, the sequence and per-shard count merges and the
// checkpoint), without lookups or bookkeeping: it separates the cost of
// the engine's key layout from the engine's own.
func BenchmarkPebbleRawSyncedBatchWithIndex(b *testing.B) {
	benchRawSyncedBatch(b, rawWithIndex, dueSame)
}

// BenchmarkPebbleRawSyncedBatchWithIndexRisingDue is
// BenchmarkPebbleRawSyncedBatchWithIndex with rising due times.
func BenchmarkPebbleRawSyncedBatchWithIndexRisingDue(b *testing.B) {
	benchRawSyncedBatch(b, rawWithIndex, dueRising)
}

type rawLayout int

const (
	rawOneKey rawLayout = iota
	rawByID
	rawWithIndex
)

func benchRawSyncedBatch(b *testing.B, layout rawLayout, shape dueShape) {
	withIndex := layout == rawWithIndex
	db, err := openPebble(context.Background(), b.TempDir(), nil, zap.NewNop(), 0, 0, nil, 0, false)
	if err != nil {
		b.Fatal(err)
	}
	defer db.Close()
	due := time.Now().Add(24 * time.Hour).UnixMilli()
	var seq atomic.Uint64
	benchParallel(b, func(n int64) {
		batch := db.NewBatch()
		var key, val []byte
		var counts [benchShards]uint64
		var last uint64
		for i := 0; i < benchBatch; i++ {
			t := benchTask(fmt.Sprintf("b%d-%d", n, i), benchDue(due, n, i, shape))
			s := seq.Add(1)
			sh := 0
			if withIndex {
				sh = shardOfN(t.Source, t.ID, benchShards)
				counts[sh]++
			}
			key = appendTaskKey(key[:0], sh, t.Due, s)
			if layout == rawByID {
				key = binary.BigEndian.AppendUint64(append(key[:0], prefixTask), xxhash.Sum64String(t.ID))
				key = append(append(append(key, t.Source...), 0), t.ID...)
			}
			val = codec.AppendTask(val[:0], &t)
			batch.Set(key, val, nil)
			if withIndex {
				ie := indexEntry{Shard: sh, Fire: t.Due, Seq: s, Order: order{Stamp: t.Stamp, Offset: t.Offset}}
				batch.Set(appendIndexKey(key[:0], t.Source, t.ID), appendIndexEntry(val[:0], &ie), nil)
				last = s
			}
		}
		if withIndex {
			batch.Merge(seqKey, u64(last), nil)
			for sh, c := range counts {
				if c != 0 {
					batch.Merge(countKey(sh), u64(c), nil)
				}
			}
			batch.Set(offsetKey(fmt.Sprintf("kafka|bench|%d", n%benchWriters)), u64(uint64(n)), nil)
		}
		if err := batch.Commit(pebble.Sync); err != nil {
			b.Fatal(err)
		}
		batch.Close()
	})
}

// fillStore ingests n tasks with dues spread over span after start.
func fillStore(b *testing.B, e *Engine, n int, start time.Time, span time.Duration) {
	ctx := context.Background()
	var wg sync.WaitGroup
	var next atomic.Int64
	total := int64(n / benchBatch)
	for w := 0; w < benchWriters; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			batch := make([]codec.Task, benchBatch)
			for {
				k := next.Add(1) - 1
				if k >= total {
					return
				}
				for i := range batch {
					j := k*benchBatch + int64(i)
					due := start.Add(time.Duration(j) * (span / time.Duration(n))).UnixMilli()
					batch[i] = benchTask(fmt.Sprintf("f%d", j), due)
				}
				if err := e.Ingest(ctx, batch, nil); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
}

func heapAfterGC() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// BenchmarkRecovery1M: reopen with 1 M pending 1 KB tasks spread over 30
// days (horizon 10 min) and report the seconds until Open returns.
func BenchmarkRecovery1M(b *testing.B) {
	benchRecovery(b, 1_000_000, 30*24*time.Hour, "spread30d")
}

// BenchmarkRecovery1MOverdue: the same 1 M tasks all overdue at reopen,
// so every one is loaded into a wheel.
func BenchmarkRecovery1MOverdue(b *testing.B) {
	benchRecovery(b, 1_000_000, -time.Hour, "overdue")
}

func benchRecovery(b *testing.B, n int, span time.Duration, _ string) {
	dir := b.TempDir()
	now := time.Now()
	start := now.Add(time.Minute)
	if span < 0 {
		start, span = now.Add(span), -span/2
	}
	e, err := Open(Options{Dir: dir, Logger: zap.NewNop()})
	if err != nil {
		b.Fatal(err)
	}
	t0 := time.Now()
	n = n / benchBatch * benchBatch
	fillStore(b, e, n, start, span)
	b.Logf("filled %d tasks in %v", n, time.Since(t0))
	if err := e.Close(); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	var secs []float64
	for i := 0; i < b.N; i++ {
		t := time.Now()
		e, err := Open(Options{Dir: dir, Logger: zap.NewNop(), Clock: clock.Real{}})
		if err != nil {
			b.Fatal(err)
		}
		secs = append(secs, time.Since(t).Seconds())
		st := e.Stats()
		inWheel := 0
		for _, s := range st.Shards {
			inWheel += s.InWheel
		}
		if st.Pending != int64(n) {
			b.Fatalf("recovered %d pending, want %d", st.Pending, n)
		}
		b.Logf("recovered %d pending, %d in wheels, heap %d MB", st.Pending, inWheel, heapAfterGC()>>20)
		e.Close()
	}
	b.StopTimer()
	b.ReportMetric(slices.Max(secs), "s-to-ready")
}

// BenchmarkBoundedMemory10M: 10 M pending 1 KB tasks over 30 days with a
// 10 min horizon; reports the Go heap after loading. DELAYBRIDGE_TASKS
// overrides the count (e.g. 2000000).
func BenchmarkBoundedMemory10M(b *testing.B) {
	if !longTests() {
		b.Skip("writes ~10 GB; set DELAYBRIDGE_LONG=1")
	}
	n := 10_000_000
	if s := os.Getenv("DELAYBRIDGE_TASKS"); s != "" {
		fmt.Sscan(s, &n)
	}
	for i := 0; i < b.N; i++ {
		before := heapAfterGC()
		e, err := Open(Options{Dir: b.TempDir(), Logger: zap.NewNop(), Horizon: 10 * time.Minute})
		if err != nil {
			b.Fatal(err)
		}
		t := time.Now()
		fillStore(b, e, n, time.Now().Add(time.Minute), 30*24*time.Hour)
		el := time.Since(t)
		heap := heapAfterGC()
		inWheel := 0
		for _, s := range e.Stats().Shards {
			inWheel += s.InWheel
		}
		b.Logf("%d tasks loaded in %v (%.0f tasks/s), %d in wheels, process RSS %d MB (Pebble's block cache and memtables live outside the Go heap in a cgo build)",
			n, el, float64(n)/el.Seconds(), inWheel, rssMB())
		b.ReportMetric(float64(heap)/(1<<20), "heap-MB")
		b.ReportMetric(float64(heap-min(before, heap))/float64(n), "heap-bytes/task")
		e.Close()
	}
}

// latencySink records the lateness of each delivery against the real clock.
type latencySink struct {
	mu   sync.Mutex
	late []time.Duration
}

func (s *latencySink) Deliver(_ context.Context, batch []*codec.Task) []error {
	now := time.Now()
	s.mu.Lock()
	for _, t := range batch {
		s.late = append(s.late, now.Sub(time.UnixMilli(t.Due)))
	}
	s.mu.Unlock()
	return nil
}

// BenchmarkFirePrecision: ~20 k fires/s for a few seconds with the real
// clock into an in-memory sink; reports p50/p99/max lateness (delivery
// time minus due).
func BenchmarkFirePrecision(b *testing.B) {
	const rate, seconds = 20_000, 3
	for i := 0; i < b.N; i++ {
		e, err := Open(Options{Dir: b.TempDir(), Logger: zap.NewNop()})
		if err != nil {
			b.Fatal(err)
		}
		sink := &latencySink{}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- e.Run(ctx, sink) }()
		// Schedule rate*seconds tasks evenly spread from 4 s on, ingested
		// ahead (ingest is not what is measured here).
		base := time.Now().Add(4 * time.Second).UnixMilli()
		total := rate * seconds
		batch := make([]codec.Task, 0, benchBatch)
		for j := 0; j < total; j++ {
			due := base + int64(j)*1000/rate
			t := benchTask(fmt.Sprintf("p%d", j), due)
			t.Value = t.Value[:100]
			batch = append(batch, t)
			if len(batch) == benchBatch || j == total-1 {
				if err := e.Ingest(ctx, batch, nil); err != nil {
					b.Fatal(err)
				}
				batch = batch[:0]
			}
		}
		for {
			sink.mu.Lock()
			n := len(sink.late)
			sink.mu.Unlock()
			if n >= total {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		cancel()
		<-done
		e.Close()
		late := sink.late
		slices.Sort(late)
		q := func(p float64) float64 { return late[int(p*float64(len(late)-1))].Seconds() * 1000 }
		b.ReportMetric(q(0.5), "p50-ms")
		b.ReportMetric(q(0.99), "p99-ms")
		b.ReportMetric(q(1), "max-ms")
	}
}

// rssMB reads the process's resident set size (Linux), 0 if unknown.
func rssMB() int64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "VmRSS:") {
			var kb int64
			fmt.Sscanf(strings.TrimSpace(strings.TrimPrefix(line, "VmRSS:")), "%d", &kb)
			return kb >> 10
		}
	}
	return 0
}

// countSink acknowledges every task and counts them.
type countSink struct{ n atomic.Int64 }

func (s *countSink) Deliver(_ context.Context, batch []*codec.Task) []error {
	s.n.Add(int64(len(batch)))
	return nil
}

// BenchmarkIngestAndFire: the whole engine cycle with the fire loops
// running. 1 KB tasks are ingested in synced batches of 128 from
// concurrent writers while the loops read, deliver (to a sink that
// acknowledges at once) and delete them. Tasks are due at once (delay=0:
// fired while their memtable is in memory) or 1 s after their ingest
// (delay=1s: at these rates part of them is flushed by then, as in the
// bridge's throughput benchmark). Reports the ingest rate and the rate at
// which tasks are fired and deleted, from the first ingest to the last
// fire less the delay.
func BenchmarkIngestAndFire(b *testing.B) {
	for _, delay := range []time.Duration{0, time.Second} {
		b.Run(fmt.Sprintf("delay=%v", delay), func(b *testing.B) { benchIngestAndFire(b, delay) })
	}
}

func benchIngestAndFire(b *testing.B, delay time.Duration) {
	e, err := Open(Options{Dir: b.TempDir(), Logger: zap.NewNop()})
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	sink := &countSink{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx, sink) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			b.Error(err)
		}
	}()
	var next atomic.Int64
	b.SetParallelism((benchWriters + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		batch := make([]codec.Task, benchBatch)
		for pb.Next() {
			n := next.Add(1)
			due := time.Now().Add(delay).UnixMilli()
			for i := range batch {
				batch[i] = benchTask(fmt.Sprintf("f%d-%d", n, i), due)
			}
			if err := e.Ingest(ctx, batch, nil); err != nil {
				b.Error(err)
				return
			}
		}
	})
	ingested := time.Since(start)
	total := int64(b.N * benchBatch)
	for sink.n.Load() < total && e.Err() == nil {
		time.Sleep(time.Millisecond)
	}
	fired := time.Since(start) - delay
	b.StopTimer()
	b.ReportMetric(float64(total)/ingested.Seconds(), "ingest-tasks/s")
	b.ReportMetric(float64(total)/fired.Seconds(), "fired-tasks/s")
}

// downSink refuses every delivery as unavailable while down is set, and
// counts what it takes.
type downSink struct {
	down  atomic.Bool
	tries atomic.Int64
	acked atomic.Int64
}

func (s *downSink) Deliver(_ context.Context, batch []*codec.Task) []error {
	s.tries.Add(int64(len(batch)))
	if !s.down.Load() {
		s.acked.Add(int64(len(batch)))
		return nil
	}
	errs := make([]error, len(batch))
	for i := range errs {
		errs[i] = ErrUnavailable
	}
	return errs
}

// BenchmarkOutageMemory: 1 M pending 1 KB tasks come due while their
// target broker is down (real clock, retries after 100 ms doubling to
// 1 s). Once each has failed, it reports the Go heap and the tasks
// waiting in memory (wheel entries, late map) and held on disk; then the
// broker comes back and it reports the rate at which the backlog is
// delivered. "in-memory" keeps every waiting task in memory (as before
// holding); "default" has the default OutageMemory (65536 per shard, so
// about half are held); "held" keeps 1024 per shard in memory.
// heap-MB-waiting is the Go heap with the tasks waiting less the heap
// before they came due. DELAYBRIDGE_TASKS overrides the count.
func BenchmarkOutageMemory(b *testing.B) {
	n := 1_000_000
	if s := os.Getenv("DELAYBRIDGE_TASKS"); s != "" {
		fmt.Sscan(s, &n)
	}
	for _, bc := range []struct {
		name   string
		memory int
	}{{"in-memory", math.MaxInt}, {"default", 0}, {"held", 1024}} {
		b.Run(bc.name, func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				benchOutageMemory(b, n, bc.memory)
			}
		})
	}
}

func benchOutageMemory(b *testing.B, n, memory int) {
	e, err := Open(Options{Dir: b.TempDir(), Logger: zap.NewNop(), OutageMemory: memory,
		Retry: RetryPolicy{Initial: 100 * time.Millisecond, Max: time.Second}})
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	fillStore(b, e, n, time.Now().Add(2*time.Second), time.Second)
	before := heapAfterGC() // the tasks are not due yet
	sink := &downSink{}
	sink.down.Store(true)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx, sink) }()
	defer func() { cancel(); <-done }()
	waiting := func() (wheel, late int, held int64) {
		wheel, late = e.inMemory()
		return wheel, late, e.Stats().Held
	}
	for {
		_, late, held := waiting()
		if int64(late)+held >= int64(n/benchBatch*benchBatch) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	heap := heapAfterGC()
	wheel, late, held := waiting()
	b.Logf("%d tasks waiting: %d wheel entries, %d late, %d held; heap %.1f MB; %d tries so far",
		n, wheel, late, held, float64(heap)/(1<<20), sink.tries.Load())
	b.ReportMetric(float64(heap)/(1<<20), "heap-MB")
	b.ReportMetric((float64(heap)-float64(before))/(1<<20), "heap-MB-waiting")
	b.ReportMetric(float64(wheel+late), "in-memory-entries")
	b.ReportMetric(float64(held), "held")
	start := time.Now()
	sink.down.Store(false)
	for e.Stats().Pending > 0 {
		time.Sleep(10 * time.Millisecond)
	}
	el := time.Since(start)
	b.ReportMetric(float64(sink.acked.Load())/el.Seconds(), "delivered/s")
	b.ReportMetric(el.Seconds(), "s-to-deliver")
}

// BenchmarkIngestBeforeOverdueHerd: 200 000 tasks due at one instant came
// due while the engine was down (reopened an hour later, not running);
// then tasks due before that instant, in scrambled order, are ingested
// in batches of 100, as a source's backlog catches up. Reports the time
// per such task. Before recovery started the wheel at the earliest stored
// fire time the herd waited in the wheel's late list, and each such task
// was inserted into it with a copy of the herd (130-155 µs a task, against
// 6-7 µs with a 10 000 herd).
func BenchmarkIngestBeforeOverdueHerd(b *testing.B) {
	h := newHarness(b, func(o *Options) { o.Shards = 1; o.Logger = zap.NewNop() })
	herd := t0.Add(30 * time.Minute)
	const n = 200_000
	ingestHerd(h, n, herd)
	h.clk.Set(t0.Add(time.Hour))
	h.reopen()
	s := h.e.shards[0]
	off := int64(n + 1)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		var batch []codec.Task
		for j := range 100 {
			off++
			due := herd.Add(-time.Duration((i*100+j)*7919%1800) * time.Second)
			batch = append(batch, sched("e"+strconv.FormatInt(off, 10), due, off))
		}
		if err := h.e.Ingest(context.Background(), batch, nil); err != nil {
			b.Fatal(err)
		}
		s.mu.Lock()
		s.drainLocked()
		s.mu.Unlock()
	}
	b.StopTimer()
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*100)/1000, "µs/task")
}

// BenchmarkLoadHerd: 400 000 tasks due at one instant beyond the horizon;
// the loader brings them into the wheel as the clock nears it. Reports the
// longest single load call (the shard lock is held for each: ingest and
// firing on the shard wait) and the calls taken. With one call for the
// whole herd that call held the lock for about 21 ms. The wheel is grown
// to the herd's size first, as a wheel that held such a herd before is:
// growing a fresh one to a new peak copies its arrays (a one-off of up to
// about 25 ms at 400 k entries on this machine, in whichever call crosses
// a doubling).
func BenchmarkLoadHerd(b *testing.B) {
	h := newHarness(b, func(o *Options) { o.Shards = 1; o.Logger = zap.NewNop(); o.Horizon = 10 * time.Minute })
	herd := t0.Add(time.Hour)
	const n = 400_000
	ingestHerd(h, n, herd)
	now := ms(herd.Add(-6 * time.Minute))
	s := h.e.shards[0]
	var longest time.Duration
	calls := 0
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		s.mu.Lock()
		s.w = wheel.New(ms(t0))
		s.w.Grow(n)
		s.horizonEnd, s.horizonSeq = ms(t0.Add(10*time.Minute)), 0
		for s.horizonEnd < now+s.e.horizonMs() {
			start := time.Now()
			if err := s.loadLocked(now); err != nil {
				b.Fatal(err)
			}
			longest = max(longest, time.Since(start))
			calls++
		}
		if s.w.Len() != n {
			b.Fatalf("%d in the wheel, want %d", s.w.Len(), n)
		}
		s.mu.Unlock()
	}
	b.ReportMetric(float64(longest.Microseconds())/1000, "max-ms/call")
	b.ReportMetric(float64(calls)/float64(b.N), "calls/herd")
}

// BenchmarkStatsDuringFiredHerd: 100 000 tasks due at one instant, 99 000
// of them fired and deleted (each leaves a deletion in the store), the
// rest still due. Stats finds the shard's next stored task by stepping
// over those deletions. Reports the time of a Stats call and the longest
// wait of a goroutine taking the shard's lock meanwhile (the fire loop and
// ingest): with the seek under the lock it was about the whole call.
func BenchmarkStatsDuringFiredHerd(b *testing.B) {
	h := newHarness(b, func(o *Options) { o.Shards = 1; o.Logger = zap.NewNop() })
	herd := t0.Add(time.Minute)
	const n, fired = 100_000, 99_000
	ingestHerd(h, n, herd)
	h.clk.Set(herd)
	s := h.e.shards[0]
	s.mu.Lock()
	del := h.e.db.NewBatch()
	s.w.AdvanceN(ms(herd), fired, func(due int64, seq uint64) {
		del.Delete(appendTaskKey(nil, s.id, due, seq), nil)
		s.pending--
	})
	if err := del.Commit(pebble.NoSync); err != nil {
		b.Fatal(err)
	}
	s.mu.Unlock()
	if st := h.e.Stats(); st.Pending != n-fired || !st.NextDue.Equal(herd) {
		b.Fatalf("stats %+v", st)
	}
	stop := make(chan struct{})
	var longest atomic.Int64
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			start := time.Now()
			s.mu.Lock()
			inWheel := s.w.Len() // what a fire loop or ingest would do under it
			s.mu.Unlock()
			if d := int64(time.Since(start)); d > longest.Load() && inWheel >= 0 {
				longest.Store(d)
			}
			time.Sleep(50 * time.Microsecond)
		}
	})
	b.ResetTimer()
	for b.Loop() {
		h.e.Stats()
	}
	b.StopTimer()
	close(stop)
	wg.Wait()
	b.ReportMetric(float64(b.Elapsed().Microseconds())/1000/float64(b.N), "stats-ms/op")
	b.ReportMetric(float64(longest.Load())/1e6, "max-lock-wait-ms")
}

// ingestHerd ingests n tasks h0..h(n-1) due at herd, in batches of 1000.
func ingestHerd(h *harness, n int, herd time.Time) {
	for i := 0; i < n; i += 1000 {
		var batch []codec.Task
		for j := i; j < min(i+1000, n); j++ {
			batch = append(batch, sched("h"+strconv.Itoa(j), herd, int64(j+1)))
		}
		h.ingest(batch)
	}
}

// BenchmarkProbeManyDownGroups: one probe (Engine.probe) of 4096 down
// target groups over 8 shards with no task waiting in memory, so each
// group costs a seek per shard for held tasks (markHeldGroups); "held" has one
// held task a group in the last shard, flushed. A probe round runs at
// most once per probeEvery/2, in a fire loop (review R193).
func BenchmarkProbeManyDownGroups(b *testing.B) {
	for _, held := range []bool{false, true} {
		b.Run(map[bool]string{false: "none", true: "held"}[held], func(b *testing.B) {
			e, err := Open(Options{Dir: b.TempDir(), Logger: zap.NewNop(), Shards: 8})
			if err != nil {
				b.Fatal(err)
			}
			defer e.Close()
			const groups = 4096
			gs := make([]int64, groups)
			for i := range gs {
				gs[i] = heldBase + int64(i)<<heldDueBits
			}
			if held {
				batch := e.db.NewBatch()
				for i, g := range gs {
					batch.Set(appendTaskKey(nil, 7, g+1000, uint64(i+1)), []byte("x"), nil)
				}
				if err := batch.Commit(pebble.NoSync); err != nil {
					b.Fatal(err)
				}
				if err := e.db.Flush(); err != nil {
					b.Fatal(err)
				}
			}
			b.ResetTimer()
			for b.Loop() {
				e.outages.mu.Lock()
				e.outages.m = make(map[int64]groupOutage, groups)
				for _, g := range gs {
					e.outages.m[g] = groupOutage{down: true}
				}
				e.outages.mu.Unlock()
				e.probe(gs, e.nowMs())
			}
		})
	}
}
