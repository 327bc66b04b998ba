package kafka

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/metrics"
	"github.com/delaybridge/delaybridge/shard"
)

// javaMurmur2 are Apache Kafka's own UtilsTest.testMurmur2 vectors: what
// Utils.murmur2 returns in Java, as a signed int.
var javaMurmur2 = []struct {
	key  string
	hash int32
}{
	{"21", -973932308},
	{"foobar", -790332482},
	{"a-little-bit-long-string", -985981536},
	{"a-little-bit-longer-string", -1486304829},
	{"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971},
	{"abc", 479470107},
}

// javaPartition is the Java default partitioner for a keyed record:
// Utils.toPositive(Utils.murmur2(key)) % numPartitions.
func javaPartition(hash int32, n int) int { return int(uint32(hash)&0x7fffffff) % n }

func TestSinkBalancerMatchesJava(t *testing.T) {
	s, err := NewSink(Config{Brokers: []string{"127.0.0.1:1"}})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for _, n := range []int{1, 3, 8, 12} {
		parts := make([]int, n)
		for i := range parts {
			parts[i] = i
		}
		for _, v := range javaMurmur2 {
			got := s.gen.w.Balancer.Balance(kafkago.Message{Key: []byte(v.key)}, parts...)
			if want := javaPartition(v.hash, n); got != want {
				t.Errorf("key %q over %d partitions: got %d, Java %d", v.key, n, got, want)
			}
		}
	}
	// Pinned partitions for 8 partitions, computed by hand from the Java
	// hashes so a change to javaPartition cannot hide a regression.
	for key, want := range map[string]int{"21": 4, "foobar": 6, "abc": 3} {
		if got := s.gen.w.Balancer.Balance(kafkago.Message{Key: []byte(key)}, 0, 1, 2, 3, 4, 5, 6, 7); got != want {
			t.Errorf("key %q: partition %d, want %d", key, got, want)
		}
	}
}

func consumeAll(t *testing.T, c *kfake.Cluster, topic string, n int) []*kgo.Record {
	t.Helper()
	cl := producer(t, c, kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.FetchMaxWait(100*time.Millisecond))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var out []*kgo.Record
	for len(out) < n {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("consumed %d of %d from %s", len(out), n, topic)
		}
		fs.EachRecord(func(r *kgo.Record) { out = append(out, r) })
	}
	return out
}

func task(target, key, value string, headers ...codec.Header) *codec.Task {
	t := &codec.Task{Kind: codec.KindSchedule, Transport: codec.TransportKafka, Target: target, Value: []byte(value), Headers: headers}
	if key != "" {
		t.Key = []byte(key)
	}
	return t
}

func TestSinkDeliversExactly(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(8, "out"), kfake.SeedTopics(1, "other"))
	m := metrics.New(nil)
	cfg := testConfig(t, c.ListenAddrs(), "")
	cfg.Metrics = m
	s, err := NewSink(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var batch []*codec.Task
	for _, v := range javaMurmur2 {
		batch = append(batch, task("out", v.key, "value-"+v.key,
			codec.Header{Key: "delay-id", Value: []byte(v.key)},
			codec.Header{Key: "dup", Value: []byte("1")}, codec.Header{Key: "dup", Value: []byte("2")},
			codec.Header{Key: "empty", Value: []byte{}}))
	}
	batch = append(batch, task("other", "", "no key"))
	if errs := s.Deliver(context.Background(), batch); errs != nil {
		t.Fatalf("Deliver: %v", errs)
	}

	recs := consumeAll(t, c, "out", len(javaMurmur2))
	byKey := map[string]*kgo.Record{}
	for _, r := range recs {
		byKey[string(r.Key)] = r
	}
	for _, v := range javaMurmur2 {
		r := byKey[v.key]
		if r == nil {
			t.Fatalf("key %q not delivered", v.key)
		}
		if string(r.Value) != "value-"+v.key {
			t.Errorf("key %q: value %q", v.key, r.Value)
		}
		if want := javaPartition(v.hash, 8); int(r.Partition) != want {
			t.Errorf("key %q: partition %d, Java puts it on %d", v.key, r.Partition, want)
		}
		want := []kgo.RecordHeader{{Key: "delay-id", Value: []byte(v.key)}, {Key: "dup", Value: []byte("1")}, {Key: "dup", Value: []byte("2")}, {Key: "empty", Value: []byte{}}}
		if !slices.EqualFunc(r.Headers, want, func(a, b kgo.RecordHeader) bool { return a.Key == b.Key && bytes.Equal(a.Value, b.Value) }) {
			t.Errorf("key %q: headers %v, want %v", v.key, r.Headers, want)
		}
	}
	other := consumeAll(t, c, "other", 1)
	if other[0].Key != nil || string(other[0].Value) != "no key" {
		t.Errorf("other: key %q value %q", other[0].Key, other[0].Value)
	}
	if time.Since(other[0].Timestamp) > time.Minute || time.Since(other[0].Timestamp) < 0 {
		t.Errorf("record timestamp %v is not the publish time", other[0].Timestamp)
	}
	if n := testutilCount(t, m); n != 1 {
		t.Errorf("publish_seconds observations %d, want 1", n)
	}
}

