package shard

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// The pauses of firing in TestModelContract (M227): an operator's
// (PauseFiringByOperator, ResumeFiringByOperator) and the catch-up's
// (PauseFiring, ResumeFiring), drawn by their own generator (modelRun.prng)
// before any step, at settled points and while publishes hang at the
// gate, across restarts and crashes. The model checks README "Pausing
// deliveries" and pause.go:
//
//   - while paused, no publish begins (testHookBeginPublish) but of a task
//     in flight when the pause returned (in a shard's in-flight set and
//     not parked aside by a stuck lane) or a dead letter a source waits
//     for (IngestAwait); the rest of the checks (due, supersession, same
//     id and due in ingest order) hold as ever, and after the resume
//     everything due is delivered;
//   - a drain while paused delivers the awaited dead letters, and nothing
//     is owed delivered otherwise;
//   - at every settled point Firing says what the model says (Paused,
//     CatchingUp, the operator's Since and Reason) and InFlight is 0;
//   - the operator's pause is kept across restarts and crashes once
//     PauseFiringByOperator returned, and its end once
//     ResumeFiringByOperator returned; the catch-up pause never outlasts
//     an Open;
//   - Stats while paused: next due at or before the model's earliest due,
//     and oldest overdue at or before it when that is past (set-aside
//     tasks cancelled meanwhile may show, README "Stats").

// modelPause is the model's pause of firing.
type modelPause struct {
	catchUp bool
	op      *OperatorPause
}

func (p *modelPause) paused() bool { return p.catchUp || p.op != nil }

// sinkPause is what the model sink checks of each publish begun while the
// model says firing is paused (under modelSink.mu).
type sinkPause struct {
	// seqOf: the seq of each task the fire loops handed to a lane
	// (testHookDispatch), until its publish begins.
	seqOf map[*codec.Task]uint64
	// on: the model's pause holds; set once the pause call returned and
	// the in-flight tasks were read, cleared before a call that ends it.
	on bool
	// allowed: the seqs in flight (not parked aside) when it returned.
	allowed map[uint64]bool
	// awaitedN: the dead letters (by message) a source waits for; kept
	// across restarts (the prefixDLWait records are).
	awaitedN map[int]bool
	// bad: publishes begun while paused that the pause does not allow.
	bad []string
	// inFlight, awaited: publishes begun while paused that it allows.
	inFlight, awaited int
}

func (p *sinkPause) init() {
	p.seqOf = map[*codec.Task]uint64{}
	p.awaitedN = map[int]bool{}
}

// dispatched is the engine's testHookDispatch: it learns each task's seq.
func (s *modelSink) dispatched(part []fireItem) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, it := range part {
		s.pz.seqOf[it.task] = it.seq
	}
}

// awaited notes dead letters a source is about to wait for.
func (s *modelSink) awaited(dls []*mMsg) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range dls {
		s.pz.awaitedN[m.n] = true
	}
}

// checkPausedBeginLocked checks a publish beginning (under the engine's
// shard lock) against the model's pause.
func (s *modelSink) checkPausedBeginLocked(batch []*codec.Task, ticket int64) {
	for _, t := range batch {
		seq, known := s.pz.seqOf[t]
		delete(s.pz.seqOf, t)
		if !s.pz.on {
			continue
		}
		n, err := strconv.Atoi(string(t.Value))
		if err != nil {
			n = -1
		}
		switch {
		case known && s.pz.allowed[seq]:
			s.pz.inFlight++
		case t.Kind == codec.KindDeadLetter && s.pz.awaitedN[n]:
			s.pz.awaited++
		default:
			s.pz.bad = append(s.pz.bad, fmt.Sprintf("%v of msg %d (seq %d, dispatched %v) begun at ticket %d while firing is paused, not in flight when the pause returned",
				t.Kind, n, seq, known, ticket))
		}
	}
}

