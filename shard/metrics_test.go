package shard

import (
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/metrics"
)

func TestMetricsCounted(t *testing.T) {
	m := metrics.New(prometheus.NewRegistry())
	h := newHarness(t, func(o *Options) { o.Metrics = m; o.Shards = 1 })
	h.run()
	due := t0.Add(time.Minute)
	dl := codec.Task{Kind: codec.KindDeadLetter, ID: "bad", Source: "src", Origin: "kafka:src/0@9",
		Transport: codec.TransportKafka, Target: "dlq", Code: codec.CodeBadDue}
	h.ingest([]codec.Task{
		sched("a", due, 1),
		sched("a", due, 2),         // replaces
		sched("a", due, 1),         // older: dropped
		cancelTask("b", 10),        // marker
		sched("b", due, 9),         // older than the cancel: dropped
		sched("c", t0.Add(-1), 11), // overdue
		cancelTask("a", 12),        // cancels a
		dl,
	})
	h.advance(time.Minute)
	for _, c := range []struct {
		name string
		got  float64
		want float64
	}{
		{"ingested", metricValue(t, m.Ingested.WithLabelValues("src")), 8},
		{"replaced", metricValue(t, m.Replaced.WithLabelValues("src")), 1},
		{"dropped older", metricValue(t, m.Dropped.WithLabelValues("src", "older")), 1},
		{"dropped cancelled", metricValue(t, m.Dropped.WithLabelValues("src", "cancelled")), 1},
		{"cancelled", metricValue(t, m.Cancelled.WithLabelValues("src")), 1},
		{"overdue", metricValue(t, m.Overdue), 1},
		{"fired task", metricValue(t, m.Fired.WithLabelValues("kafka", "task")), 1},
		{"fired dlq", metricValue(t, m.Fired.WithLabelValues("kafka", "dlq")), 1},
		{"dead lettered", metricValue(t, m.DeadLettered.WithLabelValues("bad-due")), 1},
		{"pending", metricValue(t, m.Pending.WithLabelValues("0")), 0},
		{"lateness samples", metricValue(t, m.FireLateness.WithLabelValues("kafka").(prometheus.Metric)), 1}, // c: dead letters are not fires
		// The transports' sinks time their publishes; the engine adding
		// its own sample counted every publish twice.
		{"publish samples", metricValue(t, m.PublishSeconds.WithLabelValues("kafka").(prometheus.Metric)), 0},
	} {
		if c.got != c.want {
			t.Errorf("%s = %v, want %v", c.name, c.got, c.want)
		}
	}
}

// TestFireLatenessFromDue: the lateness of a task delivered after retries
// is measured from its due time, not from the retry it was delivered on
// (which recorded 0 s however long a target refused it).
func TestFireLatenessFromDue(t *testing.T) {
	m := metrics.New(prometheus.NewRegistry())
	h := newHarness(t, func(o *Options) {
		o.Metrics = m
		o.Retry = RetryPolicy{Initial: 100 * time.Millisecond, Max: time.Second, Multiplier: 2, Jitter: -1, MaxAttempts: 5}
	})
	fails := 2
	h.sink.setFail(func(*codec.Task) error {
		if fails > 0 {
			fails--
			return errors.New("broker says no")
		}
		return nil
	})
	h.run()
	h.ingest([]codec.Task{sched("x", t0.Add(time.Second), 1)})
	// Tries at +1 s, +1.1 s, then delivered at +1.3 s.
	for _, d := range []time.Duration{1000, 100, 200} {
		h.advance(d * time.Millisecond)
	}
	if got := h.sink.acked(); len(got) != 1 {
		t.Fatalf("acked %v, want [x]", got)
	}
	var d dto.Metric
	if err := m.FireLateness.WithLabelValues("kafka").(prometheus.Metric).Write(&d); err != nil {
		t.Fatal(err)
	}
	if n, sum := d.Histogram.GetSampleCount(), d.Histogram.GetSampleSum(); n != 1 || sum != 0.3 {
		t.Fatalf("lateness: %d samples summing %v s, want 1 of 0.3 s", n, sum)
	}
}

// metricValue reads a counter, gauge or histogram sample count.
func metricValue(t *testing.T, m prometheus.Metric) float64 {
	t.Helper()
	var d dto.Metric
	if err := m.Write(&d); err != nil {
		t.Fatal(err)
	}
	switch {
	case d.Counter != nil:
		return d.Counter.GetValue()
	case d.Gauge != nil:
		return d.Gauge.GetValue()
	case d.Histogram != nil:
		return float64(d.Histogram.GetSampleCount())
	}
	t.Fatalf("unsupported metric %v", m.Desc())
	return 0
}
