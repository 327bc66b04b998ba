package shard

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/clock"
)

// t0 is the fake clock's start: a whole second, so ms arithmetic reads well.
var t0 = time.Date(2026, 11, 22, 0, 0, 0, 0, time.UTC)

func ms(t time.Time) int64 { return t.UnixMilli() }

type harness struct {
	t      testing.TB
	clk    *clock.Fake
	opts   Options
	e      *Engine
	sink   *recSink
	cancel context.CancelFunc
	done   chan error
}

// newHarness opens an engine on a temp dir with a fake clock; mod adjusts
// the options.
func newHarness(t testing.TB, mod func(*Options)) *harness {
	t.Helper()
	clk := clock.NewFake(t0)
	opts := Options{
		Dir:       t.TempDir(),
		Shards:    4,
		Clock:     clk,
		Logger:    zaptest.NewLogger(t, zaptest.Level(zap.InfoLevel)),
		LaneGrace: laneGraceForTests(t),
	}
	if mod != nil {
		mod(&opts)
	}
	h := &harness{t: t, clk: clk, opts: opts, sink: newRecSink(clk)}
	h.open()
	t.Cleanup(h.close)
	return h
}

func (h *harness) open() {
	h.t.Helper()
	e, err := Open(h.opts)
	if err != nil {
		h.t.Fatalf("Open: %v", err)
	}
	h.e = e
}

func (h *harness) run() {
	ctx, cancel := context.WithCancel(context.Background())
	h.cancel = cancel
	h.done = make(chan error, 1)
	e := h.e
	go func() { h.done <- e.Run(ctx, h.sink) }()
	h.settle()
}

func (h *harness) stop() {
	if h.cancel == nil {
		return
	}
	h.cancel()
	if err := <-h.done; err != nil {
		h.t.Errorf("Run: %v", err)
	}
	h.cancel = nil
}

func (h *harness) close() {
	h.stop()
	if h.e != nil {
		if err := h.e.Close(); err != nil && !errors.Is(err, ErrStoreFailed) {
			h.t.Errorf("Close: %v", err)
		}
		h.e = nil
	}
}

func (h *harness) reopen() {
	h.t.Helper()
	h.close()
	h.open()
}

// crashReopen opens the engine again on what mem (its FS) had synced, as
// after a crash: the running engine is stopped and closed, and what it
// wrote since its last sync is lost.
func (h *harness) crashReopen(mem *vfs.MemFS) {
	h.t.Helper()
	h.stop()
	clone := mem.CrashClone(vfs.CrashCloneCfg{})
	if err := h.e.Close(); err != nil {
		h.t.Fatal(err)
	}
	h.e = nil
	h.opts.FS = clone
	h.open()
}

// settle waits until every fire loop is parked on a timer that has not
// fired yet, with no batch in a lane and none set aside: after it, nothing
// happens until the clock moves or a task is ingested. The deadline only
// turns a hang into a failure.
func (h *harness) settle() {
	h.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !h.e.settled() {
		if time.Now().After(deadline) {
			var timers []int64
			for _, at := range h.clk.Deadlines() {
				timers = append(timers, at.UnixMilli())
			}
			h.t.Fatalf("fire loops did not settle: %s; fake timers at %v", h.e.loopStates(), timers)
		}
		time.Sleep(50 * time.Microsecond)
	}
}

// parkDeadline is when s's loop timer fires (ms), ok false if it is not
// armed (fired, stopped, or the loop not started).
func parkDeadline(s *shard) (ms int64, ok bool) {
	if d, isFake := s.parkTimer.(clock.Deadliner); isFake {
		if at, armed := d.Deadline(); armed {
			return at.UnixMilli(), true
		}
	}
	return 0, false
}

func deadlineText(s *shard) string {
	if ms, ok := parkDeadline(s); ok {
		return fmt.Sprint(ms)
	}
	return "(no timer armed)"
}

