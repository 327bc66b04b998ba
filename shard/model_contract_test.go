package shard

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/clock"
	"github.com/delaybridge/delaybridge/metrics"
)

// TestModelContract drives the engine with random long histories and
// checks every outcome against an independent model of CONTRACT §1-§4,
// README "Publishing a delayed message" and docs/design.md. A history has
// a few sources and a small id space (replaces, cancels and cancels before
// their schedule collide often), random stamps, partitions, offsets and
// re-created logs, dues in the past, now, near, beyond a small horizon, up
// to codec.MaxDue and in same-due groups, ingest-time dead letters and
// checkpoints; admin cancels; clock moves of a millisecond to days and
// steps back; restarts (with another horizon, fire batch or cancel
// retention), crashes on a crashable MemFS at settled points, while
// publishes hang and while a goroutine ingests; sink failure phases
// (transient, outage of one transport or both, rejected; dead letters
// failing too); publishes held at a gate while replaces and cancels of
// them arrive; batches ingested back to back and from several goroutines
// while their due tasks are published; lookups racing the fire loops;
// pauses of firing, the operator's and the catch-up's, at settled points,
// while publishes hang, at Open and across restarts and crashes
// (model_pause_test.go has what they check).
//
// The model keeps per (source, id) the pending schedule or a cancel
// marker: a message supersedes it when it is later (same log: later
// offset; else later stamp, a tie keeps what is held; modelNewer, not
// order.newerThan), a marker lives the cancel retention, and a delivered
// or dead-lettered task's id is free again. Checked at every step: no
// first publish before the due by the injected clock; none begun after an
// Ingest or Cancel that superseded it returned (where the engine begins
// it: testHookBeginPublish); nothing acknowledged delivered again but what
// a crash had in flight; tries charge attempts and end publish-failed
// after Retry.MaxAttempts, a RejectedError at once, an outage never;
// same id and due delivered in ingest order; DeadLetters.Wait done only
// once the DLQ took its dead letters. Whenever the engine settles: Lookup
// (due, attempts, origin, target, next fire), Stats (pending, held, next
// due, oldest overdue) and Engine.Cancel agree with the model, and every
// task due that never failed was delivered (unless an outage may hold it
// back); after a drain, everything due was; after a crash, every batch
// whose Ingest returned is kept, and the checkpoints. At the end the
// counters (ingested, dropped, fired, dead_lettered, cancelled, replaced)
// match.
//
// Short form: one seed of 200 steps. DELAYBRIDGE_LONG=1: six seeds of 1500.
// DELAYBRIDGE_MODEL_SEED (and DELAYBRIDGE_MODEL_STEPS) replay a seed's
// choices; the interleavings of the concurrent steps are the machine's.
// The pause steps have a generator of their own: up to the first one, a
// seed's history is what it was before they were modelled, and
// DELAYBRIDGE_MODEL_NOPAUSE=1 leaves them out (the pre-M227 histories).
// DELAYBRIDGE_MODEL_HIST=N prints the last N steps of a failure (60).
func TestModelContract(t *testing.T) {
	seeds, steps := []uint64{uint64(time.Now().UnixNano())}, 200
	if longTests() {
		seeds, steps = nil, 1500
		base := uint64(time.Now().UnixNano())
		for i := range 6 {
			seeds = append(seeds, base+uint64(i))
		}
	}
	if v := os.Getenv("DELAYBRIDGE_MODEL_SEED"); v != "" {
		s, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("DELAYBRIDGE_MODEL_SEED=%q: %v", v, err)
		}
		seeds = []uint64{s}
	}
	if v := os.Getenv("DELAYBRIDGE_MODEL_STEPS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			t.Fatalf("DELAYBRIDGE_MODEL_STEPS=%q: %v", v, err)
		}
		steps = n
	}
	for _, seed := range seeds {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			t.Logf("seed %d, %d steps (DELAYBRIDGE_MODEL_SEED=%d DELAYBRIDGE_MODEL_STEPS=%d replays its choices)", seed, steps, seed, steps)
			runModel(t, seed, steps)
		})
	}
}

const (
	mRetention   = 2 * time.Hour
	mHorizon     = time.Minute
	mMaxAttempts = 3
)

// mMsg is one schedule or cancel message the test ingested.
type mMsg struct {
	n      int
	cancel bool
	src    string
	id     string
	ord    order
	due    int64
	tr     codec.Transport
	// scheduled: the model took it in as the id's pending task.
	scheduled bool
	// supersededAt: the event ticket after the Ingest or Cancel that
	// replaced or cancelled it returned (0: not superseded).
	supersededAt int64
	attempts     uint32
	failed       bool // a delivery of it failed at least once
	// tried: handed to the sink before. Its first try came at its due by
	// the clock; after a step back of the clock past the due time, a
	// task that waited for an outage is released when its target is
	// back, by the clock before its due (README "How it works": held
	// tasks are still released within retry.max of their broker's
	// return; TestHeldTasksAfterClockStepBack), which only a first try
	// must not be.
	tried       bool
	done        bool // acknowledged or dead-lettered
	acked       int  // acknowledged deliveries
	wantDL      codec.Code
	dlDelivered bool
	// mayDL: a dead letter the engine may or may not write (the task
	// failed for good in flight while a later message superseded it: which
	// came first decides).
	mayDL codec.Code
	// dlSeen: its dead letter was handed to the sink (so it exists).
	dlSeen bool
	// cancelled: superseded by a cancel (else by a replace);
	// ghostAcked: delivered by an engine that then crashed.
	cancelled, ghostAcked bool
	// ghostAt: the event ticket after the crash of the engine that
	// delivered it (ghostAcked).
	ghostAt int64
}

// mEntry is the model's index entry of one (source, id).
type mEntry struct {
	cancel bool
	ord    order
	expiry int64 // cancel markers
	msg    *mMsg // the pending schedule
}

type mKey struct{ src, id string }

// modelCounts is what the engine's counters should say.
type modelCounts struct {
	ingested map[string]int
	dropped  map[[2]string]int  // source, why
	fired    map[[2]string]int  // transport, kind
	deadLtrd map[codec.Code]int // reason
}

type mDueKey struct {
	k   mKey
	due int64
}

// sinkMode is how the model sink answers a schedule's delivery.
type sinkMode struct {
	transient, outage, rejected float64 // probabilities, by a hash of (seed, n, try)
	// only: the mode applies to this transport's tasks (0: both).
	only codec.Transport
}

// mRecord is one task of a Deliver call.
type mRecord struct {
	ticket int64
	n      int
	kind   codec.Kind
	code   codec.Code
	due    int64
	at     int64
	err    error
}

// modelSink records every Deliver with an event ticket, answers by mode,
// and can hold every call at a gate.
type modelSink struct {
	clk     clock.Clock
	events  *atomic.Int64
	seed    uint64
	mu      sync.Mutex
	mode    sinkMode
	tries   map[int]int
	log     []mRecord
	begun   map[*codec.Task]int64 // event ticket of each publish begun
	unbegun int                   // Deliver calls without a begin
	gate    chan struct{}         // nil: open
	blocked int
	// pz: what a pause lets the fire loops begin (model_pause_test.go).
	pz sinkPause
}

// begin numbers a publish where it begins: under its shard's lock, right
// after the engine's last check that no replace or cancel met its tasks
// (Engine.testHookBeginPublish). A replace or cancel that returns after
// it may come before the Deliver call, which follows a moment later: the
// publish was in flight (docs/design.md "a cancel that returned before
// the publish began always holds"; lane_stress_test.go reads it so too).
func (s *modelSink) begin(batch []*codec.Task) {
	n := s.events.Add(1)
	s.mu.Lock()
	s.begun[batch[0]] = n
	s.checkPausedBeginLocked(batch, n)
	s.mu.Unlock()
}

