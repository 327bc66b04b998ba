package kafka

import (
	"bufio"
	"context"
	"fmt"
	"github.com/delaybridge/delaybridge/bridge"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"github.com/twmb/franz-go/pkg/kversion"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"

	"github.com/delaybridge/delaybridge/internal/testlog"
)

type reqCounter struct {
	mu sync.Mutex
	n  map[int16]int
}

func countRequests(c *kfake.Cluster) *reqCounter {
	rc := &reqCounter{n: map[int16]int{}}
	for _, k := range []int16{int16(kmsg.Fetch), int16(kmsg.ListOffsets), int16(kmsg.Metadata), int16(kmsg.OffsetCommit), int16(kmsg.Heartbeat)} {
		k := k
		c.ControlKey(k, func(kmsg.Request) (kmsg.Response, error, bool) {
			c.KeepControl()
			rc.mu.Lock()
			rc.n[k]++
			rc.mu.Unlock()
			return nil, nil, false
		})
	}
	return rc
}

func (r *reqCounter) snap() map[int16]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[int16]int{}
	for k, v := range r.n {
		out[k] = v
	}
	return out
}

// estConns counts established TCP connections whose remote port is one of ports.
func estConns(t testing.TB, addrs []string) int {
	ports := map[string]bool{}
	for _, a := range addrs {
		_, p, _ := strings.Cut(a, ":")
		n, _ := strconv.Atoi(p)
		ports[fmt.Sprintf("%04X", n)] = true
	}
	n := 0
	for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		fh, err := os.Open(f)
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(fh)
		for sc.Scan() {
			fs := strings.Fields(sc.Text())
			if len(fs) < 4 || fs[3] != "01" {
				continue
			}
			_, rp, _ := strings.Cut(fs[2], ":")
			if ports[rp] {
				n++
			}
		}
		fh.Close()
	}
	return n
}

func heapMB() (float64, float64) {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return float64(ms.HeapInuse) / (1 << 20), float64(ms.Sys) / (1 << 20)
}

// TestH193Idle (hunt H193, measurement) logs the requests, connections,
// goroutines and heap of an idle source on 3 and 256 partitions.
func TestH193Idle(t *testing.T) {
	measureOnly(t)
	for _, parts := range []int32{3, 256} {
		t.Run(strconv.Itoa(int(parts)), func(t *testing.T) {
			c := newCluster(t, kfake.NumBrokers(3), kfake.SeedTopics(parts, "delay"))
			cl := producer(t, c)
			produceN(t, cl, "delay", parts, 0, int(parts))
			rc := countRequests(c)
			h := newMemHandler()
			cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
			cfg.MaxWait = 500 * time.Millisecond
			cfg.Logger = testlog.New(t, zaptest.Level(zapcore.WarnLevel))
			hBefore, _ := heapMB()
			g0 := runtime.NumGoroutine()
			s, err := NewSource(cfg)
			if err != nil {
				t.Fatal(err)
			}
			stop := runSource(t, s, h)
			waitFor(t, "all read", func() bool { return h.count() == int(parts) })
			<-s.CaughtUp()
			time.Sleep(time.Second)
			a := rc.snap()
			time.Sleep(4 * time.Second)
			b := rc.snap()
			hAfter, sys := heapMB()
			t.Logf("parts=%d idle 4s: fetch/s=%.1f listoffsets/s=%.1f metadata/s=%.1f commit/s=%.1f hb/s=%.1f conns=%d goroutines=%d heap_inuse=%.1fMB(before %.1f) sys=%.1fMB",
				parts, float64(b[int16(kmsg.Fetch)]-a[int16(kmsg.Fetch)])/4, float64(b[int16(kmsg.ListOffsets)]-a[int16(kmsg.ListOffsets)])/4,
				float64(b[int16(kmsg.Metadata)]-a[int16(kmsg.Metadata)])/4, float64(b[int16(kmsg.OffsetCommit)]-a[int16(kmsg.OffsetCommit)])/4,
				float64(b[int16(kmsg.Heartbeat)]-a[int16(kmsg.Heartbeat)])/4,
				estConns(t, c.ListenAddrs()), runtime.NumGoroutine()-g0, hAfter, hBefore, sys)
			_ = stop()
		})
	}
}