// loopStates describes each fire loop's state for a failed settle.
func (e *Engine) loopStates() string {
	now := e.clk.Now()
	var b strings.Builder
	fmt.Fprintf(&b, "now %d", now.UnixMilli())
	for _, s := range e.shards {
		s.mu.Lock()
		next, ok := s.w.Next()
		fmt.Fprintf(&b, "; shard %d: parked %v until %s, wake %d, notify %d, queue %d, wheel %d (time %d, next %d %v), horizon (%d, %d), late %d",
			s.id, s.parked, deadlineText(s), s.wakeAt, len(s.notify), len(s.queue), s.w.Len(), s.w.Now(), next, ok, s.horizonEnd, s.horizonSeq, len(s.late))
		for l := range s.lanes {
			ln := &s.lanes[l]
			if ln.busy || len(ln.parked) > 0 || ln.hold.n > 0 {
				fmt.Fprintf(&b, ", lane %d busy %v parked %d held %d next %d", l, ln.busy, len(ln.parked), ln.hold.n, ln.hold.next)
			}
		}
		s.mu.Unlock()
	}
	return b.String()
}

// settled reports whether every fire loop is parked, looking at all of
// them at one moment (every shard lock held, taken in index order as
// Ingest takes them): a shard looked at before another's lane told it
// something (a release, recover.go), and that lane looked at once it was
// done, would be two moments.
func (e *Engine) settled() bool {
	for _, s := range e.shards {
		s.mu.Lock()
	}
	defer func() {
		for _, s := range e.shards {
			s.mu.Unlock()
		}
	}()
	for _, s := range e.shards {
		// A fake timer still armed has not fired (the fake clock fires
		// what is due whenever it moves): the loop waits for the clock.
		_, armed := parkDeadline(s)
		ok := s.parked && armed && len(s.notify) == 0 && len(s.queue) == 0
		for l := range s.lanes { // a stuck lane's batch, or tasks waiting aside
			ok = ok && !s.lanes[l].busy && len(s.lanes[l].parked) == 0
		}
		if !ok {
			return false
		}
	}
	return true
}

func (h *harness) advance(d time.Duration) {
	h.t.Helper()
	h.clk.Advance(d)
	h.settle()
}

func (h *harness) set(at time.Time) {
	h.t.Helper()
	h.clk.Set(at)
	h.settle()
}

func (h *harness) ingest(tasks []codec.Task, cps ...Checkpoint) {
	h.t.Helper()
	if err := h.e.Ingest(context.Background(), tasks, cps); err != nil {
		h.t.Fatalf("Ingest: %v", err)
	}
	if h.cancel != nil {
		h.settle()
	}
}

// checkPending asserts the in-memory pending count matches the t keys.
func (h *harness) checkPending() {
	h.t.Helper()
	n := countTaskKeys(h.t, h.e)
	if got := h.e.Stats().Pending; got != n {
		h.t.Fatalf("Stats().Pending = %d, store holds %d tasks", got, n)
	}
}

func countTaskKeys(t testing.TB, e *Engine) int64 { return countPrefix(t, e, prefixTask) }

// countPrefix counts the store's keys that begin with prefix.
func countPrefix(t testing.TB, e *Engine, prefix byte) int64 {
	t.Helper()
	it, err := e.db.NewIter(&pebble.IterOptions{LowerBound: []byte{prefix}, UpperBound: []byte{prefix + 1}})
	if err != nil {
		t.Fatal(err)
	}
	defer it.Close()
	var n int64
	for ok := it.First(); ok; ok = it.Next() {
		n++
	}
	return n
}

// delivery is one Deliver outcome seen by recSink.
type delivery struct {
	ID       string
	Kind     codec.Kind
	Target   string
	Value    string
	Code     codec.Code
	Detail   string
	Attempts uint32
	At       time.Time // clock time of the delivery
	Err      error
}

// recSink records deliveries; fail decides per task whether it fails.
type recSink struct {
	clk  clock.Clock
	mu   sync.Mutex
	log  []delivery
	fail func(t *codec.Task) error
}

func newRecSink(clk clock.Clock) *recSink { return &recSink{clk: clk} }