func (s *modelSink) Deliver(_ context.Context, batch []*codec.Task) []error {
	at := s.clk.Now().UnixMilli()
	s.mu.Lock()
	ticket, ok := s.begun[batch[0]]
	delete(s.begun, batch[0])
	if !ok {
		ticket = s.events.Add(1)
		s.unbegun++
	}
	gate := s.gate
	if gate != nil {
		s.blocked++
	}
	s.mu.Unlock()
	if gate != nil {
		<-gate
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if gate != nil {
		s.blocked--
	}
	var errs []error
	for i, t := range batch {
		n, err := strconv.Atoi(string(t.Value))
		if err != nil {
			n = -1
		}
		var derr error
		try := s.tries[n]
		s.tries[n]++
		u := float64(mix(s.seed, uint64(n), uint64(try))>>11) / (1 << 53)
		if t.Kind == codec.KindDeadLetter {
			// A DLQ failing as a whole (never RejectedError, which a
			// Sink must not return for a dead letter; never ErrRefused,
			// which would park it).
			if m := s.mode; m.only == 0 || t.Transport == m.only {
				switch {
				case u < m.transient:
					derr = errors.New("model: dlq failure")
				case u < m.transient+m.outage:
					derr = fmt.Errorf("model: dlq down: %w", ErrUnavailable)
				}
			}
		}
		if t.Kind == codec.KindSchedule {
			m := s.mode
			if m.only != 0 && t.Transport != m.only {
				m = sinkMode{}
			}
			switch {
			case u < m.transient:
				derr = errors.New("model: transient failure")
			case u < m.transient+m.outage:
				derr = fmt.Errorf("model: down: %w", ErrUnavailable)
			case u < m.transient+m.outage+m.rejected:
				derr = &RejectedError{Code: codec.CodeTargetNotAllowed, Err: errors.New("model: rejected")}
			}
		}
		if derr != nil && errs == nil {
			errs = make([]error, len(batch))
		}
		if errs != nil {
			errs[i] = derr
		}
		s.log = append(s.log, mRecord{ticket: ticket, n: n, kind: t.Kind, code: t.Code, due: t.Due, at: at, err: derr})
	}
	return errs
}

// mix is splitmix64 over a, b, c.
func mix(a, b, c uint64) uint64 {
	z := a ^ b*0x9e3779b97f4a7c15 ^ c*0xbf58476d1ce4e5b9
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}

func (s *modelSink) setMode(m sinkMode) {
	s.mu.Lock()
	s.mode = m
	s.mu.Unlock()
}

func (s *modelSink) take() []mRecord {
	s.mu.Lock()
	defer s.mu.Unlock()
	l := s.log
	s.log = nil
	return l
}

// modelRun is the engine under test with the model beside it.
type modelRun struct {
	t      *testing.T
	rng    *rand.Rand
	clk    *clock.Fake
	opts   Options
	e      *Engine
	sink   *modelSink
	events atomic.Int64
	cancel context.CancelFunc
	done   chan error

	msgs    []*mMsg
	state   map[mKey]*mEntry
	keys    []mKey
	offsets map[string]int64 // next offset per source/partition
	incs    map[string]uint32
	stamp   int64 // producers' clock, ms
	// outageDirty: an outage was answered since the last drain (a down
	// target may hold back tasks that never failed themselves).
	outageDirty [3]bool // by transport
	// hist is a short history of the steps, printed on a failure.
	hist []string
	step int
	// lastSameDue: the last message delivered per id and due.
	lastSameDue map[mDueKey]int
	// newer: messages are built later than every one before (concurrent
	// steps); maxStamp is the latest stamp built.
	newer    bool
	maxStamp int64
	mem      *vfs.MemFS // nil: the OS file system
	maxNow   int64      // the latest clock time before a step back
	// cps is the last checkpoint offset ingested per key.
	cps map[string]int64
	// countsLoose: a crash lost a batch after the dead engine counted it
	// (ingested, dropped, cancelled, replaced are not checked).
	countsLoose bool
	// awaits: dead letters a source waits for (IngestAwait).
	awaits []mAwait
	// mc is what the metrics should say.
	mc modelCounts
	// cov counts the cases a run met, logged at its end.
	cov map[string]int
	// prng draws the pause steps (model_pause_test.go), apart from rng so
	// a seed's other draws stay what they were before pauses were
	// modelled; nil with DELAYBRIDGE_MODEL_NOPAUSE=1.
	prng *rand.Rand
	// pz is the model's pause of firing.
	pz modelPause
}

func runModel(t *testing.T, seed uint64, steps int) {
	rng := rand.New(rand.NewPCG(seed, 0x6d6f64656c))
	clk := clock.NewFake(t0)
	r := &modelRun{t: t, rng: rng, clk: clk, state: map[mKey]*mEntry{},
		offsets: map[string]int64{}, incs: map[string]uint32{}, stamp: ms(t0), lastSameDue: map[mDueKey]int{}, cov: map[string]int{}, cps: map[string]int64{},
		mc: modelCounts{ingested: map[string]int{}, dropped: map[[2]string]int{}, fired: map[[2]string]int{}, deadLtrd: map[codec.Code]int{}}}
	r.sink = &modelSink{clk: clk, events: &r.events, seed: seed, tries: map[int]int{}, begun: map[*codec.Task]int64{}}
	r.sink.pz.init()
	if os.Getenv("DELAYBRIDGE_MODEL_NOPAUSE") != "1" {
		r.prng = rand.New(rand.NewPCG(seed, 0x7061757365))
	}
	r.opts = Options{
		Dir:             t.TempDir(),
		Shards:          1 + rng.IntN(4),
		Clock:           clk,
		Logger:          zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel)),
		Horizon:         mHorizon,
		FireBatch:       1 + rng.IntN(40),
		CancelRetention: mRetention,
		OutageMemory:    []int{-1, 2, 1000}[rng.IntN(3)],
		Retry:           RetryPolicy{Initial: time.Second, Max: time.Minute, Multiplier: 2, Jitter: -1, MaxAttempts: mMaxAttempts},
		LaneGrace:       laneGraceForTests(t),
		Metrics:         metrics.New(nil), // one for every Open: the counters add up over restarts
	}
	if rng.IntN(3) == 0 {
		r.opts.LaneGrace = time.Millisecond // lanes go stuck at the gate
	}
	if rng.IntN(2) == 0 {
		// Pebble on a MemFS: restarts may be crashes (what was synced
		// survives); at a settled point nothing is in flight, so a crash
		// must lose and repeat nothing.
		r.mem = vfs.NewCrashableMem()
		r.opts.FS = r.mem
	}
	for _, src := range []string{"a", "b", "c"}[:1+rng.IntN(3)] {
		for i := range 3 + rng.IntN(6) {
			r.keys = append(r.keys, mKey{src, fmt.Sprintf("k%d", i)})
		}
	}
	t.Logf("options: shards %d, fire batch %d, outage memory %d, lane grace %v, memfs %v, %d keys",
		r.opts.Shards, r.opts.FireBatch, r.opts.OutageMemory, r.opts.LaneGrace, r.mem != nil, len(r.keys))
	r.open()
	t.Cleanup(r.close)
	defer func() {
		if t.Failed() {
			t.Logf("seed %d, last steps:\n%s", seed, strings.Join(r.hist, "\n"))
		}
	}()
	for r.step = 0; r.step < steps && !t.Failed(); r.step++ {
		if r.prng != nil && r.prng.IntN(100) < 5 {
			r.pauseStep(true) // before the step, which then runs paused or not
		}
		switch x := rng.IntN(100); {
		case x < 40:
			r.ingestStep()
		case x < 55:
			r.advanceStep()
		case x < 63:
			r.adminCancelStep()
		case x < 71:
			r.inFlightStep()
		case x < 75:
			r.concurrentStep()
		case x < 77:
			r.lookupRaceStep()
		case x < 79:
			r.crashIngestStep()
		case x < 82:
			r.failPhase()
		case x < 84:
			r.restart()
		case x < 88:
			r.drain()
		default:
			r.lookupAll()
		}
	}
	if t.Failed() {
		return
	}
	// The end: everything due is delivered.
	r.sink.setMode(sinkMode{})
	r.resumeAll()
	r.note("final")
	end := r.now() + (24 * time.Hour).Milliseconds()
	for _, en := range r.state {
		if !en.cancel {
			end = max(end, en.msg.due+(24*time.Hour).Milliseconds())
		}
	}
	r.setClock(time.UnixMilli(end))
	r.drain()
	for k, en := range r.state {
		if !en.cancel {
			r.t.Errorf("end: %s/%s still pending in the model: msg %d due %d (now %d)", k.src, k.id, en.msg.n, en.msg.due, r.now())
		}
	}
	for _, m := range r.msgs {
		if m.wantDL != "" && !m.dlDelivered {
			r.t.Errorf("end: dead letter %s of msg %d never delivered", m.wantDL, m.n)
		}
	}
	st := r.e.Stats()
	if st.Pending != 0 {
		r.t.Errorf("end: Stats.Pending %d, want 0", st.Pending)
	}
	r.checkCounts()
	var sched, acked, superseded, dls, failed int
	for _, m := range r.msgs {
		if m.scheduled {
			sched++
		}
		if m.acked > 0 {
			acked++
		}
		if m.supersededAt != 0 {
			superseded++
		}
		if m.wantDL != "" {
			dls++
		}
		if m.failed {
			failed++
		}
	}
	var cov []string
	for k, v := range r.cov {
		cov = append(cov, fmt.Sprintf("%s %d", k, v))
	}
	sort.Strings(cov)
	r.t.Logf("met: %s", strings.Join(cov, ", "))
	r.t.Logf("%d messages: %d scheduled, %d delivered, %d superseded, %d failed at least once, %d dead-lettered; clock at +%v",
		len(r.msgs), sched, acked, superseded, failed, dls, r.clk.Now().Sub(t0))
}

