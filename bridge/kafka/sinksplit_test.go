package kafka

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/shard"
)

// A broker refuses a whole record batch for one of its records or for
// their sum (max.message.bytes is checked against the batch), and kafka-go
// hands that error to every record of the batch. The sink sends those
// records again, each alone, and only a record refused alone is
// shard.ErrRefused: a good dead letter must never be parked (its source
// committing past it) for its batch-mates.

// dlqLimit is max.message.bytes of the test DLQ: a record of 1200 bytes
// fits alone (with the batch header), three in one batch do not.
const dlqLimit = 3000

// splitCluster is a cluster with topic "dlq" (one partition, so that the
// records of a call share a batch) limited to dlqLimit bytes per batch,
// and a count of the records of each produce batch sent to it.
type splitCluster struct {
	c       *kfake.Cluster
	mu      sync.Mutex
	batches []int32 // records per produce batch to dlq, in arrival order
}

func newSplitCluster(t *testing.T) *splitCluster {
	t.Helper()
	sc := &splitCluster{c: newCluster(t)}
	if err := sc.c.CreateTopic("dlq", 1, map[string]string{"max.message.bytes": fmt.Sprint(dlqLimit)}); err != nil {
		t.Fatal(err)
	}
	sc.c.ControlKey(int16(kmsg.Produce), func(req kmsg.Request) (kmsg.Response, error, bool) {
		sc.c.KeepControl()
		for _, rt := range req.(*kmsg.ProduceRequest).Topics {
			if rt.Topic != "dlq" {
				continue
			}
			for _, rp := range rt.Partitions {
				var b kmsg.RecordBatch
				if err := b.ReadFrom(rp.Records); err == nil {
					sc.mu.Lock()
					sc.batches = append(sc.batches, b.NumRecords)
					sc.mu.Unlock()
				}
			}
		}
		return nil, nil, false
	})
	return sc
}

// sent returns the records per produce batch to dlq so far.
func (sc *splitCluster) sent() []int32 {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	return slices.Clone(sc.batches)
}