func testutilCount(t *testing.T, m *metrics.Metrics) uint64 {
	t.Helper()
	h, err := m.PublishSeconds.GetMetricWithLabelValues("kafka")
	if err != nil {
		t.Fatal(err)
	}
	var pb dto.Metric
	if err := h.(prometheus.Metric).Write(&pb); err != nil {
		t.Fatal(err)
	}
	return pb.GetHistogram().GetSampleCount()
}

// A task for a topic that does not exist fails alone, with an error the
// engine retries (and dead-letters as publish-failed once exhausted); the
// others of the batch are delivered.
func TestSinkMissingTopicFailsPerTask(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(2, "out"))
	s, err := NewSink(testConfig(t, c.ListenAddrs(), ""))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	batch := []*codec.Task{task("out", "a", "1"), task("missing", "b", "2"), task("out", "c", "3"), task("", "d", "4")}
	for attempt := range 2 { // the engine's retry gets the same answer
		errs := s.Deliver(context.Background(), batch)
		if len(errs) != len(batch) {
			t.Fatalf("attempt %d: errs %v", attempt, errs)
		}
		if errs[0] != nil || errs[2] != nil {
			t.Errorf("attempt %d: tasks to an existing topic failed: %v %v", attempt, errs[0], errs[2])
		}
		if !errors.Is(errs[1], kafkago.UnknownTopicOrPartition) {
			t.Errorf("attempt %d: missing topic: %v, want UnknownTopicOrPartition", attempt, errs[1])
		}
		if !errors.Is(errs[3], ErrNoTopic) {
			t.Errorf("attempt %d: empty target: %v, want ErrNoTopic", attempt, errs[3])
		}
	}
	if c.TopicInfo("missing") != nil {
		t.Fatal("the sink created the missing topic")
	}
	recs := consumeAll(t, c, "out", 4)
	if len(recs) != 4 {
		t.Fatalf("got %d records", len(recs))
	}
}

// Produce errors from the broker come back per task; after the fault is
// removed the same tasks are delivered.
func TestSinkProduceFaultThenRecovery(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "out"), kfake.SeedTopics(1, "fine"))
	cfg := testConfig(t, c.ListenAddrs(), "")
	cfg.WriteAttempts = 2
	s, err := NewSink(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	fault := c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: "out", Err: kerr.NotEnoughReplicas, Count: -1})
	batch := []*codec.Task{task("out", "a", "1"), task("fine", "b", "2"), task("out", "c", "3")}
	errs := s.Deliver(context.Background(), batch)
	if len(errs) != 3 || !errors.Is(errs[0], kafkago.NotEnoughReplicas) || errs[1] != nil || !errors.Is(errs[2], kafkago.NotEnoughReplicas) {
		t.Fatalf("errs %v: want NotEnoughReplicas for topic out only", errs)
	}
	if hits := fault.Hits(); hits < cfg.WriteAttempts {
		t.Errorf("fault hit %d times, want the writer's %d attempts", hits, cfg.WriteAttempts)
	}
	fault.Remove()
	if errs := s.Deliver(context.Background(), []*codec.Task{batch[0], batch[2]}); errs != nil {
		t.Fatalf("after recovery: %v", errs)
	}
	recs := consumeAll(t, c, "out", 2)
	if string(recs[0].Value) != "1" || string(recs[1].Value) != "3" {
		t.Fatalf("delivered %q %q", recs[0].Value, recs[1].Value)
	}
}