func (r *modelRun) note(format string, args ...any) {
	s := fmt.Sprintf("step %d @%d: ", r.step, r.now()-ms(t0)) + fmt.Sprintf(format, args...)
	r.hist = append(r.hist, s)
	if len(r.hist) > histLen {
		r.hist = r.hist[len(r.hist)-histLen:]
	}
}

func (r *modelRun) now() int64 { return r.clk.Now().UnixMilli() }

func (r *modelRun) open() {
	r.t.Helper()
	r.awaits = nil // a restarted source ingests its batch again
	if r.rng.IntN(3) == 0 {
		// A restart with another config: the horizon, the fire batch and
		// the cancel retention of new markers may change.
		r.opts.Horizon = []time.Duration{2 * time.Millisecond, time.Second, mHorizon, 10 * time.Minute}[r.rng.IntN(4)]
		r.opts.FireBatch = 1 + r.rng.IntN(40)
		r.opts.FireBatchBytes = []int{0, 1, 300}[r.rng.IntN(3)]
		r.opts.CancelRetention = []time.Duration{time.Hour, mRetention, 24 * time.Hour}[r.rng.IntN(3)]
	}
	e, err := Open(r.opts)
	if err != nil {
		r.t.Fatalf("Open: %v", err)
	}
	r.e = e
	e.testHookBeginPublish = r.sink.begin // before Run starts
	e.testHookDispatch = r.sink.dispatched
	r.cov[fmt.Sprintf("opened with horizon %v", r.opts.Horizon)]++
	r.openPaused()
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	r.done = make(chan error, 1)
	go func() { r.done <- e.Run(ctx, r.sink) }()
}

func (r *modelRun) close() {
	if r.e == nil {
		return
	}
	r.stopRun()
	if err := r.e.Close(); err != nil {
		r.t.Errorf("Close: %v", err)
	}
	r.e = nil
}

// crashClone is the MemFS as a crash now could leave it: what was synced,
// and some of what was not.
// crashTo ends the engine as a kill -9 would have left clone (taken by
// crashClone): the engine stops without a flush and the next open reads
// clone.
func (r *modelRun) crashTo(clone *vfs.MemFS) {
	r.stopRun()
	if err := r.e.CloseNoFlush(); err != nil {
		r.t.Errorf("Close: %v", err)
	}
	r.e = nil
	r.mem = clone
	r.opts.FS = clone
}

func (r *modelRun) crashClone() *vfs.MemFS {
	cfg := vfs.CrashCloneCfg{}
	if r.rng.IntN(2) == 0 {
		cfg = vfs.CrashCloneCfg{UnsyncedDataPercent: r.rng.IntN(100), RNG: rand.New(rand.NewPCG(r.rng.Uint64(), 0))}
	}
	return r.mem.CrashClone(cfg)
}

// stopRun ends Run.
func (r *modelRun) stopRun() {
	r.openGate()
	if r.done == nil {
		return
	}
	r.cancel()
	if err := <-r.done; err != nil {
		r.t.Errorf("Run: %v", err)
	}
	r.done = nil
}

// restart closes and opens the engine again at a settled point, on a
// MemFS sometimes as after a crash, and checks the checkpoints.
func (r *modelRun) restart() {
	r.t.Helper()
	if r.mem != nil && r.rng.IntN(2) == 0 {
		r.note("crash restart")
		r.stopRun() // settled: the clone is taken with nothing running
		r.crashTo(r.crashClone())
	} else {
		r.note("restart")
		r.close()
	}
	r.open()
	r.cov["restart"]++
	for key, want := range r.cps {
		got, ok, err := r.e.Checkpoint(key)
		if err != nil || !ok || got != want {
			r.t.Errorf("step %d: after a restart Checkpoint(%s) = %d, %v, %v; want %d", r.step, key, got, ok, err, want)
		}
	}
	r.settleAndCheck()
}

func (r *modelRun) settle() {
	r.t.Helper()
	for range 100 {
		deadline := time.Now().Add(30 * time.Second)
		for !r.e.settled() {
			if time.Now().After(deadline) {
				r.t.Fatalf("fire loops did not settle: %s", r.e.loopStates())
			}
			time.Sleep(50 * time.Microsecond)
		}
		if !r.waitsOutStep() {
			return
		}
		// After a step back the wheel's time stays ahead of the clock,
		// and a loop whose wheel says something is due parks 1 ms rather
		// than spin on an early Next (park: "wait, never fire early"):
		// give it the millisecond.
		r.cov["loop waited 1ms after a step back"]++
		r.clk.Advance(time.Millisecond)
	}
	r.t.Fatalf("fire loops kept waiting 1 ms after a step back: %s", r.e.loopStates())
}

// waitsOutStep reports whether a fire loop is parked for 1 ms with a wake
// time already past (park after a step back of the clock).
func (r *modelRun) waitsOutStep() bool {
	now := r.now()
	for _, s := range r.e.shards {
		s.mu.Lock()
		at, armed := parkDeadline(s)
		wake := s.wakeAt
		s.mu.Unlock()
		if armed && at == now+1 && wake <= now {
			return true
		}
	}
	return false
}

func (r *modelRun) closeGate() {
	r.sink.mu.Lock()
	r.sink.gate = make(chan struct{})
	r.sink.mu.Unlock()
}

func (r *modelRun) openGate() {
	r.forgetParked()
	r.sink.mu.Lock()
	if r.sink.gate != nil {
		close(r.sink.gate)
		r.sink.gate = nil
	}
	r.sink.mu.Unlock()
}

