package kafka

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/delaybridge/delaybridge/bridge"
	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/clock"
	"github.com/delaybridge/delaybridge/metrics"
)

func TestSourceConvertsAndCommits(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(2, "delay"))
	cl := producer(t, c)
	before := time.Now().Add(-time.Second)
	produce(t, cl,
		&kgo.Record{Topic: "delay", Partition: 0, Key: []byte("a"), Value: []byte("one"),
			Headers: []kgo.RecordHeader{{Key: "delay-after", Value: []byte("1s")}, {Key: "x", Value: []byte("1")}, {Key: "x", Value: []byte("2")}}},
		&kgo.Record{Topic: "delay", Partition: 0, Key: []byte("b"), Value: nil},      // tombstone
		&kgo.Record{Topic: "delay", Partition: 0, Key: []byte("c"), Value: []byte{}}, // empty, not a tombstone
		&kgo.Record{Topic: "delay", Partition: 1, Key: nil, Value: []byte("two")},
	)
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
	cfg.Metrics = metrics.New(nil)
	rules := cfg.Sources[0].Rules
	s, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h := newMemHandler()
	stop := runSource(t, s, h)
	waitFor(t, "4 messages", func() bool { return h.count() == 4 })
	waitFor(t, "commits", func() bool {
		cm := committed(c, "g", "delay")
		return cm[0] == 3 && cm[1] == 1
	})
	waitFor(t, "lag 0", func() bool {
		return gaugeValue(t, cfg.Metrics.SourceLag.WithLabelValues("delay", "0")) == 0 &&
			gaugeValue(t, cfg.Metrics.SourceLag.WithLabelValues("delay", "1")) == 0
	})
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}

	got := map[string]codec.Message{}
	for _, m := range h.snapshot() {
		got[fmt.Sprintf("%d@%d", m.Partition, m.Offset)] = m
	}
	type want struct {
		key, value []byte
		tombstone  bool
		headers    []codec.Header
	}
	for pos, w := range map[string]want{
		"0@0": {key: []byte("a"), value: []byte("one"), headers: []codec.Header{{Key: "delay-after", Value: []byte("1s")}, {Key: "x", Value: []byte("1")}, {Key: "x", Value: []byte("2")}}},
		"0@1": {key: []byte("b"), value: nil, tombstone: true},
		"0@2": {key: []byte("c"), value: []byte{}},
		"1@0": {key: nil, value: []byte("two")},
	} {
		m, ok := got[pos]
		if !ok {
			t.Fatalf("%s not handled", pos)
		}
		if m.Transport != codec.TransportKafka || m.Source != "delay" {
			t.Errorf("%s: transport %v source %q", pos, m.Transport, m.Source)
		}
		if !bytes.Equal(m.Key, w.key) || (m.Key == nil) != (w.key == nil) {
			t.Errorf("%s: key %q, want %q", pos, m.Key, w.key)
		}
		if !bytes.Equal(m.Value, w.value) || (m.Value == nil) != (w.value == nil) {
			t.Errorf("%s: value %q (nil %v), want %q (nil %v)", pos, m.Value, m.Value == nil, w.value, w.value == nil)
		}
		if m.Tombstone != w.tombstone {
			t.Errorf("%s: tombstone %v, want %v", pos, m.Tombstone, w.tombstone)
		}
		if !slices.EqualFunc(m.Headers, w.headers, func(a, b codec.Header) bool { return a.Key == b.Key && bytes.Equal(a.Value, b.Value) }) {
			t.Errorf("%s: headers %v, want %v", pos, m.Headers, w.headers)
		}
		if m.Time.Before(before) || m.Time.After(time.Now()) {
			t.Errorf("%s: time %v is not the broker timestamp", pos, m.Time)
		}
	}
	for i, r := range h.rules {
		if r != rules {
			t.Errorf("item %d: rules %p, want the source's %p", i, r, rules)
		}
	}
	for _, b := range h.batches {
		last := b.Items[len(b.Items)-1].Msg
		if len(b.Checkpoints) != 1 || b.Checkpoints[0].Key != CheckpointKey("delay", int(last.Partition)) || b.Checkpoints[0].Offset != last.Offset {
			t.Errorf("batch checkpoints %v, want last offset %d of its partition", b.Checkpoints, last.Offset)
		}
	}
}