// TestH193Trickle (measurement) logs lateness, Handle calls, fetches and
// offset commits at 50 msg/s spread by key (H193_PARTS: partitions).
func TestH193Trickle(t *testing.T) {
	measureOnly(t)
	parts := h193Parts()[len(h193Parts())-1]
	c := newCluster(t, kfake.NumBrokers(3), kfake.SeedTopics(parts, "delay"))
	cl := producer(t, c, kgo.RecordPartitioner(kgo.StickyKeyPartitioner(nil)))
	rc := countRequests(c)
	var handled atomic.Int64
	var latSum, latMax atomic.Int64
	h := newMemHandler()
	calls := atomic.Int64{}
	h.setFail(func(_ context.Context, b *bridge.Batch) error {
		calls.Add(1)
		now := time.Now()
		for _, it := range b.Items {
			l := now.Sub(it.Msg.Time).Microseconds()
			latSum.Add(l)
			for {
				m := latMax.Load()
				if l <= m || latMax.CompareAndSwap(m, l) {
					break
				}
			}
			handled.Add(1)
		}
		return nil
	})
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
	cfg.MaxWait = 500 * time.Millisecond
	cfg.Logger = testlog.New(t, zaptest.Level(zapcore.WarnLevel))
	s, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	runSource(t, s, h)
	<-s.CaughtUp()
	time.Sleep(500 * time.Millisecond)
	a := rc.snap()
	c0 := calls.Load()
	const secs, rate = 4, 50
	tick := time.NewTicker(time.Second / rate)
	for i := range secs * rate {
		<-tick.C
		cl.Produce(context.Background(), &kgo.Record{Topic: "delay", Key: []byte("key" + strconv.Itoa(i)), Value: []byte("v")}, nil)
	}
	tick.Stop()
	waitFor(t, "all", func() bool { return handled.Load() == secs*rate })
	b := rc.snap()
	n := handled.Load()
	t.Logf("%d parts %d msg/s for %ds: handle calls=%d, mean lateness=%.1fms max=%.1fms, fetch/s=%.1f, commits/s=%.1f, listoffsets=%d",
		parts, rate, secs, calls.Load()-c0, float64(latSum.Load())/float64(n)/1000, float64(latMax.Load())/1000,
		float64(b[int16(kmsg.Fetch)]-a[int16(kmsg.Fetch)])/secs, float64(b[int16(kmsg.OffsetCommit)]-a[int16(kmsg.OffsetCommit)])/secs,
		b[int16(kmsg.ListOffsets)]-a[int16(kmsg.ListOffsets)])
}

func checkAllOnce(t *testing.T, h *memHandler, c *kfake.Cluster, topic string, parts int32, perPart map[int32]int64) {
	t.Helper()
	offs := h.offsets(topic)
	for p := range parts {
		seen := map[int64]bool{}
		for _, o := range offs[p] {
			if seen[o] {
				t.Errorf("%s/%d offset %d twice", topic, p, o)
			}
			seen[o] = true
		}
		if int64(len(seen)) != perPart[p] {
			t.Errorf("%s/%d: stored %d want %d", topic, p, len(seen), perPart[p])
		}
	}
}

// TestH193AddPartitionsAndTopics: 128 partitions grown to 256 while
// running, then restarts with other kafka.topics lists: every record stored
// once, offsets committed for every partition.
func TestH193AddPartitionsAndTopics(t *testing.T) {
	c := newCluster(t, kfake.NumBrokers(3), kfake.SeedTopics(128, "delay"), kfake.SeedTopics(64, "delay2"), kfake.SeedTopics(32, "delay3"))
	cl := producer(t, c)
	h := newMemHandler()
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay", "delay2")
	cfg.Logger = testlog.New(t, zaptest.Level(zapcore.WarnLevel))
	s, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop := runSource(t, s, h)
	produceN(t, cl, "delay", 128, 0, 1280)
	produceN(t, cl, "delay2", 64, 0, 640)
	waitFor(t, "first", func() bool { return h.count() == 1920 })
	addPartitions(t, cl, "delay", 256)
	t0 := time.Now()
	// publish to the new partitions too, right away (before the watcher noticed)
	cl = producer(t, c)
	produceN(t, cl, "delay", 256, 1280, 2560)
	waitFor(t, "after growth", func() bool { return h.count() == 1920+2560 })
	t.Logf("growth handled in %v", time.Since(t0))
	waitFor(t, "commits", func() bool {
		cm := committed(c, "g", "delay")
		for p := range int32(256) {
			want := int64(10)
			if p < 128 {
				want = 20
			}
			if cm[p] != want {
				return false
			}
		}
		return true
	})
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	// restart with another topic list
	cfg2 := testConfig(t, c.ListenAddrs(), "g", "delay2", "delay3")
	cfg2.Logger = cfg.Logger
	s2, err := NewSource(cfg2)
	if err != nil {
		t.Fatal(err)
	}
	produceN(t, cl, "delay", 256, 0, 256)
	produceN(t, cl, "delay3", 32, 0, 320)
	t1 := time.Now()
	stop2 := runSource(t, s2, h)
	waitFor(t, "second run", func() bool { return h.count() == 1920+2560+320 })
	t.Logf("second run caught up in %v", time.Since(t1))
	if err := stop2(); err != nil {
		t.Fatal(err)
	}
	cfg3 := testConfig(t, c.ListenAddrs(), "g", "delay", "delay2", "delay3")
	cfg3.Logger = cfg.Logger
	s3, err := NewSource(cfg3)
	if err != nil {
		t.Fatal(err)
	}
	t2 := time.Now()
	stop3 := runSource(t, s3, h)
	waitFor(t, "third run", func() bool { return h.count() == 1920+2560+320+256 })
	<-s3.CaughtUp()
	t.Logf("third run caught up in %v", time.Since(t2))
	time.Sleep(500 * time.Millisecond)
	if err := stop3(); err != nil {
		t.Fatal(err)
	}
	pp := map[int32]int64{}
	for p := range int32(256) {
		pp[p] = 11
		if p < 128 {
			pp[p] = 21
		}
	}
	checkAllOnce(t, h, c, "delay", 256, pp)
	p2 := map[int32]int64{}
	for p := range int32(64) {
		p2[p] = 10
	}
	checkAllOnce(t, h, c, "delay2", 64, p2)
	p3 := map[int32]int64{}
	for p := range int32(32) {
		p3[p] = 10
	}
	checkAllOnce(t, h, c, "delay3", 32, p3)
	for _, tp := range []string{"delay", "delay2", "delay3"} {
		cm := committed(c, "g", tp)
		t.Logf("%s commits: %d partitions", tp, len(cm))
	}
}