// newMsg builds a random message for key k.
func (r *modelRun) newMsg(k mKey, cancel bool) (*mMsg, codec.Task) {
	rng := r.rng
	// Producers' clocks: mostly forward, sometimes equal, sometimes back.
	switch x := rng.IntN(10); {
	case x < 4:
		r.stamp += int64(rng.IntN(3))
	case x < 7:
		r.stamp += int64(rng.IntN(2000))
	case x < 9:
		r.stamp -= int64(rng.IntN(50))
	}
	stamp := max(r.stamp, ms(t0))
	if rng.IntN(4) == 0 {
		stamp = r.now() - int64(rng.IntN(100))
	}
	if r.newer {
		// Later than anything before it: its outcome does not depend on
		// whether a publish of the id ends before or after it.
		stamp = r.maxStamp + 1
	}
	r.maxStamp = max(r.maxStamp, stamp)
	p := int32(rng.IntN(3))
	pk := fmt.Sprintf("%s/%d", k.src, p)
	if !r.newer && rng.IntN(200) == 0 { // the partition's log re-created
		r.incs[pk]++
		r.offsets[pk] = 0
	}
	off := r.offsets[pk]
	r.offsets[pk] += 1 + int64(rng.IntN(2))
	m := &mMsg{n: len(r.msgs), cancel: cancel, src: k.src, id: k.id,
		ord: order{Stamp: stamp, Partition: p, Incarnation: r.incs[pk], Offset: off}}
	r.msgs = append(r.msgs, m)
	tr := codec.TransportKafka
	if rng.IntN(3) == 0 {
		tr = codec.TransportNATS
	}
	m.tr = tr
	task := codec.Task{
		Kind: codec.KindSchedule, ID: k.id, Source: k.src, Origin: fmt.Sprintf("m%d", m.n),
		Stamp: stamp, Partition: p, Incarnation: m.ord.Incarnation, Offset: off,
		Transport: tr, Target: "out", Value: []byte(strconv.Itoa(m.n)),
		DLQTransport: tr, DLQ: "dlq",
	}
	if cancel {
		task.Kind = codec.KindCancel
		task.Value = nil
		return m, task
	}
	now := r.now()
	var due int64
	x := rng.IntN(12)
	if r.newer && x >= 3 && rng.IntN(3) > 0 {
		x = rng.IntN(3) // mostly due now: fires race the next batches
	}
	switch {
	case x < 2:
		due = now - int64(rng.IntN(int(time.Hour/time.Millisecond)))
	case x < 3:
		due = now
	case x < 6:
		due = now + int64(rng.IntN(int(2*mHorizon/time.Millisecond)))
	case x < 8:
		due = now + int64(rng.IntN(int(3*24*time.Hour/time.Millisecond)))
	case x < 9 && rng.IntN(4) == 0: // far: a year, or the last due there is
		due = now + int64(rng.IntN(int(365*24*time.Hour/time.Millisecond)))
		if rng.IntN(8) == 0 {
			due = codec.MaxDue - int64(rng.IntN(1000))
		}
	default: // same-due groups
		due = ms(t0) + int64(rng.IntN(40))*int64(10*time.Minute/time.Millisecond)
	}
	m.due = max(due, 1)
	task.Due = m.due
	return m, task
}

// modelNewer is the model's own reading of CONTRACT §1 and README
// "Publishing a delayed message" (not order.newerThan): in one log (same
// partition, same incarnation) the later offset wins; otherwise the later
// broker timestamp, and on a tie the one read first stays.
func modelNewer(in, held order) bool {
	sameLog := in.Partition == held.Partition && in.Incarnation == held.Incarnation
	switch {
	case sameLog:
		return in.Offset > held.Offset
	case in.Stamp != held.Stamp:
		return in.Stamp > held.Stamp
	default:
		return false
	}
}

// randomKey picks a key, often one the model holds something for.
func (r *modelRun) randomKey() mKey { return r.keys[r.rng.IntN(len(r.keys))] }

// applyIngest is the model's decision for m, ingested at now.
func (r *modelRun) applyIngest(m *mMsg, now int64, ret *[]*mMsg) string {
	k := mKey{m.src, m.id}
	ex := r.state[k]
	if ex != nil && ex.cancel && ex.expiry <= now {
		r.cov["expired marker met"]++
		ex = nil
	}
	if ex != nil && !modelNewer(m.ord, ex.ord) {
		if !m.cancel {
			why := "older"
			if ex.cancel {
				why = "cancelled"
			}
			r.mc.dropped[[2]string{m.src, why}]++
		}
		switch {
		case ex.cancel && !m.cancel:
			r.cov["schedule dropped by a cancel marker"]++
		case ex.ord.Partition != m.ord.Partition && ex.ord.Stamp == m.ord.Stamp:
			r.cov["stamp tie across partitions kept the held"]++
		default:
			r.cov["older message dropped"]++
		}
		return "dropped"
	}
	if ex != nil && ex.ord.Partition == m.ord.Partition && ex.ord.Incarnation == m.ord.Incarnation && m.ord.Stamp < ex.ord.Stamp {
		r.cov["later offset with an older stamp won"]++
	}
	if ex != nil && !ex.cancel {
		*ret = append(*ret, ex.msg)
		ex.msg.cancelled = m.cancel
	}
	if m.cancel {
		r.state[k] = &mEntry{cancel: true, ord: m.ord, expiry: now + r.opts.CancelRetention.Milliseconds()}
		if ex != nil && !ex.cancel {
			return fmt.Sprintf("cancels %d", ex.msg.n)
		}
		return "marker"
	}
	m.scheduled = true
	r.state[k] = &mEntry{ord: m.ord, msg: m}
	if ex != nil && !ex.cancel {
		return fmt.Sprintf("replaces %d", ex.msg.n)
	}
	return "new"
}

// ingestBatch ingests a random batch of 1-max ops, focused on keys when
// given, and updates the model.
func (r *modelRun) ingestBatch(maxOps int, focus []mKey) {
	b := r.buildBatch(maxOps, focus, r.keys, true)
	now := r.now()
	if len(b.dls) > 0 && len(b.cpl) > 0 {
		// As a source does: it commits once the DLQ took the batch's
		// dead letters (CONTRACT §3).
		r.sink.awaited(b.dls) // they may go at once, paused or not
		dls, err := r.e.IngestAwait(context.Background(), b.tasks, b.cpl)
		if err != nil {
			r.t.Fatalf("IngestAwait: %v", err)
		}
		if dls.Len() != len(b.dls) {
			r.t.Errorf("step %d: IngestAwait of %d dead letters awaits %d", r.step, len(b.dls), dls.Len())
		}
		r.awaits = append(r.awaits, mAwait{dls, b.dls})
	} else if err := r.e.Ingest(context.Background(), b.tasks, b.cpl); err != nil {
		r.t.Fatalf("Ingest: %v", err)
	}
	r.applyBatch(b, now, r.events.Add(1))
}

// mAwait is a batch's dead letters a source waits for.
type mAwait struct {
	dls  *DeadLetters
	msgs []*mMsg
}

// checkAwaits checks that every DeadLetters done has its dead letters
// acknowledged by their DLQ; with all set, that every one is done.
func (r *modelRun) checkAwaits(all bool) {
	var left []mAwait
	for _, a := range r.awaits {
		done := false
		select {
		case <-a.dls.done:
			done = true
		default:
		}
		for _, m := range a.msgs {
			if done && !m.dlDelivered {
				r.t.Errorf("step %d: DeadLetters.Wait returns before the DLQ took dead letter %d", r.step, m.n)
			}
			if all && !done && !m.dlDelivered {
				r.t.Errorf("step %d: dead letter %d not delivered after a drain", r.step, m.n)
			}
		}
		if all && !done {
			r.t.Errorf("step %d: DeadLetters.Wait not done after a drain", r.step)
		}
		if !done {
			left = append(left, a)
		}
	}
	r.awaits = left
}

// builtBatch is a batch to ingest and the model's messages of it.
type builtBatch struct {
	tasks     []codec.Task
	msgs, dls []*mMsg
	cpl       []Checkpoint
}

// buildBatch builds a random batch of 1-maxOps ops on keys from from,
// focused on focus when given, with checkpoints at times if withCps.
func (r *modelRun) buildBatch(maxOps int, focus, from []mKey, withCps bool) builtBatch {
	n := 1 + r.rng.IntN(maxOps)
	var b builtBatch
	cps := map[string]int64{}
	for range n {
		k := from[r.rng.IntN(len(from))]
		if len(focus) > 0 && r.rng.IntN(3) > 0 {
			k = focus[r.rng.IntN(len(focus))]
		}
		m, task := r.newMsg(k, r.rng.IntN(4) == 0)
		if r.rng.IntN(30) == 0 {
			// A message codec.Parse refused: a dead letter due now.
			task.Kind, task.Code, task.Detail, task.Due = codec.KindDeadLetter, codec.CodeBadDue, "model: bad", r.now()
			task.Value = []byte(strconv.Itoa(m.n))
			m.cancel = false
			m.wantDL = codec.CodeBadDue
			m.done = true
			b.dls = append(b.dls, m)
		} else {
			b.msgs = append(b.msgs, m)
		}
		b.tasks = append(b.tasks, task)
		cps[fmt.Sprintf("%s|%d|%d", k.src, m.ord.Partition, m.ord.Incarnation)] = m.ord.Offset
	}
	if withCps && r.rng.IntN(2) == 0 {
		for key, off := range cps {
			b.cpl = append(b.cpl, Checkpoint{Key: key, Offset: off})
		}
	}
	return b
}

