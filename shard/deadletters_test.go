package shard

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/metrics"
)

// IngestAwait's DeadLetters: done once the sink acknowledged every dead
// letter of the batch, not before; a batch without one needs no wait; a
// Wait that gives up stops watching its dead letters.
func TestIngestAwaitDeadLetters(t *testing.T) {
	dl := func(off int64) codec.Task {
		return codec.Task{Kind: codec.KindDeadLetter, ID: "bad", Source: "src", Origin: "kafka:src/0@" + strconv.FormatInt(off, 10),
			Transport: codec.TransportKafka, Target: "dlq", Code: codec.CodeBadDue, Detail: "nope"}
	}
	ctx := context.Background()

	t.Run("no dead letter", func(t *testing.T) {
		h := newHarness(t, nil)
		d, err := h.e.IngestAwait(ctx, []codec.Task{sched("a", t0.Add(time.Hour), 1)}, nil)
		if err != nil || d != nil || d.Len() != 0 {
			t.Fatalf("IngestAwait = %v, %v; want nil, nil", d, err)
		}
		if err := d.Wait(ctx); err != nil {
			t.Fatalf("Wait of nil = %v", err)
		}
	})

	t.Run("acknowledged", func(t *testing.T) {
		h := newHarness(t, nil)
		fail := errors.New("dlq down")
		h.sink.setFail(func(*codec.Task) error { return fail })
		h.run()
		d, err := h.e.IngestAwait(ctx, []codec.Task{dl(1), sched("a", t0.Add(time.Hour), 2), dl(3)}, nil)
		if err != nil || d.Len() != 2 {
			t.Fatalf("IngestAwait = %d dead letters, %v; want 2", d.Len(), err)
		}
		h.settle() // the first delivery failed
		short, cancel := context.WithCancel(ctx)
		cancel()
		if err := d.Wait(short); err == nil {
			t.Fatal("Wait returned nil while the sink refused the dead letters")
		}
		// The failed Wait stopped watching: a second batch's wait is
		// independent of it.
		d2, err := h.e.IngestAwait(ctx, []codec.Task{dl(4)}, nil)
		if err != nil {
			t.Fatal(err)
		}
		h.e.dl.mu.Lock()
		watched := len(h.e.dl.m)
		h.e.dl.mu.Unlock()
		if watched != 1 {
			t.Fatalf("%d dead letters watched, want 1 (the second batch's)", watched)
		}
		h.sink.setFail(nil)
		waited := make(chan error, 1)
		go func() { waited <- d2.Wait(ctx) }()
		for {
			select {
			case err := <-waited:
				if err != nil {
					t.Fatalf("Wait after the DLQ recovered = %v", err)
				}
				h.settle()
				if n := len(h.sink.acked()); n != 3 {
					t.Fatalf("%d dead letters acknowledged, want 3 (the given-up wait's too)", n)
				}
				return
			default:
				h.advance(time.Second) // the retry of the failed deliveries
			}
		}
	})
}

// parkPolicy: attempts at 0, +100ms, +300ms, then every second or so.
var parkPolicy = RetryPolicy{Initial: 100 * time.Millisecond, Max: time.Second, Multiplier: 2, Jitter: -1, MaxAttempts: 3}

// deadLetter is a dead letter of source src with id (and origin offset) n.
func deadLetter(id string, n int64) codec.Task {
	return codec.Task{Kind: codec.KindDeadLetter, ID: id, Source: "src", Origin: "kafka:src/0@" + strconv.FormatInt(n, 10),
		Transport: codec.TransportKafka, Target: "dlq", Code: codec.CodeBadDue, Detail: "nope", Value: []byte(id)}
}

// deliveriesOf counts the sink's deliveries (failed ones too) of id.
func (s *recSink) deliveriesOf(id string) int {
	n := 0
	for _, d := range s.all() {
		if d.ID == id {
			n++
		}
	}
	return n
}

// advanceUntil moves the fake clock in small steps until cond holds; the
// bound only turns a hang into a failure.
func (h *harness) advanceUntil(what string, cond func() bool) {
	h.t.Helper()
	for range 1000 {
		if cond() {
			return
		}
		h.advance(50 * time.Millisecond)
	}
	h.t.Fatalf("clock moved 50s, still waiting for %s", what)
}