// checkPausedBegins reports the publishes begun against the pause.
func (r *modelRun) checkPausedBegins() {
	r.sink.mu.Lock()
	bad := r.sink.pz.bad
	r.sink.pz.bad = nil
	inFlight, awaited := r.sink.pz.inFlight, r.sink.pz.awaited
	r.sink.pz.inFlight, r.sink.pz.awaited = 0, 0
	r.sink.mu.Unlock()
	r.cov["paused: a task claimed before the pause returned began after it"] += inFlight
	r.cov["paused: awaited dead letter published"] += awaited
	for _, b := range bad[:min(len(bad), 10)] {
		r.t.Errorf("step %d: %s", r.step, b)
	}
}

// inFlightSeqs is what the fire loops have taken for delivery now: each
// shard's in-flight set but the tasks a stuck lane parked aside (a pause
// sends those back).
func (r *modelRun) inFlightSeqs() map[uint64]bool {
	out := map[uint64]bool{}
	for _, s := range r.e.shards {
		s.mu.Lock()
		for seq := range s.inflight {
			out[seq] = true
		}
		for l := range s.lanes {
			for _, p := range s.lanes[l].parked {
				delete(out, p.seq)
			}
		}
		s.mu.Unlock()
	}
	return out
}

// pauseOn arms the sink's check once a pause returned (nothing if the
// model was paused already).
func (r *modelRun) pauseOn() {
	r.sink.mu.Lock()
	on := r.sink.pz.on
	r.sink.mu.Unlock()
	if on {
		return
	}
	allowed := r.inFlightSeqs() // not under sink.mu: begin takes it under a shard's lock
	r.sink.mu.Lock()
	r.sink.pz.on, r.sink.pz.allowed = true, allowed
	r.sink.mu.Unlock()
	if len(allowed) > 0 {
		r.cov["paused with tasks in flight"]++
	}
	if len(r.parkedSeqs()) > 0 {
		r.cov["paused with tasks parked aside by a stuck lane"]++
	}
}

// forgetParked takes the tasks a stuck lane parked aside out of those a
// pause lets go (they were claimed before the pause returned, parked
// after: a pause sends them back, docs/design.md). Called before the gate
// opens: until then the lane whose batch hangs keeps them parked.
func (r *modelRun) forgetParked() {
	if r.e == nil {
		return
	}
	parked := r.parkedSeqs()
	r.sink.mu.Lock()
	defer r.sink.mu.Unlock()
	for _, seq := range parked {
		if r.sink.pz.on && r.sink.pz.allowed[seq] {
			delete(r.sink.pz.allowed, seq)
			r.cov["paused: parked after the pause, not let go"]++
		}
	}
}

// pauseOff disarms it before a call that ends the model's pause.
func (r *modelRun) pauseOff() {
	r.sink.mu.Lock()
	r.sink.pz.on, r.sink.pz.allowed = false, nil
	r.sink.mu.Unlock()
}

// pauseReasons are the reasons the operator's pause step draws, and
// whether the engine keeps them.
var pauseReasons = []struct {
	reason string
	ok     bool
}{
	{"", true},
	{"incident OPS-1234", true},
	{"migración de órdenes ✓", true},
	{"ok\u200dfine", true},
	{"orders-svc migration", true},
	{"bad\nline", false},
	{"\u202eevil", false},
	{strings.Repeat("x", MaxPauseReason+1), false},
}