// slowCountHandler stores nothing but checkpoints; Handle holds one global lock
// for a fixed time, as a serialized fsync would.
type slowCountHandler struct {
	mu    sync.Mutex
	n     int
	cps   map[string]int64
	delay time.Duration
}

func (h *slowCountHandler) Handle(ctx context.Context, b *bridge.Batch) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	time.Sleep(h.delay)
	h.n += len(b.Items)
	for _, cp := range b.Checkpoints {
		h.cps[cp.Key] = cp.Offset
	}
	return nil
}
func (h *slowCountHandler) Checkpoint(key string) (int64, bool, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	o, ok := h.cps[key]
	return o, ok, nil
}
func (h *slowCountHandler) count() int { h.mu.Lock(); defer h.mu.Unlock(); return h.n }

// TestH193BacklogMemory (measurement) logs the peak heap while the same
// backlog is read over few and many partitions (H193_PARTS, H193_TOTAL).
func TestH193BacklogMemory(t *testing.T) {
	measureOnly(t)
	total := 96000
	if os.Getenv("H193_TOTAL") != "" {
		total, _ = strconv.Atoi(os.Getenv("H193_TOTAL"))
	}
	val := make([]byte, 1000)
	for i := range val {
		val[i] = byte('a' + i%26)
	}
	for _, parts := range h193Parts() {
		t.Run(strconv.Itoa(int(parts)), func(t *testing.T) {
			c := newCluster(t, kfake.NumBrokers(3), kfake.SeedTopics(parts, "delay"))
			cl := producer(t, c)
			for start := 0; start < total; start += 2000 {
				rs := make([]*kgo.Record, 0, 2000)
				for i := start; i < start+2000; i++ {
					rs = append(rs, &kgo.Record{Topic: "delay", Partition: int32(i) % parts, Key: []byte(strconv.Itoa(i)), Value: val})
				}
				produce(t, cl, rs...)
			}
			h := &slowCountHandler{cps: map[string]int64{}, delay: 3 * time.Millisecond}
			cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
			cfg.Logger = testlog.New(t, zaptest.Level(zapcore.WarnLevel))
			runtime.GC()
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			base := ms.HeapInuse
			s, err := NewSource(cfg)
			if err != nil {
				t.Fatal(err)
			}
			var peak uint64
			done := make(chan struct{})
			go func() {
				for {
					select {
					case <-done:
						return
					case <-time.After(20 * time.Millisecond):
					}
					var ms runtime.MemStats
					runtime.ReadMemStats(&ms)
					peak = max(peak, ms.HeapInuse)
				}
			}()
			t0 := time.Now()
			stop := runSource(t, s, h)
			waitFor(t, "all", func() bool { return h.count() == total })
			close(done)
			t.Logf("parts=%d backlog %d x 1KB: took %v, heap in use peak %.1f MB over base %.1f MB", parts, total, time.Since(t0),
				float64(peak-base)/(1<<20), float64(base)/(1<<20))
			_ = stop()
		})
	}
}