// waitReleased reports whether d.Wait would return nil at once, without
// calling it (a Wait that gives up stops watching the dead letters).
func waitReleased(d *DeadLetters) (bool, error) {
	select {
	case <-d.done:
		return true, nil
	default:
		return false, errors.New("the wait goes on")
	}
}

// A dead letter its DLQ refuses as this message (ErrRefused: too large for
// the DLQ, a record the broker rejects) is parked at the retry policy's
// last attempt, not before: the source's wait ends so the partition moves
// on (CONTRACT §3: one bad message never stalls its partition), the dead
// letter stays in the store and is retried, and the engine is not ready
// until the DLQ takes it. A DLQ failing as a whole (unreachable, or a
// failure that is not a refusal of the message: no permission, no stream,
// a full stream) parks nothing however long it lasts: the source waits.
func TestDeadLetterParked(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name   string
		err    error
		parked bool
	}{
		{"refused", fmt.Errorf("kafka: publish to \"dlq\": %w: message too large", ErrRefused), true},
		{"dlq not authorized", errors.New("kafka: publish to \"dlq\": not authorized to write the topic"), false},
		{"dlq without a stream", errors.New("nats sink: dead letter: no stream captures the subject \"dlq\""), false},
		{"unreachable", fmt.Errorf("dial: connection refused: %w", ErrUnavailable), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := metrics.New(nil)
			h := newHarness(t, func(o *Options) {
				o.Retry = parkPolicy
				o.Metrics = m
			})
			h.sink.setFail(func(*codec.Task) error { return tc.err })
			h.run()
			d, err := h.e.IngestAwait(ctx, []codec.Task{deadLetter("bad", 1)}, nil)
			if err != nil || d.Len() != 1 {
				t.Fatalf("IngestAwait = %d dead letters, %v; want 1", d.Len(), err)
			}
			h.settle()
			// One attempt short of the policy: nothing is parked yet.
			h.advanceUntil("the attempts before the last", func() bool { return h.sink.deliveriesOf("bad") >= parkPolicy.MaxAttempts-1 })
			if n := h.sink.deliveriesOf("bad"); n != parkPolicy.MaxAttempts-1 {
				t.Fatalf("%d attempts, want %d", n, parkPolicy.MaxAttempts-1)
			}
			if ok, _ := waitReleased(d); ok || d.Parked() != 0 {
				t.Fatalf("after %d refusals: wait released %v, parked %d; want neither", parkPolicy.MaxAttempts-1, ok, d.Parked())
			}
			if got := testutil.ToFloat64(m.DeadLettersParkedNow); got != 0 {
				t.Fatalf("parked gauge %v before the last attempt", got)
			}
			// The last attempt of the policy, and well past it.
			h.advanceUntil("the last attempt", func() bool { return h.sink.deliveriesOf("bad") >= parkPolicy.MaxAttempts })
			if tc.parked {
				if ok, err := waitReleased(d); !ok || d.Parked() != 1 {
					t.Fatalf("after %d refusals: Wait = %v, parked %d; want nil, 1", parkPolicy.MaxAttempts, err, d.Parked())
				}
			}
			h.advanceUntil("more retries", func() bool { return h.sink.deliveriesOf("bad") >= parkPolicy.MaxAttempts+3 })
			ok, _ := waitReleased(d)
			if ok != tc.parked || d.Parked() != map[bool]int{true: 1}[tc.parked] {
				t.Fatalf("wait released %v, parked %d; want %v", ok, d.Parked(), tc.parked)
			}
			want := map[bool]float64{true: 1}[tc.parked]
			if got := testutil.ToFloat64(m.DeadLettersParked); got != want {
				t.Fatalf("parked counter %v, want %v (an entry, not a retry)", got, want)
			}
			if got := testutil.ToFloat64(m.DeadLettersParkedNow); got != want {
				t.Fatalf("parked gauge %v, want %v", got, want)
			}
			if h.e.Err() == nil {
				t.Fatal("engine healthy while its DLQ fails")
			}
			if n := len(h.sink.acked()); n != 0 {
				t.Fatalf("%d acknowledged", n)
			}
			if p := h.e.Stats().Pending; p != 1 {
				t.Fatalf("%d pending, want the dead letter kept", p)
			}
			// The DLQ takes it at last: delivered, the engine healthy again.
			h.sink.setFail(nil)
			h.advanceUntil("the DLQ taking it", func() bool { return len(h.sink.acked()) == 1 })
			if err := h.e.Err(); err != nil {
				t.Fatalf("Err after the DLQ recovered: %v", err)
			}
			if got := testutil.ToFloat64(m.DeadLettersParkedNow); got != 0 {
				t.Fatalf("parked gauge %v after the DLQ took it", got)
			}
			if ok, err := waitReleased(d); !ok {
				t.Fatalf("Wait after the DLQ took it = %v", err)
			}
		})
	}
}