// pauseStep pauses or resumes firing, for a random reason; settle false:
// publishes hang at the gate.
func (r *modelRun) pauseStep(settle bool) {
	// Paused, mostly a resume; else mostly a no-op: about a third of a
	// run paused.
	x := r.prng.IntN(10)
	if r.pz.paused() && r.prng.IntN(5) > 0 || !r.pz.paused() && r.prng.IntN(5) < 2 {
		x = 4 + r.prng.IntN(2)*4 // a resume of one reason or the other
		if r.pz.op == nil && r.pz.catchUp {
			x = 8
		} else if r.pz.op != nil && !r.pz.catchUp {
			x = 4
		}
	}
	switch {
	case x < 4:
		r.opPause()
	case x < 6:
		r.opResume()
	case x < 8:
		r.note("catch-up pause")
		r.e.PauseFiring()
		r.pz.catchUp = true
		r.pauseOn()
		r.cov["catch-up pause"]++
	default:
		r.note("catch-up resume (catching up %v)", r.pz.catchUp)
		if r.pz.op == nil {
			r.pauseOff()
		}
		r.e.ResumeFiring()
		r.pz.catchUp = false
		r.cov["catch-up resume"]++
	}
	if settle {
		r.settleAndCheck()
	}
}

// pauseInFlight is a pause step, sometimes, while publishes hang.
func (r *modelRun) pauseInFlight() {
	if r.prng == nil || r.prng.IntN(2) > 0 {
		return
	}
	if r.opts.LaneGrace == time.Millisecond {
		// Lanes go stuck at the gate: more due work, and a moment for
		// the fire loops to claim it and park it aside (a pause sends
		// that back).
		r.ingestBatch(30, nil)
		deadline := time.Now().Add(20 * time.Millisecond)
		for time.Now().Before(deadline) && len(r.parkedSeqs()) == 0 {
			time.Sleep(100 * time.Microsecond)
		}
	}
	r.cov["pause step while publishes hang"]++
	r.pauseStep(false)
}

// parkedSeqs are the tasks the stuck lanes parked aside.
func (r *modelRun) parkedSeqs() []uint64 {
	var parked []uint64
	for _, s := range r.e.shards {
		s.mu.Lock()
		for l := range s.lanes {
			for _, p := range s.lanes[l].parked {
				parked = append(parked, p.seq)
			}
		}
		s.mu.Unlock()
	}
	return parked
}

// opPause is PauseFiringByOperator, checked against the model.
func (r *modelRun) opPause() {
	pr := pauseReasons[r.prng.IntN(len(pauseReasons))]
	now := r.now()
	st, err := r.e.PauseFiringByOperator(pr.reason)
	r.note("operator pause %.20q: %v", pr.reason, err)
	if !pr.ok {
		if !errors.Is(err, ErrPauseReason) {
			r.t.Errorf("step %d: PauseFiringByOperator(%.40q) = %v, want ErrPauseReason", r.step, pr.reason, err)
		}
		r.cov["operator pause refused"]++
		return
	}
	if err != nil {
		r.t.Fatalf("step %d: PauseFiringByOperator(%.40q): %v", r.step, pr.reason, err)
	}
	switch {
	case r.pz.op == nil:
		r.pz.op = &OperatorPause{Since: msTime(now), Reason: pr.reason}
		r.cov["operator pause"]++
	case pr.reason != "":
		r.pz.op.Reason = pr.reason
		r.cov["operator pause again"]++
	default:
		r.cov["operator pause again"]++
	}
	r.pauseOn()
	r.checkFiringState("PauseFiringByOperator", st)
}

// opResume is ResumeFiringByOperator, checked against the model.
func (r *modelRun) opResume() {
	old := r.pz.op
	if !r.pz.catchUp {
		r.pauseOff()
	}
	st, got, err := r.e.ResumeFiringByOperator()
	r.note("operator resume (paused %v): %v", old != nil, err)
	if err != nil {
		r.t.Fatalf("step %d: ResumeFiringByOperator: %v", r.step, err)
	}
	if (got == nil) != (old == nil) || got != nil && (!got.Since.Equal(old.Since.Time) || got.Reason != old.Reason) {
		r.t.Errorf("step %d: ResumeFiringByOperator ended %+v, the model's pause was %+v", r.step, got, old)
	}
	r.pz.op = nil
	r.cov["operator resume"]++
	r.checkFiringState("ResumeFiringByOperator", st)
}