// A record over BatchBytes is sent in a batch of its own, where the
// broker's limit decides: refused there, it fails alone as refused.
func TestSinkTooLargeFailsAlone(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "out"), kfake.BrokerConfigs(map[string]string{"message.max.bytes": "1000"}))
	cfg := testConfig(t, c.ListenAddrs(), "")
	cfg.BatchBytes = 1000
	s, err := NewSink(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	big := string(bytes.Repeat([]byte("x"), 1000))
	errs := s.Deliver(context.Background(), []*codec.Task{task("out", "a", "small"), task("out", "b", big)})
	if len(errs) != 2 || errs[0] != nil || !errors.Is(errs[1], shard.ErrRefused) || !errors.Is(errs[1], kafkago.MessageSizeTooLarge) {
		t.Fatalf("errs %v", errs)
	}
	consumeAll(t, c, "out", 1)
}

func TestRecordSizeMatchesKafkaGo(t *testing.T) {
	// kafka-go refuses a message whose size exceeds BatchBytes with
	// MessageTooLargeError; recordSize must agree with it at the edge.
	for _, m := range []kafkago.Message{
		{Topic: "t", Value: []byte("v")},
		{Topic: "t", Key: []byte("key"), Value: bytes.Repeat([]byte("v"), 300), Headers: []kafkago.Header{{Key: "h", Value: []byte("x")}}},
		{Topic: "t", Headers: []kafkago.Header{{Key: string(bytes.Repeat([]byte("h"), 200)), Value: bytes.Repeat([]byte("x"), 70)}}},
	} {
		size := recordSize(&m)
		for _, limit := range []int{size - 1, size} {
			w := &kafkago.Writer{Addr: kafkago.TCP("127.0.0.1:1"), BatchBytes: int64(limit)}
			ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
			err := w.WriteMessages(ctx, m)
			cancel()
			_ = w.Close()
			var tooLarge kafkago.MessageTooLargeError
			if got := errors.As(err, &tooLarge); got != (limit < size) {
				t.Errorf("size %d, limit %d: kafka-go too large = %v (err %v)", size, limit, got, err)
			}
		}
	}
}

// A task with a nil value is published as a null value (a tombstone), an
// empty value as an empty one.
func TestSinkNullAndEmptyValues(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "out"))
	s, err := NewSink(testConfig(t, c.ListenAddrs(), ""))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	null := &codec.Task{Target: "out", Key: []byte("gone"), Value: nil}
	empty := &codec.Task{Target: "out", Key: []byte("empty"), Value: []byte{}}
	if errs := s.Deliver(context.Background(), []*codec.Task{null, empty}); errs != nil {
		t.Fatal(errs)
	}
	recs := consumeAll(t, c, "out", 2)
	if recs[0].Value != nil || recs[1].Value == nil || len(recs[1].Value) != 0 {
		t.Fatalf("values %#v %#v: want null then empty", recs[0].Value, recs[1].Value)
	}
}