// applyBatch applies an ingested batch to the model: ingested at now, its
// Ingest returned before event ticket ret.
func (r *modelRun) applyBatch(b builtBatch, now, ret int64) {
	for _, t := range b.tasks {
		r.mc.ingested[t.Source]++
	}
	for _, cp := range b.cpl {
		r.cps[cp.Key] = cp.Offset
	}
	for _, m := range b.dls {
		r.note("ingest dead letter %d", m.n)
	}
	var superseded []*mMsg
	var desc []string
	for _, m := range b.msgs {
		what := r.applyIngest(m, now, &superseded)
		kind := "S"
		if m.cancel {
			kind = "C"
		}
		desc = append(desc, fmt.Sprintf("%s%d %s/%s p%d/i%d@%d st%d due%d: %s", kind, m.n, m.src, m.id,
			m.ord.Partition, m.ord.Incarnation, m.ord.Offset, m.ord.Stamp-ms(t0), m.due-ms(t0), what))
	}
	for _, m := range superseded {
		m.supersededAt = ret
	}
	r.note("ingest [%s]", strings.Join(desc, "; "))
}

// ingestParallel ingests batches from 2-3 goroutines at once, each on its
// own keys (so the model's outcome does not depend on their interleaving),
// without checkpoints (their keys are shared between ids).
func (r *modelRun) ingestParallel() {
	g := 2 + r.rng.IntN(2)
	groups := make([][]mKey, g)
	for i, k := range r.keys {
		groups[i%g] = append(groups[i%g], k)
	}
	batches := make([][]builtBatch, g)
	rets := make([][]int64, g)
	for i := range g {
		if len(groups[i]) == 0 {
			continue
		}
		for range 1 + r.rng.IntN(4) {
			batches[i] = append(batches[i], r.buildBatch(15, nil, groups[i], false))
		}
		rets[i] = make([]int64, len(batches[i]))
	}
	now := r.now()
	errs := make([]error, g)
	var wg sync.WaitGroup
	for i := range g {
		wg.Go(func() {
			for j, b := range batches[i] {
				if err := r.e.Ingest(context.Background(), b.tasks, nil); err != nil {
					errs[i] = err
					return
				}
				rets[i][j] = r.events.Add(1)
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			r.t.Fatalf("Ingest: %v", err)
		}
	}
	r.cov["ingests in parallel"]++
	for i := range g {
		for j, b := range batches[i] {
			r.applyBatch(b, now, rets[i][j])
		}
	}
}

func (r *modelRun) ingestStep() {
	r.ingestBatch(50, nil)
	r.settleAndCheck()
}

func (r *modelRun) advanceStep() {
	var d time.Duration
	switch x := r.rng.IntN(10); {
	case x < 5:
		d = time.Duration(1+r.rng.IntN(int(2*mHorizon/time.Millisecond))) * time.Millisecond
	case x < 8:
		d = time.Duration(1+r.rng.IntN(6*3600)) * time.Second
	default:
		d = time.Duration(1+r.rng.IntN(3)) * 24 * time.Hour
	}
	if r.rng.IntN(8) == 0 {
		r.stepBack()
		return
	}
	r.note("advance %v", d)
	r.clk.Advance(d)
	r.settleAndCheck()
}

// stepBack sets the clock back (an NTP step), not past the expiry of a
// cancel marker that has expired: whether the sweep deleted it before
// (rate-limited: up to a minute late) or not decides whether it holds
// again, which the model cannot know.
func (r *modelRun) stepBack() {
	now := r.now()
	floor := ms(t0)
	for _, en := range r.state {
		if en.cancel && en.expiry <= now {
			floor = max(floor, en.expiry)
		}
	}
	back := min(int64(1+r.rng.IntN(int(time.Hour/time.Millisecond))), now-floor)
	if back <= 0 {
		return
	}
	r.note("step back %dms", back)
	r.cov["clock stepped back"]++
	r.maxNow = max(r.maxNow, now)
	r.clk.Set(time.UnixMilli(now - back))
	r.settleAndCheck()
}

func (r *modelRun) setClock(at time.Time) {
	r.clk.Set(at)
	r.settleAndCheck()
}

// adminCancel cancels k through Engine.Cancel and checks the answer.
func (r *modelRun) adminCancel(k mKey) {
	now := r.now()
	err := r.e.Cancel(k.src, k.id)
	ret := r.events.Add(1)
	ex := r.state[k]
	if ex == nil || ex.cancel {
		r.note("admin cancel %s/%s: want not found, got %v", k.src, k.id, err)
		if !errors.Is(err, ErrNotFound) {
			r.t.Errorf("step %d: Cancel(%s, %s) = %v, the model holds nothing pending: want ErrNotFound", r.step, k.src, k.id, err)
		}
		return
	}
	r.note("admin cancel %s/%s of %d: %v", k.src, k.id, ex.msg.n, err)
	if err != nil {
		r.t.Errorf("step %d: Cancel(%s, %s) = %v, the model holds msg %d pending", r.step, k.src, k.id, err, ex.msg.n)
		return
	}
	ex.msg.supersededAt = ret
	ex.msg.cancelled = true
	r.state[k] = &mEntry{cancel: true, ord: order{Stamp: max(now, ex.ord.Stamp), Partition: -1, Offset: -1}, expiry: now + r.opts.CancelRetention.Milliseconds()}
}

func (r *modelRun) adminCancelStep() {
	r.adminCancel(r.pickKey())
	r.settleAndCheck()
}

// pickKey picks a key the model holds a pending task for, if any, most of
// the time.
func (r *modelRun) pickKey() mKey {
	if r.rng.IntN(4) > 0 {
		var pend []mKey
		for _, k := range r.keys {
			if en := r.state[k]; en != nil && !en.cancel {
				pend = append(pend, k)
			}
		}
		if len(pend) > 0 {
			return pend[r.rng.IntN(len(pend))]
		}
	}
	return r.randomKey()
}

// inFlightStep holds every publish at the gate, brings tasks due (by an
// ingest or a clock move), and while their publish hangs ingests replaces
// and cancels of them (and admin cancels), then lets the publishes end.
func (r *modelRun) inFlightStep() {
	r.closeGate()
	if r.rng.IntN(2) == 0 {
		r.note("in flight: trigger by ingest")
		r.ingestBatch(10, nil)
	} else {
		d := time.Duration(1+r.rng.IntN(int(2*mHorizon/time.Millisecond))) * time.Millisecond
		r.note("in flight: trigger by advance %v", d)
		r.clk.Advance(d)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		r.sink.mu.Lock()
		blocked := r.sink.blocked
		var inFlight []mKey
		for _, rec := range r.sink.log {
			if rec.n >= 0 && rec.n < len(r.msgs) {
				m := r.msgs[rec.n]
				inFlight = append(inFlight, mKey{m.src, m.id})
			}
		}
		r.sink.mu.Unlock()
		if blocked > 0 {
			r.pauseInFlight()
			for range 1 + r.rng.IntN(3) {
				if r.rng.IntN(4) == 0 {
					k := r.randomKey()
					if len(inFlight) > 0 {
						k = inFlight[r.rng.IntN(len(inFlight))]
					}
					r.adminCancel(k)
				} else {
					r.ingestBatch(8, inFlight)
				}
			}
			r.check(false)
			break
		}
		if r.e.settled() {
			break // nothing came due
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("in flight: no publish began and no settle: %s", r.e.loopStates())
		}
		time.Sleep(50 * time.Microsecond)
	}
	if r.mem != nil && r.rng.IntN(3) == 0 {
		// kill -9 while the publishes hang: what they deliver is
		// delivered, but the store does not learn it (CONTRACT §4: it
		// may be delivered again, nothing acknowledged is lost).
		r.note("crash while publishing")
		clone := r.crashClone()
		r.crashTo(clone)
		recs := r.sink.take()
		sort.SliceStable(recs, func(i, j int) bool { return recs[i].ticket < recs[j].ticket })
		for _, rec := range recs {
			r.observeGhost(rec)
		}
		r.open()
		r.cov["crash while publishing"]++
	}
	r.openGate()
	r.settleAndCheck()
}

// countFired counts an acknowledged delivery as the engine's counters
// should.
func (r *modelRun) countFired(m *mMsg, rec mRecord) {
	if rec.kind == codec.KindDeadLetter {
		r.mc.fired[[2]string{m.tr.String(), "dlq"}]++
		r.mc.deadLtrd[rec.code]++
		return
	}
	r.mc.fired[[2]string{m.tr.String(), "task"}]++
}

// checkCounts compares the engine's counters with the model's (at the end,
// everything delivered): ingested, dropped, fired, dead-lettered,
// cancelled and replaced (a task superseded while being published counts
// as fired if the broker took it, else as cancelled or replaced; one that
// was dead-lettered before the superseding message was decided counts as
// a dead letter only).
func (r *modelRun) checkCounts() {
	m := r.opts.Metrics
	cancelled, replaced := map[string]int{}, map[string]int{}
	for _, x := range r.msgs {
		// A task delivered by an engine that then crashed is pending in
		// the next one: superseded there before it went again (a pause
		// holds it), it counts as cancelled or replaced.
		if x.supersededAt == 0 || x.acked > 0 || x.ghostAcked && x.supersededAt < x.ghostAt || x.mayDL != "" && x.dlSeen {
			continue
		}
		if x.cancelled {
			cancelled[x.src]++
		} else {
			replaced[x.src]++
		}
	}
	for _, src := range []string{"a", "b", "c"} {
		checks := []struct {
			name      string
			got, want float64
		}{
			{"ingested", testutil.ToFloat64(m.Ingested.WithLabelValues(src)), float64(r.mc.ingested[src])},
			{"cancelled", testutil.ToFloat64(m.Cancelled.WithLabelValues(src)), float64(cancelled[src])},
			{"replaced", testutil.ToFloat64(m.Replaced.WithLabelValues(src)), float64(replaced[src])},
			{"dropped older", testutil.ToFloat64(m.Dropped.WithLabelValues(src, "older")), float64(r.mc.dropped[[2]string{src, "older"}])},
			{"dropped cancelled", testutil.ToFloat64(m.Dropped.WithLabelValues(src, "cancelled")), float64(r.mc.dropped[[2]string{src, "cancelled"}])},
		}
		for _, c := range checks {
			if r.countsLoose {
				break
			}
			if c.got != c.want {
				r.t.Errorf("end: source %s: %s counter %v, the model counts %v", src, c.name, c.got, c.want)
			}
		}
	}
	for _, tr := range []string{"kafka", "nats"} {
		for _, kind := range []string{"task", "dlq"} {
			if got, want := testutil.ToFloat64(m.Fired.WithLabelValues(tr, kind)), float64(r.mc.fired[[2]string{tr, kind}]); got != want {
				r.t.Errorf("end: fired{%s, %s} counter %v, the model counts %v", tr, kind, got, want)
			}
		}
	}
	for _, code := range codec.Codes {
		if got, want := testutil.ToFloat64(m.DeadLettered.WithLabelValues(string(code))), float64(r.mc.deadLtrd[code]); got != want {
			r.t.Errorf("end: dead_lettered{%s} counter %v, the model counts %v", code, got, want)
		}
	}
}

// observeGhost checks a delivery of an engine that crashed while it was
// under way: it happened, but leaves the model as it was.
func (r *modelRun) observeGhost(rec mRecord) {
	if rec.n < 0 || rec.n >= len(r.msgs) {
		r.t.Errorf("step %d: delivery of an unknown task %+v", r.step, rec)
		return
	}
	m := r.msgs[rec.n]
	r.note("  ghost deliver %v %d (%s/%s) ticket %d: %v", rec.kind, m.n, m.src, m.id, rec.ticket, rec.err)
	if rec.err == nil {
		r.countFired(m, rec)
		if rec.kind != codec.KindDeadLetter {
			m.ghostAcked = true
			m.ghostAt = r.events.Add(1)
		}
	}
	if rec.kind == codec.KindDeadLetter {
		if m.wantDL == "" && m.mayDL == "" {
			r.t.Errorf("step %d: dead letter %s of msg %d, which the model did not dead-letter", r.step, rec.code, m.n)
		}
		return
	}
	switch {
	case !m.scheduled || m.cancel:
		r.t.Errorf("step %d: msg %d delivered, which the model never scheduled", r.step, m.n)
	case m.done:
		r.t.Errorf("step %d: msg %d delivered again after it was acknowledged or dead-lettered", r.step, m.n)
	case rec.at < m.due && !m.tried:
		r.t.Errorf("step %d: msg %d delivered at %d, before its due %d", r.step, m.n, rec.at-ms(t0), m.due-ms(t0))
	case m.supersededAt != 0 && rec.ticket > m.supersededAt:
		r.t.Errorf("step %d: msg %d handed to the sink (ticket %d) after the message superseding it was acknowledged (ticket %d)",
			r.step, m.n, rec.ticket, m.supersededAt)
	}
	m.tried = true
}

// concurrentStep ingests batches back to back while the tasks they bring
// due are published (and may fail), without waiting for the engine in
// between. Every message is later than all before it, so the model's
// outcome does not depend on how the publishes interleave with them.
func (r *modelRun) concurrentStep() {
	if r.rng.IntN(2) == 0 {
		r.sink.setMode(sinkMode{transient: r.rng.Float64() * 0.5, outage: r.rng.Float64() * 0.3, rejected: r.rng.Float64() * 0.1})
	}
	r.newer = true
	n := 2 + r.rng.IntN(6)
	r.note("concurrent: %d batches", n)
	for range n {
		if r.rng.IntN(3) == 0 {
			r.ingestParallel()
		} else {
			r.ingestBatch(20, nil)
		}
	}
	r.newer = false
	r.sink.setMode(sinkMode{})
	r.settleAndCheck()
}

// crashIngestStep crashes the engine (a crash clone of its MemFS) while a
// goroutine ingests batches one after another, the publishes held at the
// gate. Each batch carries a checkpoint of its own, which tells after the
// reopen whether it was stored: every batch whose Ingest returned before
// the crash must be, the stored ones must be a prefix (one batch is one
// synced write), and the model takes exactly those. What the crashed
// engine published is checked as in-flight (observeGhost).
func (r *modelRun) crashIngestStep() {
	if r.mem == nil {
		return
	}
	r.closeGate()
	n := 2 + r.rng.IntN(5)
	batches := make([]builtBatch, n)
	keys := make([]string, n)
	for j := range batches {
		batches[j] = r.buildBatch(20, nil, r.keys, false)
		keys[j] = fmt.Sprintf("crash|%d|%d", r.step, j)
		batches[j].cpl = []Checkpoint{{Key: keys[j], Offset: int64(j + 1)}}
	}
	rets := make([]int64, n)
	var returned atomic.Int32
	var stop atomic.Bool
	now := r.now()
	e := r.e
	var wg sync.WaitGroup
	wg.Go(func() {
		for j, b := range batches {
			if stop.Load() {
				return
			}
			if err := e.Ingest(context.Background(), b.tasks, b.cpl); err != nil {
				return
			}
			rets[j] = r.events.Add(1)
			returned.Store(int32(j + 1))
		}
	})
	time.Sleep(time.Duration(r.rng.IntN(3000)) * time.Microsecond)
	before := int(returned.Load())
	clone := r.crashClone()
	stop.Store(true)
	wg.Wait()
	r.note("crash while ingesting: %d of %d batches returned before it", before, n)
	r.crashTo(clone)
	ghosts := r.sink.take()
	retention := r.opts.CancelRetention // the crashed engine's, which wrote the markers
	r.open()
	stored := 0
	for j, key := range keys {
		_, ok, err := r.e.Checkpoint(key)
		if err != nil {
			r.t.Fatalf("Checkpoint(%s): %v", key, err)
		}
		switch {
		case ok && stored != j:
			r.t.Errorf("step %d: after a crash batch %d is stored but batch %d is not", r.step, j, stored)
		case ok:
			stored++
		case j < before:
			r.t.Errorf("step %d: batch %d, whose Ingest returned before the crash, is lost", r.step, j)
		}
	}
	r.cov["crash while ingesting"]++
	if stored > before {
		r.cov["batch stored by a crash before its Ingest returned"]++
	}
	lost := map[int]bool{}
	reopened := r.opts.CancelRetention
	r.opts.CancelRetention = retention
	defer func() { r.opts.CancelRetention = reopened }()
	for j, b := range batches {
		if j < stored {
			ret := rets[j]
			if ret == 0 {
				ret = r.events.Add(1)
			}
			r.applyBatch(b, now, ret)
			r.cps[keys[j]] = int64(j + 1)
			continue
		}
		for _, m := range append(slices.Clone(b.msgs), b.dls...) {
			lost[m.n] = true
			m.wantDL, m.done = "", true
		}
		if rets[j] != 0 {
			// Taken by the dead engine after the crash point (it goes on
			// here, a killed one would not): it counted the batch, which
			// the model cannot follow.
			r.countsLoose = true
		}
	}
	sort.SliceStable(ghosts, func(i, j int) bool { return ghosts[i].ticket < ghosts[j].ticket })
	for _, rec := range ghosts {
		switch {
		case !lost[rec.n]:
			r.observeGhost(rec)
		case rec.err == nil: // a batch the crash lost: published by the dead engine only
			r.countFired(r.msgs[rec.n], rec)
		}
	}
	r.settleAndCheck()
}

// lookupRaceStep looks up half of the ids from a goroutine, over and
// over, while the other half takes ingests and the clock moves, every
// publish failing as unavailable: nothing leaves the store and an outage
// changes nothing a Lookup shows, so each lookup must show the model's
// state of its id however the fire commits (retries moving task keys,
// holds) interleave with it.
func (r *modelRun) lookupRaceStep() {
	r.sink.setMode(sinkMode{outage: 1})
	var a, b []mKey
	for i, k := range r.keys {
		if i%2 == 0 {
			a = append(a, k)
		} else {
			b = append(b, k)
		}
	}
	if len(a) == 0 || len(b) == 0 {
		r.sink.setMode(sinkMode{})
		return
	}
	type want struct {
		found    bool
		origin   string
		due      int64
		attempts uint32
		target   string
	}
	wants := make([]want, len(b))
	for i, k := range b {
		if en := r.state[k]; en != nil && !en.cancel {
			m := en.msg
			wants[i] = want{true, fmt.Sprintf("m%d", m.n), m.due, m.attempts, m.tr.String() + ":out"}
		}
	}
	r.note("lookup race on %v", b)
	stop := make(chan struct{})
	var bad []string
	var looks int
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			for i, k := range b {
				info, err := r.e.Lookup(k.src, k.id)
				looks++
				w := wants[i]
				var got want
				if err == nil {
					got = want{true, info.Origin, info.Due.UnixMilli(), info.Attempts, info.Target}
				} else if !errors.Is(err, ErrNotFound) {
					bad = append(bad, fmt.Sprintf("%s/%s: %v", k.src, k.id, err))
					continue
				}
				if got != w {
					bad = append(bad, fmt.Sprintf("%s/%s: got %+v, want %+v", k.src, k.id, got, w))
				}
			}
		}
	})
	for range 2 + r.rng.IntN(6) {
		if r.rng.IntN(2) == 0 {
			bb := r.buildBatch(15, nil, a, false)
			now := r.now()
			if err := r.e.Ingest(context.Background(), bb.tasks, nil); err != nil {
				r.t.Fatalf("Ingest: %v", err)
			}
			r.applyBatch(bb, now, r.events.Add(1))
		} else {
			d := time.Duration(1+r.rng.IntN(120000)) * time.Millisecond
			r.note("advance %v", d)
			r.clk.Advance(d)
		}
		time.Sleep(time.Duration(r.rng.IntN(500)) * time.Microsecond) // let the lookups meet the fires
	}
	close(stop)
	wg.Wait()
	r.cov["lookups raced"] += looks
	for _, s := range bad[:min(len(bad), 10)] {
		r.t.Errorf("step %d: a Lookup racing the fire loops: %s", r.step, s)
	}
	r.settleAndCheck()
	r.sink.setMode(sinkMode{})
}