func (s *recSink) Deliver(_ context.Context, batch []*codec.Task) []error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var errs []error
	for i, t := range batch {
		var err error
		if s.fail != nil {
			err = s.fail(t)
		}
		if err != nil && errs == nil {
			errs = make([]error, len(batch))
		}
		if errs != nil {
			errs[i] = err
		}
		s.log = append(s.log, delivery{ID: t.ID, Kind: t.Kind, Target: t.Target, Value: string(t.Value),
			Code: t.Code, Detail: t.Detail, Attempts: t.Attempts, At: s.clk.Now(), Err: err})
	}
	return errs
}

func (s *recSink) setFail(f func(t *codec.Task) error) {
	s.mu.Lock()
	s.fail = f
	s.mu.Unlock()
}

// acked returns the ids of acknowledged deliveries in order.
func (s *recSink) acked() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var ids []string
	for _, d := range s.log {
		if d.Err == nil {
			ids = append(ids, d.ID)
		}
	}
	return ids
}

func (s *recSink) all() []delivery {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]delivery(nil), s.log...)
}

func (s *recSink) reset() {
	s.mu.Lock()
	s.log = nil
	s.mu.Unlock()
}

// sched builds a schedule on partition 0 whose offset and stamp are n.
func sched(id string, due time.Time, n int64) codec.Task {
	return codec.Task{
		Kind: codec.KindSchedule, ID: id, Source: "src", Origin: fmt.Sprintf("kafka:src/0@%d", n),
		Stamp: ms(t0) + n, Partition: 0, Offset: n, Due: ms(due),
		Transport: codec.TransportKafka, Target: "out", Value: []byte(fmt.Sprintf("%s#%d", id, n)),
		DLQTransport: codec.TransportKafka, DLQ: "dlq",
	}
}

func cancelTask(id string, n int64) codec.Task {
	return codec.Task{
		Kind: codec.KindCancel, ID: id, Source: "src", Origin: fmt.Sprintf("kafka:src/0@%d", n),
		Stamp: ms(t0) + n, Partition: 0, Offset: n, Transport: codec.TransportKafka,
	}
}

func at(p int32, off, stamp int64, t codec.Task) codec.Task {
	t.Partition, t.Offset, t.Stamp = p, off, ms(t0)+stamp
	return t
}

// inc puts t in incarnation n of its partition's log.
func inc(n uint32, t codec.Task) codec.Task {
	t.Incarnation = n
	return t
}

// laneGraceForTests is the harness's Options.LaneGrace: the default unless
// DELAYBRIDGE_LANE_GRACE gives one (make test-long runs the package with
// 1ms, so that every engine test also runs with lanes going stuck).
func laneGraceForTests(t testing.TB) time.Duration {
	v := os.Getenv("DELAYBRIDGE_LANE_GRACE")
	if v == "" {
		return 0
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		t.Fatalf("DELAYBRIDGE_LANE_GRACE=%q: want a positive duration", v)
	}
	return d
}

// ingestAwaitedDL ingests a dead letter a source waits for (IngestAwait)
// and waits until its DLQ took it, then for the fire loops to settle: it
// goes out while firing is paused, as the source's progress needs it.
func (h *harness) ingestAwaitedDL(id string) {
	h.t.Helper()
	dl := codec.Task{Kind: codec.KindDeadLetter, ID: id, Source: "src", Origin: "kafka:src/0@14",
		Transport: codec.TransportKafka, Target: "dlq", Code: codec.CodeBadDue, Detail: "nope"}
	d, err := h.e.IngestAwait(context.Background(), []codec.Task{dl}, nil)
	if err != nil || d.Len() != 1 {
		h.t.Fatalf("IngestAwait = %d dead letters, %v; want 1", d.Len(), err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := d.Wait(ctx); err != nil {
		h.t.Fatalf("the awaited dead letter while paused: %v", err)
	}
	h.settle()
}

// waitSignal waits for a value on ch; the deadline only turns a hang into
// a failure that says what was awaited.
func waitSignal(t testing.TB, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(20 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
}