func TestSinkHealth(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	cfg := testConfig(t, []string{addr}, "")
	cfg.DialTimeout = 200 * time.Millisecond
	s, err := NewSink(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if errs := s.Deliver(context.Background(), []*codec.Task{task("out", "k", "v")}); len(errs) != 1 || !errors.Is(errs[0], shard.ErrUnavailable) {
		t.Fatalf("Deliver to nowhere: %v, want shard.ErrUnavailable", errs)
	}
	if err := s.Health(); err == nil {
		t.Fatal("Health nil with no broker")
	}

	c := newCluster(t, kfake.SeedTopics(1, "out"))
	ok, err := NewSink(testConfig(t, c.ListenAddrs(), ""))
	if err != nil {
		t.Fatal(err)
	}
	defer ok.Close()
	// A missing topic is the task's problem, not the sink's.
	if errs := ok.Deliver(context.Background(), []*codec.Task{task("missing", "k", "v")}); len(errs) != 1 || errs[0] == nil || errors.Is(errs[0], shard.ErrUnavailable) {
		t.Fatalf("Deliver to a missing topic: %v, want a failure that is not shard.ErrUnavailable", errs)
	}
	if err := ok.Health(); err != nil {
		t.Fatalf("Health after a missing topic: %v", err)
	}

	// The broker is reachable but drops the connection on every produce:
	// each record fails without an answer, so the sink is not healthy.
	var drop atomic.Bool
	drop.Store(true)
	c.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if drop.Load() {
			return nil, errors.New("injected: connection dropped"), true
		}
		return nil, nil, false
	})
	if errs := ok.Deliver(context.Background(), []*codec.Task{task("out", "k", "v")}); len(errs) != 1 || !errors.Is(errs[0], shard.ErrUnavailable) {
		t.Fatalf("Deliver with produces dropped: %v, want shard.ErrUnavailable", errs)
	}
	if err := ok.Health(); err == nil {
		t.Fatal("Health nil while every produce connection is dropped")
	}
	drop.Store(false)
	if errs := ok.Deliver(context.Background(), []*codec.Task{task("out", "k", "v")}); errs != nil {
		t.Fatalf("Deliver after the drops: %v", errs)
	}
	if err := ok.Health(); err != nil {
		t.Fatalf("Health after a successful publish: %v", err)
	}
}

// TestPublishErrorClass: a publish failure is unavailable (the engine
// retries it without charging an attempt), refused (the broker will never
// take this record as is: a dead letter the DLQ refuses so may be parked),
// or neither (the topic as a whole fails: missing, not authorized; a dead
// letter to it holds its source until the operator fixes the topic).
func TestPublishErrorClass(t *testing.T) {
	for _, c := range []struct {
		name                 string
		err                  error
		unavailable, refused bool
	}{
		{"connection refused", &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}, true, false},
		{"dropped connection", io.EOF, true, false},
		{"timeout", context.DeadlineExceeded, true, false},
		{"no leader", kafkago.LeaderNotAvailable, true, false},
		{"leader moved", kafkago.NotLeaderForPartition, true, false},
		{"too few in-sync replicas", kafkago.NotEnoughReplicas, true, false},
		{"storage error", kafkago.KafkaStorageError, true, false},
		{"sasl failed", kafkago.SASLAuthenticationFailed, true, false},
		{"tls", fmt.Errorf("%w: x509: certificate signed by unknown authority", ErrTLS), true, false},
		{"missing topic", kafkago.UnknownTopicOrPartition, false, false},
		{"record too large", kafkago.MessageSizeTooLarge, false, true},
		{"too large for the writer", kafkago.MessageTooLargeError{}, false, true},
		{"invalid record", kafkago.InvalidRecord, false, true},
		{"corrupt record", kafkago.InvalidMessage, false, true},
		{"topic not authorized", kafkago.TopicAuthorizationFailed, false, false},
		{"policy violation", kafkago.PolicyViolation, false, false},
		{"cancelled", context.Canceled, false, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := publishError("out", c.err)
			if got := errors.Is(err, shard.ErrUnavailable); got != c.unavailable {
				t.Fatalf("%v: unavailable %v, want %v", err, got, c.unavailable)
			}
			if got := errors.Is(err, shard.ErrRefused); got != c.refused {
				t.Fatalf("%v: refused %v, want %v", err, got, c.refused)
			}
			if !strings.Contains(err.Error(), c.err.Error()) {
				t.Fatalf("%v does not say %v", err, c.err)
			}
		})
	}
}

