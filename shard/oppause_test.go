package shard

import (
	"bytes"
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/metrics"
)

// TestOperatorPause: an operator's pause holds firing (an awaited dead
// letter still goes), outlasts a crash with its start and reason, keeps
// its start when asked for again, and is independent of the catch-up
// pause: firing resumes, in due order, only when neither holds it. A
// resume is durable too.
func TestOperatorPause(t *testing.T) {
	m := metrics.New(prometheus.NewRegistry())
	h := newHarness(t, func(o *Options) {
		o.FS = vfs.NewCrashableMem() // crashReopen moves to its crash clone
		o.Shards = 1                 // one fire loop: delivery order is due order
		o.Metrics = m
	})
	gauges := func(paused, byOperator float64) {
		t.Helper()
		if p, o := testutil.ToFloat64(m.FiringPaused), testutil.ToFloat64(m.FiringPausedByOperator); p != paused || o != byOperator {
			t.Fatalf("delaybridge_firing_paused %v, _by_operator %v; want %v, %v", p, o, paused, byOperator)
		}
		since := 0.0
		if st := h.e.Firing(); st.Operator != nil {
			since = float64(st.Operator.Since.Unix())
		}
		if got := testutil.ToFloat64(m.FiringPausedByOperatorSince); got != since || (byOperator == 1) != (since != 0) {
			t.Fatalf("delaybridge_firing_paused_by_operator_since_seconds %v, want %v", got, since)
		}
	}
	h.ingest([]codec.Task{sched("b", t0.Add(2*time.Second), 1), sched("a", t0.Add(time.Second), 2)})
	h.run()
	if st := h.e.Firing(); st.Paused || st.CatchingUp || st.Operator != nil {
		t.Fatalf("Firing() before any pause = %+v", st)
	}
	gauges(0, 0)

	st, err := h.e.PauseFiringByOperator("orders-svc deploy")
	if err != nil {
		t.Fatal(err)
	}
	want := OperatorPause{Since: Time{t0}, Reason: "orders-svc deploy"}
	if !st.Paused || st.CatchingUp || st.Operator == nil || *st.Operator != want {
		t.Fatalf("PauseFiringByOperator = %+v, want paused by %+v", st, want)
	}
	gauges(1, 1)
	h.advance(time.Minute)
	h.ingest([]codec.Task{sched("c", t0.Add(30*time.Second), 3)}) // overdue when ingested
	h.ingestAwaitedDL("bad")
	if got := h.sink.acked(); !slices.Equal(got, []string{"bad"}) {
		t.Fatalf("delivered while paused by the operator: %v; want only the awaited dead letter", got)
	}

	// Asked for again: no reason keeps all; a new one replaces the reason
	// and keeps the start.
	if st, err := h.e.PauseFiringByOperator(""); err != nil || *st.Operator != want {
		t.Fatalf("pause again without a reason = %+v, %v; want %+v kept", st, err, want)
	}
	want.Reason = "orders-svc deploy, take 2"
	if st, err := h.e.PauseFiringByOperator(want.Reason); err != nil || *st.Operator != want {
		t.Fatalf("pause again with a reason = %+v, %v; want %+v", st, err, want)
	}

	// A crash: the pause is in the store.
	h.crashReopen(h.opts.FS.(*vfs.MemFS))
	if st := h.e.Firing(); !st.Paused || st.Operator == nil || *st.Operator != want {
		t.Fatalf("after a crash Firing() = %+v, want paused by %+v", st, want)
	}
	gauges(1, 1)
	h.run()
	h.advance(time.Minute)
	if got := h.sink.acked(); !slices.Equal(got, []string{"bad"}) {
		t.Fatalf("delivered after the crash while paused: %v", got)
	}

	// The catch-up pause and the operator's are independent.
	h.e.PauseFiring()
	st, was, err := h.e.ResumeFiringByOperator()
	if err != nil || was == nil || *was != want || !st.Paused || !st.CatchingUp || st.Operator != nil {
		t.Fatalf("ResumeFiringByOperator while catching up = %+v, %+v, %v; want still paused, catching up", st, was, err)
	}
	gauges(1, 0)
	h.settle()
	if got := h.sink.acked(); !slices.Equal(got, []string{"bad"}) {
		t.Fatalf("delivered while still catching up: %v", got)
	}
	if _, err := h.e.PauseFiringByOperator("again"); err != nil {
		t.Fatal(err)
	}
	h.e.ResumeFiring()
	if st := h.e.Firing(); !st.Paused || st.CatchingUp || st.Operator == nil {
		t.Fatalf("after ResumeFiring under an operator's pause: %+v, want still paused by the operator", st)
	}
	h.settle()
	if got := h.sink.acked(); !slices.Equal(got, []string{"bad"}) {
		t.Fatalf("the catch-up's resume ended the operator's pause: delivered %v", got)
	}
	st, was, err = h.e.ResumeFiringByOperator()
	if err != nil || was == nil || was.Reason != "again" || st.Paused {
		t.Fatalf("ResumeFiringByOperator = %+v, %+v, %v; want not paused", st, was, err)
	}
	gauges(0, 0)
	h.settle()
	if got, want := h.sink.acked(), []string{"bad", "a", "b", "c"}; !slices.Equal(got, want) {
		t.Fatalf("delivered %v after the resume, want %v (due order)", got, want)
	}
	if st, was, err := h.e.ResumeFiringByOperator(); err != nil || was != nil || st.Paused {
		t.Fatalf("a second resume = %+v, %+v, %v; want nothing to end", st, was, err)
	}

	// The resume is durable: a crash does not bring the pause back.
	h.ingest([]codec.Task{sched("d", t0.Add(time.Hour), 4)})
	h.crashReopen(h.opts.FS.(*vfs.MemFS))
	if st := h.e.Firing(); st.Paused {
		t.Fatalf("after a resume and a crash Firing() = %+v, want not paused", st)
	}
	h.run()
	h.advance(time.Hour)
	if got := h.sink.acked(); !slices.Contains(got, "d") {
		t.Fatalf("delivered %v, want d after the reopen", got)
	}
	h.checkPending()
}