// failPhase sets a random failure mode, moves the clock through a few
// retries, and sets success again.
func (r *modelRun) failPhase() {
	m := sinkMode{transient: r.rng.Float64() * 0.6, outage: r.rng.Float64() * 0.6, rejected: r.rng.Float64() * 0.1}
	if r.rng.IntN(3) == 0 {
		m = sinkMode{outage: 1}
	}
	if r.rng.IntN(3) == 0 {
		m.only = codec.Transport(1 + r.rng.IntN(2))
	}
	r.note("fail phase %+v", m)
	r.sink.setMode(m)
	for range 1 + r.rng.IntN(6) {
		if r.rng.IntN(2) == 0 {
			r.ingestBatch(20, nil)
			r.settleAndCheck()
		}
		r.clk.Advance(time.Duration(1+r.rng.IntN(90)) * time.Second)
		r.settleAndCheck()
		if r.rng.IntN(4) == 0 {
			r.restart()
		}
	}
	r.sink.setMode(sinkMode{})
	r.note("fail phase over")
}

// drain moves the clock past every retry and held-task probe with the sink
// succeeding, then checks that nothing overdue remains.
func (r *modelRun) drain() {
	r.sink.setMode(sinkMode{})
	r.note("drain")
	if r.now() < r.maxNow {
		// First as it is: what went early after the step would show.
		for range 2 {
			r.clk.Advance(2 * time.Minute)
			r.settleAndCheck()
		}
		// A failed publish's retry time, and a failing dead letter's,
		// are stored wall-clock times: after a step back they wait the
		// step too (README "How it works", docs/design.md "Two clocks").
		if r.now() < r.maxNow {
			r.clk.Set(time.UnixMilli(r.maxNow))
			r.settleAndCheck()
		}
	}
	for range 4 {
		r.clk.Advance(2 * time.Minute)
		r.settleAndCheck()
	}
	if r.pz.paused() {
		// Nothing due goes but the dead letters a source waits for.
		r.cov["drain while paused"]++
		r.checkAwaits(true)
		r.checkState()
		return
	}
	r.outageDirty = [3]bool{}
	now := r.now()
	for k, en := range r.state {
		if !en.cancel && en.msg.due <= now {
			r.t.Errorf("step %d: after a drain %s/%s msg %d (due %d, attempts %d, failed %v) is still pending at %d",
				r.step, k.src, k.id, en.msg.n, en.msg.due-ms(t0), en.msg.attempts, en.msg.failed, now-ms(t0))
		}
	}
	for _, m := range r.msgs {
		if m.wantDL != "" && !m.dlDelivered {
			r.t.Errorf("step %d: after a drain the dead letter %s of msg %d is not delivered", r.step, m.wantDL, m.n)
		}
	}
	r.checkAwaits(true)
	if st := r.e.Stats(); !st.OldestOverdue.IsZero() {
		r.t.Errorf("step %d: after a drain Stats.OldestOverdue = %v", r.step, st.OldestOverdue)
	}
	r.checkState()
}