func newSplitSink(t *testing.T, c *kfake.Cluster) *Sink {
	t.Helper()
	cfg := testConfig(t, c.ListenAddrs(), "")
	cfg.WriteAttempts = 1
	s, err := NewSink(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// dlqValues returns the values of the n records on dlq, sorted, and fails
// if the topic holds another number of records.
func dlqValues(t *testing.T, c *kfake.Cluster, n int) []string {
	t.Helper()
	recs := consumeAll(t, c, "dlq", n)
	if len(recs) != n {
		t.Fatalf("dlq holds %d records, want %d", len(recs), n)
	}
	var out []string
	for _, r := range recs {
		out = append(out, string(r.Value))
	}
	slices.Sort(out)
	return out
}

// value is a value of n bytes starting with name.
func value(name string, n int) string {
	return name + string(bytes.Repeat([]byte("x"), n-len(name)))
}

// Three records the topic takes one by one, too large together for its
// max.message.bytes: all three are acknowledged.
func TestSinkBatchTooLargeResentAlone(t *testing.T) {
	sc := newSplitCluster(t)
	s := newSplitSink(t, sc.c)
	batch := []*codec.Task{
		task("dlq", "a", value("a", 1200)), task("dlq", "b", value("b", 1200)), task("dlq", "c", value("c", 1200)),
	}
	if errs := s.Deliver(context.Background(), batch); errs != nil {
		t.Fatalf("Deliver: %v, want all three acknowledged", errs)
	}
	got := dlqValues(t, sc.c, 3)
	if want := []string{value("a", 1200), value("b", 1200), value("c", 1200)}; !slices.Equal(got, want) {
		t.Fatalf("dlq holds %.8q, want %.8q", got, want)
	}
	// The path taken: one batch of three refused, then one per record.
	if got := sc.sent(); !slices.Equal(got, []int32{3, 1, 1, 1}) {
		t.Fatalf("records per produce batch to dlq %v, want [3 1 1 1]", got)
	}
	if err := s.Health(); err != nil {
		t.Fatalf("Health = %v", err)
	}
	// A batch that fits goes as one batch, with no second send.
	if errs := s.Deliver(context.Background(), batch[:2]); errs != nil {
		t.Fatalf("Deliver of two: %v", errs)
	}
	if got := sc.sent(); !slices.Equal(got, []int32{3, 1, 1, 1, 2}) {
		t.Fatalf("records per produce batch to dlq %v, want [3 1 1 1 2]", got)
	}
}

// A record too large for the topic alone, with two small ones in one
// Deliver: the large one is refused (shard.ErrRefused), the small ones
// acknowledged.
func TestSinkBatchTooLargeRefusesOnlyTheLargeRecord(t *testing.T) {
	sc := newSplitCluster(t)
	s := newSplitSink(t, sc.c)
	batch := []*codec.Task{task("dlq", "a", "small-a"), task("dlq", "big", value("big", dlqLimit)), task("dlq", "b", "small-b")}
	errs := s.Deliver(context.Background(), batch)
	if len(errs) != 3 {
		t.Fatalf("Deliver: %v, want the large record refused", errs)
	}
	if errs[0] != nil || errs[2] != nil {
		t.Fatalf("small records failed: %v, %v", errs[0], errs[2])
	}
	if !errors.Is(errs[1], shard.ErrRefused) || !errors.Is(errs[1], kafkago.MessageSizeTooLarge) || errors.Is(errs[1], shard.ErrUnavailable) {
		t.Fatalf("large record: %v, want shard.ErrRefused and MessageSizeTooLarge", errs[1])
	}
	if got := dlqValues(t, sc.c, 2); !slices.Equal(got, []string{"small-a", "small-b"}) {
		t.Fatalf("dlq holds %q", got)
	}
}

// One bad record makes the broker reject its whole batch (here as
// CORRUPT_MESSAGE, like INVALID_RECORD for a keyless record to a compacted
// topic): only the bad record is refused.
func TestSinkBatchInvalidRefusesOnlyTheBadRecord(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "dlq"))
	var corrupted atomic.Int64
	c.ControlKey(int16(kmsg.Produce), func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		// Break the CRC of every batch that holds the poison record;
		// the broker then refuses the batch as a whole.
		for _, rt := range req.(*kmsg.ProduceRequest).Topics {
			for i := range rt.Partitions {
				if rec := rt.Partitions[i].Records; bytes.Contains(rec, []byte("poison")) {
					rec[len(rec)-1] ^= 0xff
					corrupted.Add(1)
				}
			}
		}
		return nil, nil, false
	})
	s := newSplitSink(t, c)
	batch := []*codec.Task{task("dlq", "a", "good-a"), task("dlq", "p", "poison"), task("dlq", "b", "good-b")}
	errs := s.Deliver(context.Background(), batch)
	if len(errs) != 3 || errs[0] != nil || errs[2] != nil {
		t.Fatalf("Deliver: %v, want only the poison record to fail", errs)
	}
	if !errors.Is(errs[1], shard.ErrRefused) || !errors.Is(errs[1], kafkago.InvalidMessage) {
		t.Fatalf("poison record: %v, want shard.ErrRefused and CORRUPT_MESSAGE", errs[1])
	}
	if n := corrupted.Load(); n != 2 { // in the batch of three, then alone
		t.Fatalf("%d batches held the poison record, want 2", n)
	}
	got := consumeAll(t, c, "dlq", 2)
	if len(got) != 2 || string(got[0].Value) != "good-a" || string(got[1].Value) != "good-b" {
		t.Fatalf("dlq holds %d records: %v", len(got), got)
	}
}

// A record larger than the topic's segment.bytes makes the broker refuse
// its batch as RECORD_LIST_TOO_LARGE (the batch must fit in one segment):
// only that record is refused.
func TestSinkBatchRecordListTooLargeRefusesOnlyTheHugeRecord(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "dlq"))
	var faulted atomic.Int64
	c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: "dlq", Err: kerr.RecordListTooLarge, Count: -1,
		When: func(req kmsg.Request) bool {
			for _, rt := range req.(*kmsg.ProduceRequest).Topics {
				for _, rp := range rt.Partitions {
					if bytes.Contains(rp.Records, []byte("huge")) {
						faulted.Add(1)
						return true
					}
				}
			}
			return false
		}})
	s := newSplitSink(t, c)
	batch := []*codec.Task{task("dlq", "a", "good-a"), task("dlq", "h", "huge"), task("dlq", "b", "good-b")}
	errs := s.Deliver(context.Background(), batch)
	if len(errs) != 3 || errs[0] != nil || errs[2] != nil {
		t.Fatalf("Deliver: %v, want only the huge record to fail", errs)
	}
	if !errors.Is(errs[1], shard.ErrRefused) || !errors.Is(errs[1], kafkago.RecordListTooLarge) {
		t.Fatalf("huge record: %v, want shard.ErrRefused and RECORD_LIST_TOO_LARGE", errs[1])
	}
	if n := faulted.Load(); n != 2 { // in the batch of three, then alone
		t.Fatalf("%d batches held the huge record, want 2", n)
	}
	got := consumeAll(t, c, "dlq", 2)
	if len(got) != 2 || string(got[0].Value) != "good-a" || string(got[1].Value) != "good-b" {
		t.Fatalf("dlq holds %d records: %v", len(got), got)
	}
}