// TestOperatorPauseReason: the reasons PauseFiringByOperator keeps and the
// ones it refuses with ErrPauseReason, leaving firing as it was.
func TestOperatorPauseReason(t *testing.T) {
	h := newHarness(t, nil)
	for _, tc := range []struct {
		name, reason string
		ok           bool
	}{
		{"none", "", true},
		{"text", "migrating the orders topic (ticket OPS-1234)", true},
		{"unicode", "Wartung bis 09:00 — bitte warten ✓", true},
		{"longest", strings.Repeat("x", MaxPauseReason), true},
		{"too long", strings.Repeat("x", MaxPauseReason+1), false},
		{"not UTF-8", "bad \xff byte", false},
		{"newline", "two\nlines", false},
		{"NUL", "nul\x00", false},
		{"escape", "\x1b[31mred", false},
		{"C1 control", "next\u0085line", false},
		{"line separator", "a\u2028b", false},
		{"paragraph separator", "a\u2029b", false},
		{"bidi override", "deploy \u202egnirts", false},
		{"zero-width space", "a\u200bb", false},
		{"joiners", "می\u200cخواهم 👩\u200d💻", true},
		{"BOM", "\ufeffx", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st, err := h.e.PauseFiringByOperator(tc.reason)
			if !tc.ok {
				if !errors.Is(err, ErrPauseReason) {
					t.Fatalf("PauseFiringByOperator(%q) = %+v, %v; want ErrPauseReason", tc.reason, st, err)
				}
				if h.e.FiringPaused() {
					t.Fatal("paused by a refused reason")
				}
				return
			}
			if err != nil || st.Operator == nil || st.Operator.Reason != tc.reason {
				t.Fatalf("PauseFiringByOperator(%q) = %+v, %v", tc.reason, st, err)
			}
			h.reopen()
			if st := h.e.Firing(); st.Operator == nil || st.Operator.Reason != tc.reason {
				t.Fatalf("after a reopen Firing() = %+v, want reason %q", st, tc.reason)
			}
			if _, _, err := h.e.ResumeFiringByOperator(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestOperatorPauseStoreFails: a pause whose record cannot be synced is
// refused with ErrStoreFailed and does not pause; after a pause, a resume
// whose delete cannot be synced is refused and the pause holds; after the
// restart the failed store needs, each may have reached the disk. On a
// closed engine both are ErrClosed.
func TestOperatorPauseStoreFails(t *testing.T) {
	for _, op := range []string{"pause", "resume"} {
		t.Run(op, func(t *testing.T) {
			toggle := &errorfs.Toggle{Injector: errorfs.InjectorFunc(func(op errorfs.Op) error {
				if strings.HasSuffix(op.Path, ".log") && (op.Kind == errorfs.OpFileSync || op.Kind == errorfs.OpFileSyncData || op.Kind == errorfs.OpFileSyncTo) {
					return errorfs.ErrInjected
				}
				return nil
			})}
			h := newHarness(t, func(o *Options) { o.FS = errorfs.Wrap(vfs.Default, toggle) })
			if op == "resume" {
				if _, err := h.e.PauseFiringByOperator("x"); err != nil {
					t.Fatal(err)
				}
			}
			toggle.On()
			var err error
			if op == "pause" {
				_, err = h.e.PauseFiringByOperator("x")
			} else {
				_, _, err = h.e.ResumeFiringByOperator()
			}
			if !errors.Is(err, ErrStoreFailed) {
				t.Fatalf("%s with a failing WAL sync = %v, want ErrStoreFailed", op, err)
			}
			if got, want := h.e.FiringPaused(), op == "resume"; got != want {
				t.Fatalf("paused %v after the failed %s, want %v", got, op, want)
			}
			// The restart the failed store needs replays what reached
			// the WAL before its sync failed: the refused pause holds,
			// the refused resume does not (R224; README says to check
			// GET /v1/firing after it).
			toggle.Off()
			h.reopen()
			if got, want := h.e.FiringPaused(), op == "pause"; got != want {
				t.Fatalf("after the refused %s and a restart: paused %v, want %v (the write reached the WAL)", op, got, want)
			}
			h.close()
			if _, err := (&Engine{closed: true}).PauseFiringByOperator(""); !errors.Is(err, ErrClosed) {
				t.Fatalf("pause on a closed engine = %v", err)
			}
			if _, _, err := (&Engine{closed: true}).ResumeFiringByOperator(); !errors.Is(err, ErrClosed) {
				t.Fatalf("resume on a closed engine = %v", err)
			}
		})
	}
}

// TestOperatorPauseRecord: the stored record's decoding, and a record that
// does not decode still pauses at Open.
func TestOperatorPauseRecord(t *testing.T) {
	for _, tc := range []struct {
		name string
		v    []byte
		ok   bool
	}{
		{"empty", nil, false},
		{"short", []byte{0, 0, 1}, false},
		{"no reason", appendPause(nil, OperatorPause{Since: Time{t0}}), true},
		{"reason", appendPause(nil, OperatorPause{Since: Time{t0}, Reason: "why"}), true},
		{"past MaxDue", appendPause(nil, OperatorPause{Since: Time{time.UnixMilli(codec.MaxDue + 1)}}), false},
		{"bad reason", append(appendPause(nil, OperatorPause{Since: Time{t0}}), 0xff), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := decodePause(tc.v)
			if tc.ok != (err == nil) {
				t.Fatalf("decodePause(%x) = %+v, %v; want ok %v", tc.v, p, err, tc.ok)
			}
			if err == nil && !bytes.Equal(appendPause(nil, p), tc.v) {
				t.Fatalf("decodePause(%x) = %+v does not encode back", tc.v, p)
			}
			if err != nil && !errors.Is(err, errPauseRecord) {
				t.Fatalf("decodePause(%x) = %v, want errPauseRecord", tc.v, err)
			}
		})
	}

	h := newHarness(t, nil)
	if err := h.e.db.Set(pauseKey, []byte{1, 2}, pebble.Sync); err != nil {
		t.Fatal(err)
	}
	h.close()
	h.clk.Set(t0.Add(time.Hour))
	h.open()
	st := h.e.Firing()
	if !st.Paused || st.Operator == nil || !st.Operator.Since.Equal(t0.Add(time.Hour)) || !strings.Contains(st.Operator.Reason, "could not be read") {
		t.Fatalf("Firing() with a corrupt record = %+v, want paused since the Open, saying so", st)
	}
	if _, _, err := h.e.ResumeFiringByOperator(); err != nil {
		t.Fatal(err)
	}
	h.reopen()
	if h.e.FiringPaused() {
		t.Fatal("a resumed corrupt record paused again")
	}
}

// FuzzDecodePause: decodePause never panics, and what it accepts encodes
// back to the same bytes.
func FuzzDecodePause(f *testing.F) {
	f.Add(appendPause(nil, OperatorPause{Since: Time{t0}, Reason: "deploy"}))
	f.Add([]byte{})
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 'x'})
	f.Fuzz(func(t *testing.T, v []byte) {
		p, err := decodePause(v)
		if err != nil {
			return
		}
		if !bytes.Equal(appendPause(nil, p), v) {
			t.Fatalf("decodePause(%x) = %+v encodes to %x", v, p, appendPause(nil, p))
		}
	})
}

// TestOperatorPauseInFlight: a batch being published when the pause comes
// finishes, and Firing's InFlight counts it until then, so an operator
// knows when nothing more goes out; nothing else fires after it.
func TestOperatorPauseInFlight(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.Shards = 1; o.FireBatch = 2 })
	g := &gateSink{recSink: h.sink, entered: make(chan struct{}, 1), release: make(chan struct{})}
	var once sync.Once
	release := func() { once.Do(func() { close(g.release) }) }
	t.Cleanup(release) // before the harness stops the loop blocked in the sink
	gate := "a"
	g.gate.Store(&gate)
	ctx, cancel := context.WithCancel(context.Background())
	h.cancel, h.done = cancel, make(chan error, 1)
	go func() { h.done <- h.e.Run(ctx, g) }()
	h.ingest([]codec.Task{sched("a", t0.Add(time.Second), 1), sched("b", t0.Add(time.Second), 2), sched("c", t0.Add(2*time.Second), 3)})
	h.clk.Advance(time.Minute)
	select {
	case <-g.entered:
	case <-time.After(20 * time.Second):
		t.Fatal("the batch did not reach the sink")
	}
	st, err := h.e.PauseFiringByOperator("")
	if err != nil || st.InFlight != 2 {
		t.Fatalf("PauseFiringByOperator with a batch of 2 in the sink = %+v, %v; want InFlight 2", st, err)
	}
	release()
	h.settle()
	if st := h.e.Firing(); st.InFlight != 0 || !st.Paused {
		t.Fatalf("Firing() after the batch = %+v, want paused, none in flight", st)
	}
	if got := h.sink.acked(); !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("delivered %v, want the batch in flight (a, b) and not c", got)
	}
	if _, _, err := h.e.ResumeFiringByOperator(); err != nil {
		t.Fatal(err)
	}
	h.settle()
	if got := h.sink.acked(); !slices.Equal(got, []string{"a", "b", "c"}) {
		t.Fatalf("delivered %v after the resume, want c too", got)
	}
}