func h193Parts() []int32 {
	if s := os.Getenv("H193_PARTS"); s != "" {
		var out []int32
		for _, f := range strings.Split(s, ",") {
			n, _ := strconv.Atoi(f)
			out = append(out, int32(n))
		}
		return out
	}
	return []int32{4, 128}
}

// TestH193LeaderMoveMany (measurement): a third of 128 leaders move.
func TestH193LeaderMoveMany(t *testing.T) {
	measureOnly(t)
	const parts = 128
	c := newCluster(t, kfake.NumBrokers(3), kfake.SeedTopics(parts, "delay"))
	cl := producer(t, c)
	rc := countRequests(c)
	h := newMemHandler()
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
	cfg.MetadataTTL = time.Hour
	cfg.RetryMax = 10 * time.Second
	cfg.RetryMin = 100 * time.Millisecond
	cfg.MaxWait = 500 * time.Millisecond
	cfg.Logger = testlog.New(t, zaptest.Level(zapcore.ErrorLevel))
	s, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	runSource(t, s, h)
	produceN(t, cl, "delay", parts, 0, parts)
	waitFor(t, "first", func() bool { return h.count() == parts })
	moved := 0
	for p := range int32(parts) {
		if l := c.LeaderFor("delay", p); l == 0 {
			if err := c.MoveTopicPartition("delay", p, 1); err != nil {
				t.Fatal(err)
			}
			moved++
		}
	}
	a := rc.snap()
	t0 := time.Now()
	cl = producer(t, c)
	produceN(t, cl, "delay", parts, parts, parts)
	waitFor(t, "after move", func() bool { return h.count() == 2*parts })
	el := time.Since(t0)
	b := rc.snap()
	t.Logf("moved %d leaders: all read again after %v; metadata reqs=%d fetch reqs=%d listoffsets=%d",
		moved, el, b[int16(kmsg.Metadata)]-a[int16(kmsg.Metadata)], b[int16(kmsg.Fetch)]-a[int16(kmsg.Fetch)], b[int16(kmsg.ListOffsets)]-a[int16(kmsg.ListOffsets)])
}

// TestH193StoreAheadOfGroupMany: the group's offsets of 128 partitions
// behind the store (a crash between store and offset commit): nothing is
// stored twice, and every partition's offset is caught up.
func TestH193StoreAheadOfGroupMany(t *testing.T) {
	const parts = 128
	c := newCluster(t, kfake.NumBrokers(3), kfake.SeedTopics(parts, "delay"))
	cl := producer(t, c)
	h := newMemHandler()
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
	cfg.Logger = testlog.New(t, zaptest.Level(zapcore.WarnLevel))
	s, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop := runSource(t, s, h)
	produceN(t, cl, "delay", parts, 0, 10*parts)
	waitFor(t, "all", func() bool { return h.count() == 10*parts })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	// A crash between store commit and offset commit: the group is behind
	// (offset 3 everywhere, group empty now).
	req := kmsg.NewPtrOffsetCommitRequest()
	req.Group = "g"
	req.Generation = -1
	rt := kmsg.NewOffsetCommitRequestTopic()
	rt.Topic = "delay"
	for p := range int32(parts) {
		rp := kmsg.NewOffsetCommitRequestTopicPartition()
		rp.Partition, rp.Offset = p, 3
		rt.Partitions = append(rt.Partitions, rp)
	}
	req.Topics = append(req.Topics, rt)
	old := producer(t, c, kgo.MaxVersions(kversion.V3_0_0()))
	resp, err := req.RequestWith(context.Background(), old)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range resp.Topics[0].Partitions {
		if p.ErrorCode != 0 {
			t.Fatalf("commit %d: %d", p.Partition, p.ErrorCode)
		}
	}
	if cm := committed(c, "g", "delay"); cm[5] != 3 || cm[127] != 3 {
		t.Fatalf("reset did not take: %v", cm)
	}
	produceN(t, cl, "delay", parts, 10*parts, parts)
	s2, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop2 := runSource(t, s2, h)
	waitFor(t, "caught up commits", func() bool {
		cm := committed(c, "g", "delay")
		for p := range int32(parts) {
			if cm[p] != 11 {
				return false
			}
		}
		return true
	})
	if err := stop2(); err != nil {
		t.Fatal(err)
	}
	pp := map[int32]int64{}
	for p := range int32(parts) {
		pp[p] = 11
	}
	checkAllOnce(t, h, c, "delay", parts, pp)
}

// measureOnly skips the H193 measurements (they log figures and assert
// nothing) unless DELAYBRIDGE_H193 is set.
func measureOnly(t *testing.T) {
	t.Helper()
	if os.Getenv("DELAYBRIDGE_H193") == "" {
		t.Skip("measurement; set DELAYBRIDGE_H193=1")
	}
}