// TestSinkRefusals: through a broker, the per-record refusals
// (MESSAGE_TOO_LARGE, INVALID_RECORD, CORRUPT_MESSAGE, RECORD_LIST_TOO_LARGE
// and the sink's own size check) wrap shard.ErrRefused; a topic the principal may not write
// and a missing topic do not (nor ErrUnavailable): a dead letter to such a
// DLQ must hold its source, never be parked.
func TestSinkRefusals(t *testing.T) {
	for _, c := range []struct {
		name    string
		fault   *kerr.Error // on the produce to topic "out"; nil: none
		target  string
		big     bool
		refused bool
	}{
		{"message too large", kerr.MessageTooLarge, "out", false, true},
		{"invalid record", kerr.InvalidRecord, "out", false, true},
		{"corrupt message", kerr.CorruptMessage, "out", false, true},
		{"record list too large", kerr.RecordListTooLarge, "out", false, true},
		{"over batch bytes", nil, "out", true, true},
		{"topic not authorized", kerr.TopicAuthorizationFailed, "out", false, false},
		{"policy violation", kerr.PolicyViolation, "out", false, false},
		{"missing topic", nil, "missing", false, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			opts := []kfake.Opt{kfake.SeedTopics(1, "out"), kfake.SeedTopics(1, "fine")}
			if c.big { // over BatchBytes, the broker's limit decides
				opts = append(opts, kfake.BrokerConfigs(map[string]string{"message.max.bytes": "1000"}))
			}
			cl := newCluster(t, opts...)
			cfg := testConfig(t, cl.ListenAddrs(), "")
			cfg.WriteAttempts = 1
			cfg.BatchBytes = 1000
			s, err := NewSink(cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			if c.fault != nil {
				cl.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: "out", Err: c.fault, Count: -1})
			}
			v := "v"
			if c.big {
				v = string(bytes.Repeat([]byte("x"), 1000))
			}
			errs := s.Deliver(context.Background(), []*codec.Task{task(c.target, "a", v), task("fine", "b", "ok")})
			if len(errs) != 2 || errs[0] == nil || errs[1] != nil {
				t.Fatalf("errs %v: want the first to fail alone", errs)
			}
			if got := errors.Is(errs[0], shard.ErrRefused); got != c.refused {
				t.Fatalf("%v: refused %v, want %v", errs[0], got, c.refused)
			}
			if errors.Is(errs[0], shard.ErrUnavailable) {
				t.Fatalf("%v: unavailable", errs[0])
			}
		})
	}
}

// TestSinkMissingTopicsAmongMany: a batch over many topics of which some
// are missing (a deleted tenant's) fails only the missing topics' tasks,
// with the same error as alone, and delivers the rest; a batch of missing
// topics only fails them all. The sink takes the missing ones from the
// transport's metadata and sends the rest in one call (one call per topic
// in a row cost a produce round trip per distinct topic: 11x slower for
// 512 topics, see BenchmarkSinkMissingTopicAmongMany).
func TestSinkMissingTopicsAmongMany(t *testing.T) {
	var good []string
	for i := range 20 {
		good = append(good, fmt.Sprintf("tenant-%d", i))
	}
	c := newCluster(t, kfake.SeedTopics(1, good...))
	s, err := NewSink(testConfig(t, c.ListenAddrs(), ""))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for _, tc := range []struct {
		name    string
		topics  []string
		missing map[string]bool
	}{
		{"one missing among 20", append(slices.Clone(good), "gone-0"), map[string]bool{"gone-0": true}},
		{"two missing among 20", append([]string{"gone-1"}, append(slices.Clone(good), "gone-2")...), map[string]bool{"gone-1": true, "gone-2": true}},
		{"only missing", []string{"gone-3", "gone-4"}, map[string]bool{"gone-3": true, "gone-4": true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var batch []*codec.Task
			for i, tp := range tc.topics {
				batch = append(batch, task(tp, fmt.Sprint("k", i), tc.name), task(tp, fmt.Sprint("l", i), tc.name))
			}
			errs := s.Deliver(context.Background(), batch)
			for i, tk := range batch {
				var e error
				if errs != nil {
					e = errs[i]
				}
				switch {
				case tc.missing[tk.Target] && !errors.Is(e, kafkago.UnknownTopicOrPartition):
					t.Errorf("task to missing %s: %v, want UnknownTopicOrPartition", tk.Target, e)
				case !tc.missing[tk.Target] && e != nil:
					t.Errorf("task to %s failed: %v", tk.Target, e)
				}
			}
		})
	}
}