// resumeAll ends both pauses.
func (r *modelRun) resumeAll() {
	if r.pz.op != nil {
		r.opResume()
	}
	if r.pz.catchUp {
		r.note("catch-up resume")
		r.pauseOff()
		r.e.ResumeFiring()
		r.pz.catchUp = false
	}
	r.settleAndCheck()
}

// openPaused sets the model's pause for an engine just opened (before
// Run): the operator's pause is what the store kept, the catch-up's is
// gone; then a catch-up pause at start, sometimes, as the service's New
// does.
func (r *modelRun) openPaused() {
	r.pz.catchUp = false
	r.pauseOff()
	r.sink.mu.Lock()
	clear(r.sink.pz.seqOf)
	r.sink.mu.Unlock()
	r.checkFiringState("Firing after Open", r.e.Firing())
	if r.pz.op != nil {
		r.pauseOn()
		r.cov["opened paused by the operator"]++
	}
	if r.prng != nil && r.prng.IntN(4) == 0 {
		r.note("catch-up pause at start")
		r.e.PauseFiring()
		r.pz.catchUp = true
		r.pauseOn()
		r.cov["catch-up pause at start"]++
	}
}

// checkFiringState compares a FiringState with the model (InFlight aside).
func (r *modelRun) checkFiringState(what string, st FiringState) {
	r.t.Helper()
	want := r.pz
	bad := st.Paused != want.paused() || st.CatchingUp != want.catchUp || (st.Operator == nil) != (want.op == nil)
	if !bad && want.op != nil {
		bad = !st.Operator.Since.Equal(want.op.Since.Time) || st.Operator.Reason != want.op.Reason
	}
	if !bad && r.e.FiringPaused() != want.paused() {
		r.t.Errorf("step %d: %s: FiringPaused %v, the model's pause holds %v", r.step, what, r.e.FiringPaused(), want.paused())
	}
	if bad {
		var op string
		if want.op != nil {
			op = fmt.Sprintf("%v %q", want.op.Since, want.op.Reason)
		}
		var got string
		if st.Operator != nil {
			got = fmt.Sprintf("%v %q", st.Operator.Since, st.Operator.Reason)
		}
		r.t.Errorf("step %d: %s: paused %v, catching up %v, operator {%s}; the model: paused %v, catching up %v, operator {%s}",
			r.step, what, st.Paused, st.CatchingUp, got, want.paused(), want.catchUp, op)
	}
}

// checkFiring checks Firing at a settled point: the model's pause, and
// nothing in flight.
func (r *modelRun) checkFiring() {
	st := r.e.Firing()
	r.checkFiringState("Firing", st)
	if st.InFlight != 0 {
		r.t.Errorf("step %d: settled, Firing().InFlight = %d (paused %v), want 0", r.step, st.InFlight, st.Paused)
	}
	if st.Paused {
		r.cov["settled while paused"]++
	}
}

// checkPausedStats checks Stats while paused: the tasks set aside count in
// next due and oldest overdue, and a cancelled one of them may still show
// (README "Stats"): both at or before the model's earliest due.
func (r *modelRun) checkPausedStats(st Stats, minDue int64, anyFailed bool) {
	if anyFailed || minDue == noDue {
		return
	}
	if st.NextDue.IsZero() || st.NextDue.UnixMilli() > minDue {
		r.t.Errorf("step %d: paused: Stats.NextDue = %v, the model's earliest due is %v", r.step, st.NextDue, msTime(minDue))
	}
	if minDue <= r.now() && (st.OldestOverdue.IsZero() || st.OldestOverdue.UnixMilli() > minDue) {
		r.t.Errorf("step %d: paused: Stats.OldestOverdue = %v, the model's earliest due %v is past", r.step, st.OldestOverdue, msTime(minDue))
	}
}

var histLen = func() int {
	if v, _ := strconv.Atoi(os.Getenv("DELAYBRIDGE_MODEL_HIST")); v > 0 {
		return v
	}
	return 60
}()