// A parked dead letter keeps the engine not ready, and the gauge at 1,
// while other dead letters of its shard, to the same DLQ, are acknowledged;
// both change only when the DLQ takes the parked one.
func TestDeadLetterParkedSticky(t *testing.T) {
	ctx := context.Background()
	m := metrics.New(nil)
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.Retry = parkPolicy
		o.Metrics = m
	})
	refusal := fmt.Errorf("kafka: publish to \"dlq\": %w: message too large", ErrRefused)
	h.sink.setFail(func(t *codec.Task) error {
		if t.ID == "big" {
			return refusal
		}
		return nil
	})
	h.run()
	d, err := h.e.IngestAwait(ctx, []codec.Task{deadLetter("big", 1)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	h.settle()
	h.advanceUntil("the park", func() bool { return d.Parked() == 1 })
	if err := h.e.Err(); err == nil || !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "1 dead letters parked") {
		t.Fatalf("Err = %v, want the parked dead letter and its refusal", err)
	}
	d2, err := h.e.IngestAwait(ctx, []codec.Task{deadLetter("small", 2)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := d2.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	h.settle()
	if got := h.sink.acked(); len(got) != 1 || got[0] != "small" {
		t.Fatalf("acknowledged %v, want [small]", got)
	}
	if err := h.e.Err(); err == nil || !errors.Is(err, ErrRefused) {
		t.Fatalf("Err = %v after another dead letter was acknowledged, want the parked one still reported", err)
	}
	if got := testutil.ToFloat64(m.DeadLettersParkedNow); got != 1 {
		t.Fatalf("parked gauge %v, want 1", got)
	}
	if p := h.e.Stats().Pending; p != 1 {
		t.Fatalf("%d pending, want the parked dead letter", p)
	}
	// More refusals: still one entry into the parked set.
	n := h.sink.deliveriesOf("big")
	h.advanceUntil("more refusals", func() bool { return h.sink.deliveriesOf("big") >= n+2 })
	if got := testutil.ToFloat64(m.DeadLettersParked); got != 1 {
		t.Fatalf("parked counter %v, want 1", got)
	}
	h.sink.setFail(nil)
	h.advanceUntil("the DLQ taking it", func() bool { return len(h.sink.acked()) == 2 })
	if err := h.e.Err(); err != nil {
		t.Fatalf("Err after the DLQ took the parked dead letter: %v", err)
	}
	if got := testutil.ToFloat64(m.DeadLettersParkedNow); got != 0 {
		t.Fatalf("parked gauge %v, want 0", got)
	}
}

// errDLQDenied is the answer of a DLQ the bridge may not write.
var errDLQDenied = errors.New("kafka: publish to \"dlq\": not authorized to write the topic")

// deniedDLQHarness is a one-shard harness with parkPolicy whose DLQ "dlq"
// fails every dead letter as a whole (errDLQDenied); other, if not nil,
// answers for the other targets' tasks.
func deniedDLQHarness(t *testing.T, other func(*codec.Task) error) *harness {
	t.Helper()
	h := newHarness(t, func(o *Options) {
		o.Shards = 1
		o.Retry = parkPolicy
	})
	h.sink.setFail(func(t *codec.Task) error {
		switch {
		case t.Target == "dlq":
			return errDLQDenied
		case other != nil:
			return other(t)
		}
		return nil
	})
	return h
}

// A dead letter whose DLQ fails as a whole holds its source and keeps the
// engine not ready until that dead letter is delivered, although another
// dead letter of its shard (another source's DLQ) is acknowledged
// meanwhile.
func TestDeadLetterHeldSticky(t *testing.T) {
	ctx := context.Background()
	h := deniedDLQHarness(t, nil)
	h.run()
	d, err := h.e.IngestAwait(ctx, []codec.Task{deadLetter("held", 1)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	h.settle()
	other := deadLetter("other", 2)
	other.Source, other.Target = "src2", "dlq2"
	d2, err := h.e.IngestAwait(ctx, []codec.Task{other}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := d2.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	h.settle()
	if err := h.e.Err(); err == nil || !errors.Is(err, errDLQDenied) {
		t.Fatalf("Err = %v after another DLQ took its dead letter, want the held one reported", err)
	}
	if ok, _ := waitReleased(d); ok {
		t.Fatal("the held dead letter's wait ended")
	}
	h.sink.setFail(nil)
	h.advanceUntil("the DLQ taking it", func() bool { return len(h.sink.acked()) == 2 })
	if err := h.e.Err(); err != nil {
		t.Fatalf("Err after the DLQ took it: %v", err)
	}
}

// Readiness counts the failing dead letters that hold their source apart
// from those that hold nothing (a task dead-lettered at its due time):
// "their sources wait" said of both sent an operator looking for a stuck
// partition that was not there.
func TestDeadLetterErrCountsHeld(t *testing.T) {
	ctx := context.Background()
	h := deniedDLQHarness(t, func(t *codec.Task) error {
		return &RejectedError{Code: codec.CodeTargetNotAllowed, Err: errors.New("not allowed")}
	})
	h.run()
	if _, err := h.e.IngestAwait(ctx, []codec.Task{deadLetter("held", 1)}, nil); err != nil {
		t.Fatal(err)
	}
	h.ingest([]codec.Task{sched("x", t0, 2)})
	h.advanceUntil("both dead letters failing", func() bool {
		failed := map[string]bool{}
		for _, d := range h.sink.all() {
			if d.Kind == codec.KindDeadLetter && d.Err != nil {
				failed[d.ID] = true
			}
		}
		return failed["held"] && failed["x"]
	})
	err := h.e.Err()
	if err == nil || !errors.Is(err, errDLQDenied) || !strings.Contains(err.Error(), "2 dead letters, 1 of them held by their source partition") {
		t.Fatalf("Err = %v, want 2 failing dead letters, 1 held", err)
	}
}

// Failing and parked dead letters survive a restart: the reopened engine
// reports them at once (not ready, the parked gauge), before their next
// try, and forgets them, in the store too, once their DLQ took them. A
// record whose dead letter is not stored where it says is dropped.
func TestDeadLetterFailuresSurviveRestart(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t, func(o *Options) {
		o.Shards = 2
		o.Retry = parkPolicy
		o.Metrics = metrics.New(nil)
	})
	refusal := fmt.Errorf("kafka: publish to \"dlq\": %w: message too large", ErrRefused)
	denied := errors.New("kafka: publish to \"dlq\": not authorized to write the topic")
	h.sink.setFail(func(t *codec.Task) error {
		switch t.ID {
		case "big":
			return refusal
		case "held":
			return denied
		}
		return nil
	})
	h.run()
	d, err := h.e.IngestAwait(ctx, []codec.Task{deadLetter("big", 1), deadLetter("held", 2)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	h.settle()
	h.advanceUntil("the park", func() bool { return d.Parked() == 1 })
	restart := func() *metrics.Metrics {
		t.Helper()
		h.stop()
		prev := h.opts.Metrics
		m := metrics.New(nil) // a new process
		h.opts.Metrics = m
		h.reopen()
		// The closed engine took its parked dead letters off the gauge.
		if got := testutil.ToFloat64(prev.DeadLettersParkedNow); got != 0 {
			t.Fatalf("parked gauge of the closed engine %v, want 0", got)
		}
		return m
	}
	if got := testutil.ToFloat64(h.opts.Metrics.DeadLettersParkedNow); got != 1 {
		t.Fatalf("parked gauge %v, want 1", got)
	}
	m := restart()
	err = h.e.Err()
	if err == nil || !errors.Is(err, errDLFailedBefore) ||
		!strings.Contains(err.Error(), "1 dead letters parked") || !strings.Contains(err.Error(), "failing (1 dead letters") ||
		!strings.Contains(err.Error(), "message too large") {
		t.Fatalf("Err after the restart = %v, want one parked (message too large) and one failing dead letter", err)
	}
	if got := testutil.ToFloat64(m.DeadLettersParkedNow); got != 1 {
		t.Fatalf("parked gauge after the restart %v, want 1", got)
	}
	h.sink.setFail(nil)
	h.run()
	h.advanceUntil("both delivered", func() bool { return len(h.sink.acked()) == 2 })
	if err := h.e.Err(); err != nil {
		t.Fatalf("Err after both were delivered: %v", err)
	}
	if got := testutil.ToFloat64(m.DeadLettersParkedNow); got != 0 {
		t.Fatalf("parked gauge %v, want 0", got)
	}
	// A record of a dead letter the store does not hold there (a version
	// without these records delivered or retried it).
	if err := h.e.db.Set(dlFailureKey(1, 999), appendDLFailure(nil, 5, true, refusal), pebble.Sync); err != nil {
		t.Fatal(err)
	}
	m = restart()
	if err := h.e.Err(); err != nil {
		t.Fatalf("Err after a restart with nothing failing: %v", err)
	}
	if got := testutil.ToFloat64(m.DeadLettersParkedNow); got != 0 {
		t.Fatalf("parked gauge %v, want 0", got)
	}
	for sh := range 2 {
		it, err := h.e.db.NewIter(&pebble.IterOptions{LowerBound: dlFailureKey(sh, 0), UpperBound: dlFailureKey(sh+1, 0)})
		if err != nil {
			t.Fatal(err)
		}
		for it.First(); it.Valid(); it.Next() {
			t.Errorf("shard %d: failure record %x left in the store", sh, it.Key())
		}
		if err := it.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

func TestDLFailureRecord(t *testing.T) {
	long := errors.New(strings.Repeat("x", 2*dlFailureMaxText))
	for _, tc := range []struct {
		name   string
		fire   int64
		parked bool
		err    error
		text   string
	}{
		{"parked", 1234, true, errors.New("too large"), "too large"},
		{"held", 0, false, errors.New("denied"), "denied"},
		{"no error", 7, false, nil, ""},
		{"long error cut", 9, true, long, strings.Repeat("x", dlFailureMaxText)},
		{"long error cut at a rune start", 9, true, errors.New("x" + strings.Repeat("é", dlFailureMaxText)), "x" + strings.Repeat("é", (dlFailureMaxText-1)/2)},
		{"long error that is not UTF-8 cut at the limit", 9, true, errors.New(strings.Repeat("\x80", dlFailureMaxText+5)), strings.Repeat("\x80", dlFailureMaxText)},
	} {
		k, v := dlFailureKey(3, 42), appendDLFailure(nil, tc.fire, tc.parked, tc.err)
		sh, seq, fire, parked, text, ok := parseDLFailure(k, v)
		if !ok || sh != 3 || seq != 42 || fire != tc.fire || parked != tc.parked || text != tc.text {
			t.Errorf("%s: parsed %d %d %d %v %q %v", tc.name, sh, seq, fire, parked, text, ok)
		}
	}
	for _, bad := range []struct{ k, v []byte }{
		{dlFailureKey(0, 1)[:5], appendDLFailure(nil, 1, false, nil)},
		{dlFailureKey(0, 1), []byte{1, 2, 3}},
		{dlFailureKey(0, 1), append(appendDLFailure(nil, 1, false, nil)[:8], 2)},
		{append([]byte{prefixTask}, dlFailureKey(0, 1)[1:]...), appendDLFailure(nil, 1, false, nil)},
	} {
		if _, _, _, _, _, ok := parseDLFailure(bad.k, bad.v); ok {
			t.Errorf("parseDLFailure(%x, %x) accepted", bad.k, bad.v)
		}
	}
}

// FuzzParseDLFailure: a failure record read back from the store never
// panics the decoder, and an accepted one is exactly the encoding of what
// it decoded to.
func FuzzParseDLFailure(f *testing.F) {
	f.Add(dlFailureKey(2, 7), appendDLFailure(nil, 1234, true, errors.New("too large")))
	f.Add(dlFailureKey(0, 0), appendDLFailure(nil, 0, false, nil))
	f.Add([]byte{prefixDLFailure}, []byte{})
	f.Fuzz(func(t *testing.T, k, v []byte) {
		sh, seq, fire, parked, text, ok := parseDLFailure(k, v)
		if !ok {
			return
		}
		if got := dlFailureKey(sh, seq); string(got) != string(k) {
			t.Fatalf("key %x decoded to shard %d seq %d, which encode to %x", k, sh, seq, got)
		}
		var err error
		if text != "" {
			err = errors.New(text)
		}
		if fire >= 0 && len(text) <= dlFailureMaxText {
			if got := appendDLFailure(nil, fire, parked, err); string(got) != string(v) {
				t.Fatalf("value %x decoded to %d %v %q, which encode to %x", v, fire, parked, text, got)
			}
		}
	})
}

// TestDeadLetterErrNamesEachDLQ: with two DLQs failing, Err names the
// last failure of each, not only the latest of all: an operator who fixes
// the one named would find the bridge still not ready for the other.
func TestDeadLetterErrNamesEachDLQ(t *testing.T) {
	h := newHarness(t, nil)
	h.sink.setFail(func(t *codec.Task) error {
		if t.Transport == codec.TransportKafka {
			return errors.New(`kafka: publish to "dlq": unknown topic`)
		}
		return errors.New(`nats: no JetStream stream captures subject "dlq.x"`)
	})
	k, n := deadLetter("k", 1), deadLetter("n", 2)
	n.Transport, n.Target = codec.TransportNATS, "dlq.x"
	h.ingest([]codec.Task{k, n})
	h.run()
	err := h.e.Err()
	if err == nil || !strings.Contains(err.Error(), "2 dead letters") ||
		!strings.Contains(err.Error(), "unknown topic") || !strings.Contains(err.Error(), "no JetStream stream") {
		t.Fatalf("Err = %v, want both DLQs' failures named", err)
	}
}

// TestAwaitedDeadLetterAfterLongOutage: a dead letter its source waits
// for, whose DLQ broker is unreachable for 20 minutes, is tried again
// within awaitedDeadLetterWait of the broker's return, not after the
// outage backoff (as long again as it is overdue, up to Retry.Max: 5 min),
// so the source goes on at once. A dead letter no source waits for keeps
// the outage backoff.
func TestAwaitedDeadLetterAfterLongOutage(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.Retry = defaultLikeRetry })
	down := fmt.Errorf("dlq broker down: %w", ErrUnavailable)
	h.sink.setFail(func(*codec.Task) error { return down })
	h.run()
	awaited := h.ingestAwaitedAndNot()
	h.settle()
	for range 20 { // the outage: a minute at a time
		h.advance(time.Minute)
	}
	h.sink.setFail(nil)
	h.awaitedTakenFirst(awaited, "the DLQ broker came back", true)
}

// TestAwaitedDeadLetterAfterLongDLQFailure is
// TestAwaitedDeadLetterAfterLongOutage for a DLQ that fails as a whole
// with an answer that is not an outage (the bridge not authorized to
// write the topic, no stream capturing the subject, a full stream):
// each try is an attempt, and the attempts' backoff grew to Retry.Max,
// so once the operator fixed the DLQ after 20 minutes the source went on
// only up to 5 min later (hunt H173: 3m57s measured for a Kafka DLQ
// not authorized for 10 min, 2m35s for a full NATS DLQ stream). A dead
// letter no source waits for, and one its DLQ refuses as this message
// (parked at the last attempt of the policy), keep the backoff.
func TestAwaitedDeadLetterAfterLongDLQFailure(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t, func(o *Options) { o.Retry = defaultLikeRetry })
	denied := errors.New("kafka: publish to \"dlq\": not authorized to write the topic")
	refused := fmt.Errorf("kafka: publish to \"dlq\": %w: message too large", ErrRefused)
	var fixed atomic.Bool
	h.sink.setFail(func(t *codec.Task) error {
		switch {
		case t.ID == "too-large":
			return refused
		case fixed.Load():
			return nil
		}
		return denied
	})
	h.run()
	awaited := h.ingestAwaitedAndNot()
	tooLarge, err := h.e.IngestAwait(ctx, []codec.Task{deadLetter("too-large", 3)}, []Checkpoint{{Key: "src|1", Offset: 1}})
	if err != nil || tooLarge.Len() != 1 {
		t.Fatalf("IngestAwait = %d dead letters, %v; want 1", tooLarge.Len(), err)
	}
	h.settle()
	for range 20 {
		h.advance(time.Second)
	}
	// Its backoff: 0.5, 1, 2, 4, 8 s (+-20%); every 2 s would be 10 tries.
	if n := h.sink.deliveriesOf("too-large"); n > 7 {
		t.Fatalf("a dead letter its DLQ refuses as this message tried %d times in 20 s: not its backoff", n)
	}
	for range 20 { // the DLQ failing for 20 minutes, a minute at a time
		h.advance(time.Minute)
	}
	fixed.Store(true)
	h.awaitedTakenFirst(awaited, "the DLQ was fixed", false)
}

// defaultLikeRetry is the shipped retry policy (config defaults).
var defaultLikeRetry = RetryPolicy{Initial: 500 * time.Millisecond, Max: 5 * time.Minute, Multiplier: 2, Jitter: 0.2, MaxAttempts: 10}

// ingestAwaitedAndNot ingests dead letter "awaited", which source key
// src|0 waits for, and "unawaited", which no source waits for; it returns
// the wait of the first.
func (h *harness) ingestAwaitedAndNot() *DeadLetters {
	h.t.Helper()
	ctx := context.Background()
	awaited, err := h.e.IngestAwait(ctx, []codec.Task{deadLetter("awaited", 1)}, []Checkpoint{{Key: "src|0", Offset: 1}})
	if err != nil || awaited.Len() != 1 {
		h.t.Fatalf("IngestAwait = %d dead letters, %v; want 1", awaited.Len(), err)
	}
	if err := h.e.Ingest(ctx, []codec.Task{deadLetter("unawaited", 2)}, nil); err != nil {
		h.t.Fatal(err)
	}
	return awaited
}

// awaitedTakenFirst checks, once the DLQ takes dead letters again (what
// says how), that the awaited one is taken within awaitedDeadLetterWait.
// After an outage (outage true) the unawaited one goes with it: its DLQ
// is back (recover.go). After a failure that charged attempts it waits its
// own backoff (5 min at most): the 2 s tries are for awaited ones only.
func (h *harness) awaitedTakenFirst(awaited *DeadLetters, what string, outage bool) {
	h.t.Helper()
	h.advance(awaitedDeadLetterWait)
	if released, _ := waitReleased(awaited); !released {
		h.t.Fatalf("%v after %s, the awaited dead letter not taken (tried %d times)", awaitedDeadLetterWait, what, h.sink.deliveriesOf("awaited"))
	}
	want, why := 1, "the unawaited one waits its backoff"
	if outage {
		want, why = 2, "the unawaited one goes with it once its DLQ is back"
	}
	if n := len(h.sink.acked()); n != want {
		h.t.Fatalf("%d dead letters taken %v after %s, want %d (%s)", n, awaitedDeadLetterWait, what, want, why)
	}
	h.advance(5 * time.Minute)
	if n := len(h.sink.acked()); n != 2 {
		h.t.Fatalf("%d dead letters taken 5 min after %s, want 2", n, what)
	}
}
