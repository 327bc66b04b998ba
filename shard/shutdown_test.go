package shard

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/metrics"
)

// blockingSink holds each Deliver until released, reporting whether its
// context was cancelled by then.
type blockingSink struct {
	entered  chan struct{}
	release  chan struct{}
	ctxAlive chan bool
	fail     error // when set, every task of every batch fails with it
}

func (s *blockingSink) Deliver(ctx context.Context, batch []*codec.Task) []error {
	s.entered <- struct{}{}
	<-s.release
	s.ctxAlive <- ctx.Err() == nil
	if s.fail == nil {
		return nil
	}
	errs := make([]error, len(batch))
	for i := range errs {
		errs[i] = s.fail
	}
	return errs
}

// runUntilInFlight starts the engine's Run with a blocking sink (room for
// deliveries Deliver calls) and returns once the first batch is in it.
func runUntilInFlight(t *testing.T, h *harness, deliveries int) (*blockingSink, context.CancelFunc, <-chan error) {
	t.Helper()
	sink := &blockingSink{entered: make(chan struct{}, deliveries), release: make(chan struct{}), ctxAlive: make(chan bool, deliveries)}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.e.Run(ctx, sink) }()
	select {
	case <-sink.entered:
	case <-time.After(20 * time.Second):
		cancel()
		t.Fatal("the due task was not handed to the sink")
	}
	return sink, cancel, done
}

// TestShutdownLetsInFlightBatchFinish: cancelling Run while a batch is being
// published must not cancel that publish (the broker may already hold it);
// the batch completes, is deleted, and is not delivered again on restart.
func TestShutdownLetsInFlightBatchFinish(t *testing.T) {
	h := newHarness(t, nil)
	h.ingest([]codec.Task{sched("a", t0, 1)})
	sink, cancel, done := runUntilInFlight(t, h, 1)
	cancel() // SIGTERM while the batch is in flight
	close(sink.release)
	if alive := <-sink.ctxAlive; !alive {
		t.Fatal("the in-flight Deliver saw its context cancelled by the shutdown")
	}
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	if p := h.e.Stats().Pending; p != 0 {
		t.Fatalf("pending after a graceful stop = %d, want 0: the acknowledged batch must be deleted", p)
	}
	h.reopen()
	if p := h.e.Stats().Pending; p != 0 {
		t.Fatalf("pending after reopen = %d: the delivered task would be sent again", p)
	}
}

// TestSupersededWhileInFlight: a replace or cancel of a task that is being
// published wins. The ack of the old task must neither delete the entry
// the newer message wrote nor count the task out twice. The metrics count
// what happened: a task the broker acknowledged anyway was fired (not
// replaced or cancelled); a replaced or cancelled one it refused was
// replaced or cancelled. Before H202 a replaced one the broker took was
// counted both fired and replaced.
func TestSupersededWhileInFlight(t *testing.T) {
	cases := []struct {
		name      string
		supersede func(h *harness)
		wantDue   time.Time // zero: nothing pending for the id
	}{
		{"replace", func(h *harness) { h.ingest([]codec.Task{sched("x", t0.Add(time.Minute), 2)}) }, t0.Add(time.Minute)},
		{"cancel message", func(h *harness) { h.ingest([]codec.Task{cancelTask("x", 2)}) }, time.Time{}},
		{"admin cancel", func(h *harness) {
			if err := h.e.Cancel("src", "x"); err != nil {
				h.t.Fatalf("Cancel: %v", err)
			}
		}, time.Time{}},
	}
	for _, tc := range cases {
		for _, delivered := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/delivered=%v", tc.name, delivered), func(t *testing.T) {
				m := metrics.New(prometheus.NewRegistry())
				h := newHarness(t, func(o *Options) { o.Metrics = m })
				h.ingest([]codec.Task{sched("x", t0, 1)})
				sink, cancel, done := runUntilInFlight(t, h, 4)
				if !delivered {
					sink.fail = errors.New("broker says no")
				}
				tc.supersede(h) // while x#1 is in flight
				close(sink.release)
				h.settle()
				checkSupersededCounts(t, m, tc.wantDue.IsZero(), delivered)
				h.checkPending()
				checkStoreInvariants(t, h.e)
				info, err := h.e.Lookup("src", "x")
				switch {
				case tc.wantDue.IsZero() && !errors.Is(err, ErrNotFound):
					t.Fatalf("Lookup after the cancel = %+v, %v; want ErrNotFound", info, err)
				case !tc.wantDue.IsZero() && (err != nil || !info.Due.Equal(tc.wantDue)):
					t.Fatalf("Lookup after the replace = %+v, %v; want the replacement due %v", info, err, tc.wantDue)
				}
				cancel()
				if err := <-done; err != nil {
					t.Fatalf("Run: %v", err)
				}
			})
		}
	}
}