// settleAndCheck waits for the engine to settle, feeds the deliveries to
// the model and checks them.
func (r *modelRun) settleAndCheck() {
	r.settle()
	r.sink.mu.Lock()
	unbegun := r.sink.unbegun
	r.sink.mu.Unlock()
	if unbegun != 0 {
		r.t.Fatalf("step %d: %d Deliver calls without testHookBeginPublish", r.step, unbegun)
	}
	recs := r.sink.take()
	sort.SliceStable(recs, func(i, j int) bool { return recs[i].ticket < recs[j].ticket })
	for _, rec := range recs {
		r.observe(rec)
	}
	r.checkPausedBegins()
	r.checkAwaits(false)
	r.checkFiring()
	r.checkState()
}

// observe applies one delivery to the model and checks it.
func (r *modelRun) observe(rec mRecord) {
	if rec.n < 0 || rec.n >= len(r.msgs) {
		r.t.Errorf("step %d: delivery of an unknown task %+v", r.step, rec)
		return
	}
	m := r.msgs[rec.n]
	k := mKey{m.src, m.id}
	res := "ok"
	if rec.err != nil {
		res = rec.err.Error()
	}
	r.note("  deliver %v %d (%s/%s) ticket %d: %s", rec.kind, m.n, m.src, m.id, rec.ticket, res)
	if rec.kind == codec.KindDeadLetter {
		m.dlSeen = true
		if rec.err != nil {
			r.cov["dead letter failed"]++
		}
		switch {
		case m.dlDelivered:
			r.t.Errorf("step %d: dead letter of msg %d delivered again after its DLQ took it", r.step, m.n)
		case rec.err != nil:
		case m.wantDL == "" && m.mayDL == rec.code:
			r.cov["dead letter of a task superseded in flight"]++
		case m.wantDL == "":
			r.t.Errorf("step %d: dead letter %s of msg %d, which the model did not dead-letter", r.step, rec.code, m.n)
		case rec.code != m.wantDL:
			r.t.Errorf("step %d: dead letter of msg %d has code %s, want %s", r.step, m.n, rec.code, m.wantDL)
		}
		m.dlDelivered = m.dlDelivered || rec.err == nil
		if rec.err == nil {
			r.countFired(m, rec)
		}
		return
	}
	if !m.scheduled || m.cancel {
		r.t.Errorf("step %d: msg %d delivered, which the model never scheduled", r.step, m.n)
		return
	}
	if m.done {
		r.t.Errorf("step %d: msg %d delivered again after it was acknowledged or dead-lettered", r.step, m.n)
		return
	}
	if rec.at < m.due && !m.tried {
		// Set aside by a pause or not: a step back of the clock never
		// makes a first publish early (TestM227PausedStepBackFiresEarly).
		r.t.Errorf("step %d: msg %d delivered at %d, before its due %d", r.step, m.n, rec.at-ms(t0), m.due-ms(t0))
	}
	if rec.at < m.due {
		r.cov["tried again before its due after a step back"]++
	}
	m.tried = true
	if m.supersededAt != 0 && rec.ticket < m.supersededAt {
		r.cov["superseded while in flight"]++
	}
	if m.supersededAt != 0 && rec.ticket > m.supersededAt {
		r.t.Errorf("step %d: msg %d handed to the sink (ticket %d) after the message superseding it was acknowledged (ticket %d)",
			r.step, m.n, rec.ticket, m.supersededAt)
	}
	cur := r.state[k]
	current := cur != nil && !cur.cancel && cur.msg == m
	if !current && m.supersededAt == 0 {
		r.t.Errorf("step %d: msg %d delivered, not the pending task of %s/%s in the model nor superseded", r.step, m.n, k.src, k.id)
		return
	}
	var rejected *RejectedError
	switch {
	case rec.err == nil:
		r.countFired(m, rec)
		m.done = true
		m.acked++
		// Same due, same id: delivered in ingest order (README "What the
		// target receives").
		dk := mDueKey{k, m.due}
		if prev, ok := r.lastSameDue[dk]; ok && prev > m.n {
			r.t.Errorf("step %d: msg %d of %s/%s due %d delivered after msg %d with the same id and due, ingested later",
				r.step, m.n, k.src, k.id, m.due-ms(t0), prev)
		}
		r.lastSameDue[dk] = max(r.lastSameDue[dk], m.n)
		if current {
			delete(r.state, k)
		}
	case !current:
		// Superseded, and the sink called before that: its failure may
		// have been committed before the superseding message was
		// decided (then it was retried, a release may even have
		// delivered it at once, or dead-lettered: the message then found
		// the id free) or after (then it is gone).
		m.failed = true
		switch {
		case errors.As(rec.err, &rejected):
			m.mayDL = rejected.Code
		case errors.Is(rec.err, ErrUnavailable):
		default:
			m.attempts++
			if m.attempts >= mMaxAttempts {
				m.mayDL = codec.CodePublishFailed
			}
		}
	case errors.As(rec.err, &rejected):
		m.done, m.failed = true, true
		m.wantDL = rejected.Code
		delete(r.state, k)
	case errors.Is(rec.err, ErrUnavailable):
		m.failed = true
		r.outageDirty[m.tr] = true
	default:
		m.failed = true
		m.attempts++
		if m.attempts >= mMaxAttempts {
			m.done = true
			m.wantDL = codec.CodePublishFailed
			delete(r.state, k)
		}
	}
}