// BenchmarkSinkMissingTopicAmongMany: a batch of 512 tasks over 128
// topics, all there or one missing: the missing topic costs about one
// metadata answer, not a produce round trip per topic in a row.
func BenchmarkSinkMissingTopicAmongMany(b *testing.B) {
	var topics []string
	for i := range 128 {
		topics = append(topics, fmt.Sprintf("tenant-%d", i))
	}
	c := newCluster(b, kfake.SeedTopics(1, topics...))
	s, err := NewSink(testConfig(b, c.ListenAddrs(), ""))
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	for _, missing := range []bool{false, true} {
		name := "all-there"
		if missing {
			name = "one-missing"
		}
		b.Run(name, func(b *testing.B) {
			var batch []*codec.Task
			for i := range 512 {
				tp := topics[i%len(topics)]
				if missing && i%len(topics) == 0 {
					tp = "gone"
				}
				batch = append(batch, task(tp, fmt.Sprint("k", i), "v"))
			}
			for b.Loop() {
				s.Deliver(context.Background(), batch)
			}
		})
	}
}

// TestSinkRetiresWritersPastMaxTopics: kafka-go's Writer keeps a
// partition writer and a goroutine for every topic-partition it wrote to,
// until Close (measured by a many-targets hunt: 4.85 KB and a goroutine
// each, never released). The sink moves to fresh producers once one pair
// has written to maxWriterTopics topics and closes the old pair when the
// last Deliver using it returns; concurrent calls keep delivering through
// the change, and every record arrives.
func TestSinkRetiresWritersPastMaxTopics(t *testing.T) {
	old := maxWriterTopics
	maxWriterTopics = 8
	t.Cleanup(func() { maxWriterTopics = old })
	var topics []string
	for i := range 40 {
		topics = append(topics, fmt.Sprintf("tenant-%d", i))
	}
	c := newCluster(t, kfake.SeedTopics(1, topics...))
	s, err := NewSink(testConfig(t, c.ListenAddrs(), ""))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var mu sync.Mutex
	gens := map[*writerGen]bool{}
	var wg sync.WaitGroup
	for w := range 2 { // two callers, as two shards' lanes
		wg.Add(1)
		go func() {
			defer wg.Done()
			for b := w; b < len(topics)/4; b += 2 {
				var batch []*codec.Task
				for _, tp := range topics[4*b : 4*b+4] {
					batch = append(batch, task(tp, "k", tp))
				}
				if errs := s.Deliver(context.Background(), batch); errs != nil {
					t.Errorf("deliver: %v", errors.Join(errs...))
				}
				s.wmu.Lock()
				mu.Lock()
				gens[s.gen] = true
				mu.Unlock()
				s.wmu.Unlock()
			}
		}()
	}
	wg.Wait()
	s.wmu.Lock()
	cur := s.gen
	closed, retired := 0, 0
	for g := range gens {
		if g != cur {
			retired++
			if g.closed && g.refs == 0 {
				closed++
			}
		}
	}
	s.wmu.Unlock()
	if retired < 2 || closed != retired {
		t.Fatalf("40 topics with at most 8 per producer pair: %d pairs retired, %d closed; want several, all closed", retired, closed)
	}
	for _, tp := range topics {
		if recs := consumeAll(t, c, tp, 1); len(recs) != 1 {
			t.Fatalf("%s: %d records", tp, len(recs))
		}
	}
}

// TestSinkRetiresWritersAtMaxTopics: the pair is retired by the call that
// brings it to maxWriterTopics topics, as documented, not one topic later.
func TestSinkRetiresWritersAtMaxTopics(t *testing.T) {
	old := maxWriterTopics
	maxWriterTopics = 2
	t.Cleanup(func() { maxWriterTopics = old })
	c := newCluster(t, kfake.SeedTopics(1, "a", "b"))
	s, err := NewSink(testConfig(t, c.ListenAddrs(), ""))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	first := s.gen
	if errs := s.Deliver(context.Background(), []*codec.Task{task("a", "k", "v"), task("b", "k", "v")}); errs != nil {
		t.Fatal(errors.Join(errs...))
	}
	s.wmu.Lock()
	defer s.wmu.Unlock()
	if s.gen == first || !first.retired {
		t.Fatalf("the pair wrote to %d topics (maxWriterTopics %d) and is still the current one", len(first.topics), maxWriterTopics)
	}
}