// checkSupersededCounts checks the metrics of TestSupersededWhileInFlight.
func checkSupersededCounts(t *testing.T, m *metrics.Metrics, cancel, delivered bool) {
	t.Helper()
	wantFired, wantCancelled, wantReplaced := 0.0, 0.0, 0.0
	if delivered {
		wantFired = 1
	}
	switch {
	case delivered:
	case cancel:
		wantCancelled = 1
	default:
		wantReplaced = 1
	}
	for _, c := range []struct {
		name      string
		got, want float64
	}{
		{"fired", metricValue(t, m.Fired.WithLabelValues("kafka", "task")), wantFired},
		{"cancelled", metricValue(t, m.Cancelled.WithLabelValues("src")), wantCancelled},
		{"replaced", metricValue(t, m.Replaced.WithLabelValues("src")), wantReplaced},
		{"lateness samples", metricValue(t, m.FireLateness.WithLabelValues("kafka").(prometheus.Metric)), wantFired},
	} {
		if c.got != c.want {
			t.Errorf("%s = %v, want %v", c.name, c.got, c.want)
		}
	}
}

// TestCloseKeepsEverything: with or without the memtable flush, a closed
// store reopens with every ingested task and checkpoint, and fires them.
func TestCloseKeepsEverything(t *testing.T) {
	for _, tc := range []struct {
		name  string
		close func(*Engine) error
	}{
		{"Close", (*Engine).Close},
		{"CloseNoFlush", (*Engine).CloseNoFlush},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			h.run()
			h.ingest([]codec.Task{sched("a", t0.Add(time.Minute), 1), sched("b", t0.Add(time.Hour), 2), cancelTask("c", 3)},
				Checkpoint{Key: "kafka|delay|0", Offset: 41})
			h.stop()
			if err := tc.close(h.e); err != nil {
				t.Fatalf("%s: %v", tc.name, err)
			}
			h.e = nil
			h.open()
			if p := h.e.Stats().Pending; p != 2 {
				t.Fatalf("pending after reopen = %d, want 2", p)
			}
			if off, ok, err := h.e.Checkpoint("kafka|delay|0"); err != nil || !ok || off != 41 {
				t.Fatalf("checkpoint after reopen = %d, %v, %v; want 41", off, ok, err)
			}
			h.run()
			h.set(t0.Add(2 * time.Hour))
			got := h.sink.acked()
			slices.Sort(got) // two shards: no order between them
			if !slices.Equal(got, []string{"a", "b"}) {
				t.Fatalf("fired %v after reopen, want [a b]", got)
			}
		})
	}
}

// TestCloseWithStoreDirGone: Close's flush would rotate the WAL in a
// directory removed from under the store, which Pebble treats as fatal in
// a way no recover survives (the process died with "unlock of unlocked
// mutex"). Close skips that flush and reports why; nothing was lost that a
// kill -9 would not also have kept, since every write was already synced.
func TestCloseWithStoreDirGone(t *testing.T) {
	h := newHarness(t, nil)
	h.ingest([]codec.Task{sched("a", t0.Add(time.Minute), 1)})
	if err := os.RemoveAll(h.opts.Dir); err != nil {
		t.Fatal(err)
	}
	err := h.e.Close()
	h.e = nil
	if !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), "flush skipped") {
		t.Fatalf("Close with the store dir gone = %v, want a skipped flush for a missing directory", err)
	}
}

func TestPebbleFatalPrintsItsCause(t *testing.T) {
	var err error = pebbleFatal{msg: "MANIFEST missing"}
	if got := err.Error(); got != "pebble: fatal: MANIFEST missing" {
		t.Fatalf("pebbleFatal.Error() = %q", got)
	}
}