// kafka-go batches the records of concurrent calls together: a record sent
// alone in its Deliver call may still share a refused batch. Each is sent
// again alone and acknowledged.
func TestSinkBatchRefusedAcrossCalls(t *testing.T) {
	sc := newSplitCluster(t)
	cfg := testConfig(t, sc.c.ListenAddrs(), "")
	cfg.WriteAttempts = 1
	cfg.BatchTimeout = time.Second // the three calls' records meet in one batch
	s, err := NewSink(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var wg sync.WaitGroup
	errs := make([][]error, 3)
	for i, name := range []string{"a", "b", "c"} {
		wg.Go(func() {
			errs[i] = s.Deliver(context.Background(), []*codec.Task{task("dlq", name, value(name, 1200))})
		})
	}
	wg.Wait()
	for i, e := range errs {
		if e != nil {
			t.Errorf("call %d: %v", i, e)
		}
	}
	if got := sc.sent(); len(got) == 0 || got[0] < 2 {
		t.Fatalf("records per produce batch to dlq %v: the calls did not share a batch", got)
	}
	if got := dlqValues(t, sc.c, 3); len(got) != 3 {
		t.Fatalf("dlq holds %d records", len(got))
	}
}

// batchRefusal: the broker answers that may come for a batch-mate are
// sent again alone; kafka-go's own size check, other broker answers and
// connection failures are not.
func TestBatchRefusal(t *testing.T) {
	for _, c := range []struct {
		name string
		err  error
		want bool
	}{
		{"message too large", kafkago.MessageSizeTooLarge, true},
		{"invalid record", kafkago.InvalidRecord, true},
		{"corrupt message", kafkago.InvalidMessage, true},
		{"record list too large", kafkago.RecordListTooLarge, true},
		{"wrapped", fmt.Errorf("x: %w", kafkago.InvalidRecord), true},
		{"over BatchBytes", kafkago.MessageTooLargeError{}, false},
		{"missing topic", kafkago.UnknownTopicOrPartition, false},
		{"not authorized", kafkago.TopicAuthorizationFailed, false},
		{"policy violation", kafkago.PolicyViolation, false},
		{"too few replicas", kafkago.NotEnoughReplicas, false},
		{"leader moved", kafkago.NotLeaderForPartition, false},
		{"dropped connection", errors.New("EOF"), false},
		{"cancelled", context.Canceled, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := batchRefusal(c.err); got != c.want {
				t.Fatalf("batchRefusal(%v) = %v, want %v", c.err, got, c.want)
			}
			// Whatever is sent again alone is a refusal when it comes
			// back alone.
			if c.want && !refused(c.err) {
				t.Fatalf("refused(%v) = false", c.err)
			}
		})
	}
}

// Stopping between the refused batch and the send alone: the refusal says
// nothing about the record, so it is not shard.ErrRefused (a dead letter
// holds its source rather than being parked), and nothing is sent.
func TestResendAloneStopping(t *testing.T) {
	s, err := NewSink(Config{Brokers: []string{"127.0.0.1:1"}, ProbeInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	msgs := []kafkago.Message{{Topic: "dlq", Value: []byte("a")}, {Topic: "dlq", Value: []byte("b")}}
	errs := []error{kafkago.MessageSizeTooLarge, kafkago.InvalidRecord}
	s.resendAlone(ctx, s.gen, msgs, []int{0, 1}, errs)
	for i, want := range []error{kafkago.MessageSizeTooLarge, kafkago.InvalidRecord} {
		if !errors.Is(errs[i], want) || !errors.Is(errs[i], context.Canceled) ||
			errors.Is(errs[i], shard.ErrRefused) || errors.Is(errs[i], shard.ErrUnavailable) {
			t.Fatalf("record %d: %v, want %v and context.Canceled, neither refused nor unavailable", i, errs[i], want)
		}
	}
	if s.Health() != nil {
		t.Fatalf("Health = %v after no send", s.Health())
	}
}