// checkState compares Lookup and Stats with the model, and that every
// task due that never failed was delivered (when no outage may hold it).
func (r *modelRun) checkState() { r.check(true) }

// check is checkState; settled false (publishes held at the gate) leaves
// out what the held publishes may not have done yet.
func (r *modelRun) check(settled bool) {
	now := r.now()
	var pending int64
	minDue, anyFailed := int64(noDue), r.outageDirty != [3]bool{}
	var held int64
	for _, k := range r.keys {
		en := r.state[k]
		info, err := r.e.Lookup(k.src, k.id)
		if en == nil || en.cancel {
			if !errors.Is(err, ErrNotFound) {
				r.t.Errorf("step %d: Lookup(%s, %s) = %+v, %v; the model holds nothing pending", r.step, k.src, k.id, info, err)
			}
			continue
		}
		pending++
		m := en.msg
		minDue = min(minDue, m.due)
		anyFailed = anyFailed || m.failed
		if err != nil {
			r.t.Errorf("step %d: Lookup(%s, %s): %v; the model holds msg %d (due %d, attempts %d)", r.step, k.src, k.id, err, m.n, m.due-ms(t0), m.attempts)
			continue
		}
		if info.Held {
			r.cov["held on disk (Lookup)"]++
			held++
		}
		wantTarget := m.tr.String() + ":out"
		if info.Target != wantTarget || !m.failed && !info.NextFire.Equal(info.Due.Time) {
			r.t.Errorf("step %d: Lookup(%s, %s) = target %s next fire %v due %v; want target %s, next fire = due (never failed)",
				r.step, k.src, k.id, info.Target, info.NextFire, info.Due, wantTarget)
		}
		if m.due > now+r.opts.Horizon.Milliseconds() {
			r.cov["pending beyond the horizon"]++
		}
		if info.Due.UnixMilli() != m.due || info.Attempts != m.attempts || info.Origin != fmt.Sprintf("m%d", m.n) {
			r.t.Errorf("step %d: Lookup(%s, %s) = origin %s due %d attempts %d; the model holds msg %d due %d attempts %d",
				r.step, k.src, k.id, info.Origin, info.Due.UnixMilli()-ms(t0), info.Attempts, m.n, m.due-ms(t0), m.attempts)
		}
		if settled && !r.pz.paused() && !r.outageDirty[m.tr] && !m.failed && m.due <= now {
			r.t.Errorf("step %d: msg %d (%s/%s) due %d, never failed, not delivered at %d", r.step, m.n, k.src, k.id, m.due-ms(t0), now-ms(t0))
		}
	}
	st := r.e.Stats()
	// Dead letters not yet taken by their DLQ count too (those held at the
	// gate were not seen yet: checked only when settled).
	for _, m := range r.msgs {
		// A dead letter no source waits for is not tried while firing is
		// paused, nor, set aside by a pause and back in the wheel after a
		// restart, before its fire time after a step back of the clock:
		// it exists once the model knows it.
		if (m.dlSeen || m.wantDL != "") && !m.dlDelivered {
			pending++
			anyFailed = true
		}
	}
	if settled && st.Pending != pending {
		r.t.Errorf("step %d: Stats.Pending = %d, the model holds %d", r.step, st.Pending, pending)
	}
	if settled && st.Held != held {
		r.t.Errorf("step %d: Stats.Held = %d, Lookup found %d held", r.step, st.Held, held)
	}
	if settled && r.pz.paused() {
		r.checkPausedStats(st, minDue, anyFailed)
	} else if settled && !anyFailed {
		// Nothing waits for a retry: the next fire time is the earliest
		// due, and nothing is overdue.
		want := Time{}
		if minDue != noDue {
			want = msTime(minDue)
		}
		if !st.NextDue.Equal(want.Time) || !st.OldestOverdue.IsZero() {
			r.t.Errorf("step %d: Stats.NextDue = %v, OldestOverdue = %v; the model's earliest due is %v and nothing overdue",
				r.step, st.NextDue, st.OldestOverdue, want)
		}
	}
}

func (r *modelRun) lookupAll() {
	r.note("lookups")
	r.checkState()
}