// A failing Handle is retried with the same batch and nothing is committed:
// a new member of the group gets the same messages again.
func TestSourceHandleErrorRetriesWithoutCommit(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	produceN(t, producer(t, c), "delay", 1, 0, 5)
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay")

	failing := newMemHandler()
	var seen [][]int64
	failing.setFail(func(_ context.Context, b *bridge.Batch) error {
		var offs []int64
		for _, it := range b.Items {
			offs = append(offs, it.Msg.Offset)
		}
		seen = append(seen, offs)
		return errors.New("store down")
	})
	s1, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop1 := runSource(t, s1, failing)
	waitFor(t, "3 attempts", func() bool {
		failing.mu.Lock()
		defer failing.mu.Unlock()
		return failing.attempts >= 3
	})
	if err := stop1(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	failing.mu.Lock()
	for i, offs := range seen {
		if !slices.Equal(offs, []int64{0, 1, 2, 3, 4}) {
			t.Errorf("attempt %d got offsets %v, want the same batch 0..4", i, offs)
		}
	}
	failing.mu.Unlock()
	if cm := committed(c, "g", "delay"); len(cm) != 0 {
		t.Fatalf("committed %v while Handle failed", cm)
	}

	// A fresh member (fresh store) starts from the beginning.
	good := newMemHandler()
	s2, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop2 := runSource(t, s2, good)
	waitFor(t, "5 messages", func() bool { return good.count() == 5 })
	waitFor(t, "commit 5", func() bool { return committed(c, "g", "delay")[0] == 5 })
	if err := stop2(); err != nil {
		t.Fatal(err)
	}
	if offs := good.offsets("delay")[0]; !slices.Equal(offs, []int64{0, 1, 2, 3, 4}) {
		t.Fatalf("offsets %v", offs)
	}
}

// A failure in the middle of a run: the failed batch comes back until it
// is stored, and the committed offset never passes the stored one.
func TestSourceRecoversAfterHandleErrors(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	cl := producer(t, c)
	produceN(t, cl, "delay", 1, 0, 3)
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
	s, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h := newMemHandler()
	stop := runSource(t, s, h)
	waitFor(t, "3 messages", func() bool { return h.count() == 3 })
	waitFor(t, "commit 3", func() bool { return committed(c, "g", "delay")[0] == 3 })

	fails := 0
	h.setFail(func(context.Context, *bridge.Batch) error {
		if fails < 3 {
			fails++
			if cm := committed(c, "g", "delay")[0]; cm != 3 {
				t.Errorf("committed %d while the batch after offset 2 is unstored", cm)
			}
			return errors.New("transient")
		}
		return nil
	})
	produceN(t, cl, "delay", 1, 3, 4)
	waitFor(t, "7 messages", func() bool { return h.count() == 7 })
	waitFor(t, "commit 7", func() bool { return committed(c, "g", "delay")[0] == 7 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if offs := h.offsets("delay")[0]; !slices.Equal(offs, []int64{0, 1, 2, 3, 4, 5, 6}) {
		t.Fatalf("offsets %v: want each exactly once", offs)
	}
}

// The start offset is max(committed, stored checkpoint + 1).
func TestSourceCheckpointSeek(t *testing.T) {
	for _, tc := range []struct {
		name       string
		commitTo   int64 // committed before the run (0 = none)
		checkpoint int64 // stored checkpoint (-1 = none)
		wantFirst  int64
	}{
		{name: "no commit, no checkpoint", commitTo: 0, checkpoint: -1, wantFirst: 0},
		{name: "checkpoint ahead of no commit", commitTo: 0, checkpoint: 4, wantFirst: 5},
		{name: "checkpoint ahead of commit", commitTo: 3, checkpoint: 6, wantFirst: 7},
		{name: "commit ahead of checkpoint", commitTo: 6, checkpoint: 2, wantFirst: 6},
		{name: "checkpoint at commit-1", commitTo: 5, checkpoint: 4, wantFirst: 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, kfake.SeedTopics(1, "delay"))
			cl := producer(t, c)
			produceN(t, cl, "delay", 1, 0, 10)
			if tc.commitTo > 0 {
				commitOffset(t, c, "g", "delay", 0, tc.commitTo)
			}
			h := newMemHandler()
			if tc.checkpoint >= 0 {
				h.cps[CheckpointKey("delay", 0)] = tc.checkpoint
			}
			s, err := NewSource(testConfig(t, c.ListenAddrs(), "g", "delay"))
			if err != nil {
				t.Fatal(err)
			}
			stop := runSource(t, s, h)
			want := int(10 - tc.wantFirst)
			waitFor(t, "messages", func() bool { return h.count() == want })
			waitFor(t, "commit 10", func() bool { return committed(c, "g", "delay")[0] == 10 })
			if err := stop(); err != nil {
				t.Fatal(err)
			}
			offs := h.offsets("delay")[0]
			if len(offs) != want || offs[0] != tc.wantFirst {
				t.Fatalf("offsets %v, want %d..9", offs, tc.wantFirst)
			}
		})
	}
}

// commitOffset commits an offset for an empty group with a standalone
// OffsetCommit (generation -1), as an earlier run would have left it.
func commitOffset(t *testing.T, c *kfake.Cluster, group, topic string, partition int32, offset int64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cl := &kafkago.Client{Addr: kafkago.TCP(c.ListenAddrs()...)}
	resp, err := cl.OffsetCommit(ctx, &kafkago.OffsetCommitRequest{
		GroupID: group, GenerationID: -1,
		Topics: map[string][]kafkago.OffsetCommit{topic: {{Partition: int(partition), Offset: offset}}},
	})
	if err != nil {
		t.Fatalf("commit: %v", err)
	}
	if err := resp.Topics[topic][0].Error; err != nil {
		t.Fatalf("commit: %v", err)
	}
	waitFor(t, "commit visible", func() bool { return committed(c, group, topic)[partition] == offset })
}

// Records of a committed transaction are read and the commit marker (a
// control batch) is skipped without stalling the partition.
func TestSourceSkipsTransactionMarkers(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	txn := producer(t, c, kgo.TransactionalID("tx"))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := txn.BeginTransaction(); err != nil {
		t.Fatal(err)
	}
	produce(t, txn, &kgo.Record{Topic: "delay", Value: []byte("t0")}, &kgo.Record{Topic: "delay", Value: []byte("t1")})
	if err := txn.EndTransaction(ctx, kgo.TryCommit); err != nil {
		t.Fatal(err)
	}
	h := newMemHandler()
	s, err := NewSource(testConfig(t, c.ListenAddrs(), "g", "delay"))
	if err != nil {
		t.Fatal(err)
	}
	stop := runSource(t, s, h)
	waitFor(t, "2 transactional records", func() bool { return h.count() == 2 })
	// The commit moves past the trailing marker (offset 2), as a Java
	// consumer's does, or the group would lag by one forever.
	waitFor(t, "commit 3, past the marker", func() bool { return committed(c, "g", "delay")[0] == 3 })
	// The marker took offset 2; a plain record after it arrives at 3.
	produce(t, producer(t, c), &kgo.Record{Topic: "delay", Value: []byte("plain")})
	waitFor(t, "the plain record", func() bool { return h.count() == 3 })
	waitFor(t, "commit 4", func() bool { return committed(c, "g", "delay")[0] == 4 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, m := range h.snapshot() {
		got = append(got, fmt.Sprintf("%d:%s", m.Offset, m.Value))
	}
	if !slices.Equal(got, []string{"0:t0", "1:t1", "3:plain"}) {
		t.Fatalf("handled %v", got)
	}
}

// Records of an aborted transaction are not taken in (read_committed, as a
// Java consumer filters them), while a concurrent plain producer's records
// and a later committed transaction are.
func TestSourceDropsAbortedTransactions(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	txn := producer(t, c, kgo.TransactionalID("tx"))
	plain := producer(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	run := func(commit kgo.TransactionEndTry, values ...string) {
		t.Helper()
		if err := txn.BeginTransaction(); err != nil {
			t.Fatal(err)
		}
		for _, v := range values {
			produce(t, txn, &kgo.Record{Topic: "delay", Value: []byte(v)})
			produce(t, plain, &kgo.Record{Topic: "delay", Value: []byte("plain-" + v)})
		}
		if err := txn.EndTransaction(ctx, commit); err != nil {
			t.Fatal(err)
		}
	}
	run(kgo.TryAbort, "a1", "a2")
	run(kgo.TryCommit, "c1")
	run(kgo.TryAbort, "a3")
	produce(t, plain, &kgo.Record{Topic: "delay", Value: []byte("last")})

	h := newMemHandler()
	s, err := NewSource(testConfig(t, c.ListenAddrs(), "g", "delay"))
	if err != nil {
		t.Fatal(err)
	}
	stop := runSource(t, s, h)
	waitFor(t, "the last record", func() bool {
		return slices.ContainsFunc(h.snapshot(), func(m codec.Message) bool { return string(m.Value) == "last" })
	})
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, m := range h.snapshot() {
		got = append(got, string(m.Value))
	}
	want := []string{"plain-a1", "plain-a2", "c1", "plain-c1", "plain-a3", "last"}
	if !slices.Equal(got, want) {
		t.Fatalf("handled %q, want %q", got, want)
	}
}

// A worker that starts at an abort marker (the aborted batch before it
// read by the run before) gets the aborted transaction listed in its first
// fetch: the marker must end it, and the producer's next transaction,
// committed, must be taken in.
func TestSourceStartsAtAnAbortMarker(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	plain := producer(t, c)
	txn := producer(t, c, kgo.TransactionalID("tx"))
	produce(t, plain, &kgo.Record{Topic: "delay", Value: []byte("seed")}) // 0
	for _, end := range []kgo.TransactionEndTry{kgo.TryAbort, kgo.TryCommit} {
		if err := txn.BeginTransaction(); err != nil {
			t.Fatal(err)
		}
		produce(t, txn, &kgo.Record{Topic: "delay", Value: []byte(fmt.Sprint(end))}) // 1 aborted, 3 committed
		if err := txn.EndTransaction(ctx, end); err != nil {                         // markers 2 and 4
			t.Fatal(err)
		}
	}
	produce(t, plain, &kgo.Record{Topic: "delay", Value: []byte("after")}) // 5
	h := newMemHandler()
	h.cps[CheckpointKey("delay", 0)] = 1 // 0 and 1 taken in before: start at the abort marker
	s, err := NewSource(testConfig(t, c.ListenAddrs(), "g", "delay"))
	if err != nil {
		t.Fatal(err)
	}
	stop := runSource(t, s, h)
	waitFor(t, "offset 5", func() bool { return slices.Contains(h.offsets("delay")[0], 5) })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if got := h.offsets("delay")[0]; !slices.Equal(got, []int64{3, 5}) {
		t.Fatalf("handled offsets %v, want the committed transaction's 3 and 5", got)
	}
}

// A failed offset commit (not a generation change) is logged and covered
// by the next one; consumption goes on.
func TestSourceCommitErrorIsCoveredByTheNext(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	cl := producer(t, c)
	h := newMemHandler()
	s, err := NewSource(testConfig(t, c.ListenAddrs(), "g", "delay"))
	if err != nil {
		t.Fatal(err)
	}
	fault := c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.OffsetCommit}, Topic: "delay", Err: kerr.UnknownServerError, Count: 1})
	stop := runSource(t, s, h)
	produceN(t, cl, "delay", 1, 0, 3)
	waitFor(t, "3 handled", func() bool { return h.count() == 3 })
	waitFor(t, "the fault hit", func() bool { return fault.Hits() == 1 })
	produceN(t, cl, "delay", 1, 3, 2)
	waitFor(t, "commit 5", func() bool { return committed(c, "g", "delay")[0] == 5 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if offs := h.offsets("delay")[0]; !slices.Equal(offs, []int64{0, 1, 2, 3, 4}) {
		t.Fatalf("offsets %v", offs)
	}
}

func gaugeValue(t *testing.T, g prometheus.Gauge) float64 {
	t.Helper()
	var pb dto.Metric
	if err := g.Write(&pb); err != nil {
		t.Fatal(err)
	}
	return pb.GetGauge().GetValue()
}

// The lag gauge counts what is in the partition and not yet taken in.
func TestSourceLagMetric(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	produceN(t, producer(t, c), "delay", 1, 0, 10)
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
	cfg.Metrics = metrics.New(nil)
	cfg.MaxBatch = 4
	lag := cfg.Metrics.SourceLag.WithLabelValues("delay", "0")
	release := make(chan struct{})
	h := newMemHandler()
	h.setFail(func(ctx context.Context, _ *bridge.Batch) error {
		select { // hold the first batch: the fetcher stops one batch ahead
		case <-release:
		case <-ctx.Done():
		}
		return nil
	})
	s, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop := runSource(t, s, h)
	waitFor(t, "lag reported", func() bool { return gaugeValue(t, lag) > 0 })
	close(release)
	waitFor(t, "10 handled", func() bool { return h.count() == 10 })
	waitFor(t, "lag 0", func() bool { return gaugeValue(t, lag) == 0 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}

// A transaction left open holds the partition at its last stable offset:
// the lag gauge (up to the LSO) shows nothing, the unstable gauge counts the
// records behind it and the stall gauge times how long the LSO has not
// moved, by the source's clock. A plain record after the transaction stays
// unread until it ends; then both gauges go back to 0.
func TestSourceTransactionStallMetrics(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	txn := producer(t, c, kgo.TransactionalID("tx"), kgo.TransactionTimeout(10*time.Minute))
	plain := producer(t, c)
	produce(t, plain, &kgo.Record{Topic: "delay", Value: []byte("before")})
	if err := txn.BeginTransaction(); err != nil {
		t.Fatal(err)
	}
	produce(t, txn, &kgo.Record{Topic: "delay", Value: []byte("t1")}, &kgo.Record{Topic: "delay", Value: []byte("t2")})
	produce(t, plain, &kgo.Record{Topic: "delay", Value: []byte("after")})

	cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
	cfg.Metrics = metrics.New(nil)
	cfg.MaxWait = 20 * time.Millisecond
	lag := cfg.Metrics.SourceLag.WithLabelValues("delay", "0")
	unstable := cfg.Metrics.SourceUnstable.WithLabelValues("delay", "0")
	stalled := cfg.Metrics.SourceStableStalled.WithLabelValues("delay", "0")
	s, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	clk := clock.NewFake(time.Unix(1_800_000_000, 0))
	s.now = clk.Now
	h := newMemHandler()
	stop := runSource(t, s, h)
	// Offsets: 0 before, 1-2 the open transaction, 3 after: the LSO is 1.
	waitFor(t, "3 unstable", func() bool { return gaugeValue(t, unstable) == 3 })
	waitFor(t, "the record before", func() bool { return h.count() == 1 })
	// Read up to the LSO: no lag, though three records lie beyond it.
	waitFor(t, "lag 0", func() bool { return gaugeValue(t, lag) == 0 })
	if v := gaugeValue(t, stalled); v != 0 {
		t.Fatalf("stalled %v s before the clock moved, want 0", v)
	}
	clk.Advance(20 * time.Minute)
	waitFor(t, "stalled 1200 s", func() bool { return gaugeValue(t, stalled) == 1200 })
	if n := h.count(); n != 1 {
		t.Fatalf("%d records taken in past an open transaction, want 1", n)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := txn.EndTransaction(ctx, kgo.TryCommit); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the transaction and the record after it", func() bool { return h.count() == 4 })
	waitFor(t, "unstable 0", func() bool { return gaugeValue(t, unstable) == 0 })
	waitFor(t, "stalled 0", func() bool { return gaugeValue(t, stalled) == 0 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, m := range h.snapshot() {
		got = append(got, string(m.Value))
	}
	if !slices.Equal(got, []string{"before", "t1", "t2", "after"}) {
		t.Fatalf("handled %q", got)
	}
}

// A member that stops reading a partition reports no lag and no stall for
// it any more: the gauges are the next owner's, and a value frozen at the
// last fetch would add a phantom backlog to every sum over members.
func TestSourceGaugesClearedWhenThePartitionIsLeft(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	plain := producer(t, c)
	produceN(t, plain, "delay", 1, 0, 10)
	txn := producer(t, c, kgo.TransactionalID("tx"), kgo.TransactionTimeout(10*time.Minute))
	if err := txn.BeginTransaction(); err != nil {
		t.Fatal(err)
	}
	produce(t, txn, &kgo.Record{Topic: "delay", Value: []byte("open")})
	produce(t, plain, &kgo.Record{Topic: "delay", Value: []byte("after")})

	// hold: the handler holds the first batch until the stop, so the lag
	// is above 0 then; otherwise the worker reads up to the open
	// transaction and times the stall.
	for _, hold := range []bool{true, false} {
		t.Run(fmt.Sprintf("hold=%v", hold), func(t *testing.T) {
			cfg := testConfig(t, c.ListenAddrs(), fmt.Sprintf("g-%v", hold), "delay")
			cfg.Metrics = metrics.New(nil)
			cfg.MaxBatch = 4
			cfg.MaxWait = 20 * time.Millisecond
			gauges := map[string]prometheus.Gauge{
				"lag":      cfg.Metrics.SourceLag.WithLabelValues("delay", "0"),
				"unstable": cfg.Metrics.SourceUnstable.WithLabelValues("delay", "0"),
				"stalled":  cfg.Metrics.SourceStableStalled.WithLabelValues("delay", "0"),
			}
			h := newMemHandler()
			if hold {
				h.setFail(func(ctx context.Context, _ *bridge.Batch) error {
					<-ctx.Done()
					return ctx.Err()
				})
			}
			s, err := NewSource(cfg)
			if err != nil {
				t.Fatal(err)
			}
			clk := clock.NewFake(time.Unix(1_800_000_000, 0))
			s.now = clk.Now
			stop := runSource(t, s, h)
			waitFor(t, "unstable reported", func() bool { return gaugeValue(t, gauges["unstable"]) == 2 })
			if hold {
				waitFor(t, "lag reported", func() bool { return gaugeValue(t, gauges["lag"]) > 0 })
			} else {
				waitFor(t, "10 handled", func() bool { return h.count() == 10 })
				clk.Advance(time.Minute)
				waitFor(t, "a stall reported", func() bool { return gaugeValue(t, gauges["stalled"]) == 60 })
			}
			if err := stop(); err != nil {
				t.Fatal(err)
			}
			for name, g := range gauges {
				if v := gaugeValue(t, g); v != 0 {
					t.Errorf("%s %v after the source stopped, want 0", name, v)
				}
			}
		})
	}
}

// TestStallGauge pins the stall clock: it starts when records lie past the
// LSO, restarts when the LSO moves (another transaction is now the oldest
// open one), and stops when nothing is held.
func TestStallGauge(t *testing.T) {
	m := metrics.New(nil)
	g := newStallGauge(m, "d", 0)
	t0 := time.Unix(1_800_000_000, 0)
	for i, st := range []struct {
		lso, unstable int64
		at            time.Duration
		want          float64
	}{
		{lso: 10, unstable: 0, at: 0, want: 0},
		{lso: 10, unstable: 5, at: time.Second, want: 0},
		{lso: 10, unstable: 7, at: 61 * time.Second, want: 60},
		{lso: 12, unstable: 5, at: 70 * time.Second, want: 0}, // the LSO moved
		{lso: 12, unstable: 5, at: 75 * time.Second, want: 5},
		{lso: 20, unstable: 0, at: 80 * time.Second, want: 0}, // nothing held
		{lso: 20, unstable: 1, at: 90 * time.Second, want: 0},
		{lso: 20, unstable: 1, at: 95 * time.Second, want: 5},
	} {
		g.observe(st.lso, st.unstable, t0.Add(st.at))
		if got := gaugeValue(t, g.stalled); got != st.want {
			t.Errorf("step %d: stalled %v, want %v", i, got, st.want)
		}
		if got := gaugeValue(t, g.unstable); got != float64(st.unstable) {
			t.Errorf("step %d: unstable %v, want %d", i, got, st.unstable)
		}
	}
	g.reset()
	if gaugeValue(t, g.stalled) != 0 || gaugeValue(t, g.unstable) != 0 {
		t.Error("reset left a stall reported")
	}
}

// A record larger than FetchMaxBytes (the default, 1 MiB) is still read:
// the broker returns the first record batch of a fetch whatever its size
// (KIP-74), so a large message is taken in (and dead-lettered as too-large
// if it is) rather than stalling its partition. Records before and after it
// are read too, uncompressed and compressed.
func TestSourceReadsRecordLargerThanFetchMaxBytes(t *testing.T) {
	for _, codecName := range []string{"none", "snappy"} {
		t.Run(codecName, func(t *testing.T) {
			c := newCluster(t)
			if err := c.CreateTopic("delay", 1, map[string]string{"max.message.bytes": fmt.Sprint(8 << 20)}); err != nil {
				t.Fatal(err)
			}
			opts := []kgo.Opt{kgo.ProducerBatchMaxBytes(8 << 20), kgo.ProducerBatchCompression(kgo.NoCompression())}
			if codecName == "snappy" {
				opts[1] = kgo.ProducerBatchCompression(kgo.SnappyCompression())
			}
			cl := producer(t, c, opts...)
			big := make([]byte, 3<<20)
			rng := rand.New(rand.NewPCG(1, 2))
			for i := range big {
				big[i] = byte(rng.Uint32()) // incompressible: the compressed batch is larger than the fetch size too
			}
			produce(t, cl, &kgo.Record{Topic: "delay", Value: []byte("before")})
			produce(t, cl, &kgo.Record{Topic: "delay", Value: big})
			produce(t, cl, &kgo.Record{Topic: "delay", Value: []byte("after")})
			cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
			s, err := NewSource(cfg)
			if err != nil {
				t.Fatal(err)
			}
			if s.cfg.FetchMaxBytes >= len(big) {
				t.Fatalf("FetchMaxBytes %d: the record is not larger", s.cfg.FetchMaxBytes)
			}
			h := newMemHandler()
			stop := runSource(t, s, h)
			waitFor(t, "3 messages", func() bool { return h.count() == 3 })
			if err := stop(); err != nil {
				t.Fatalf("Run: %v", err)
			}
			got := h.snapshot()
			if string(got[0].Value) != "before" || !bytes.Equal(got[1].Value, big) || string(got[2].Value) != "after" {
				t.Fatalf("read %d messages, sizes %d/%d/%d", len(got), len(got[0].Value), len(got[1].Value), len(got[2].Value))
			}
		})
	}
}
