// Package shard is the durable heart of delaybridge: one Pebble store split
// into N shards, each with a timing wheel and one fire loop.
//
// A task is routed by xxhash(source, id) so every message with the same id
// lands in the same shard, whose mutex orders the decisions about that id
// (replace, cancel, fire outcome) and the horizon loader. Ingest decides a
// whole source batch under the shard locks, applies it to Pebble outside
// them (after any earlier undurable decision it read) as one synced
// commit, and only once that commit is durable puts the tasks in the
// wheel. The wheel holds only (fire, seq) pairs of tasks due before the
// shard's horizon; the rest stays on disk until the loader reaches it. A
// fire loop reads due envelopes, hands them to the Sink and deletes the
// acknowledged ones in one synced commit whose fsync overlaps the next
// delivery; failures are rescheduled with backoff and finally
// dead-lettered.
package shard

import (
	"bytes"
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/clock"
	"github.com/delaybridge/delaybridge/internal/logthrottle"
	"github.com/delaybridge/delaybridge/metrics"
	"github.com/delaybridge/delaybridge/wheel"
)

// ErrInvalidTask is returned by Ingest for a task the engine cannot store
// (an unknown kind); nothing of the batch is written.
var ErrInvalidTask = errors.New("shard: invalid task")

// ErrRunning is returned by Run when it is already running and by Close
// while Run is active.
var ErrRunning = errors.New("shard: engine running")

// Engine is the durable delay engine.
type Engine struct {
	opts Options
	log  *zap.Logger
	// refusedLog: the first refused publish per destination and reason,
	// then one line per 30 s, so a target that refuses (a missing topic, a
	// subject no stream captures) is seen before its tasks are
	// dead-lettered.
	refusedLog logthrottle.Throttle
	// unparkedLog: the parked dead letters a DLQ took at last, once per
	// DLQ and then one line per 30 s with those held back: a DLQ fixed
	// after refusing thousands took them with a line each.
	unparkedLog logthrottle.Throttle
	// storeLines: the store failures the shards meet each on their own,
	// once per engine and condition (storelog.go).
	storeLines storeLines
	m          *metrics.Metrics
	clk        clock.Clock
	db         *pebble.DB
	shards     []*shard
	health     *storeHealth // Pebble's write stalls and background errors
	reserve    *diskReserve // Options.ReserveBytes
	unsetDisk  func()       // removes diskStats from the metrics

	// dlqLines: the failures of each DLQ, once per engine (dlqlog.go).
	dlqLines dlqLines

	seq atomic.Uint64 // last allocated store sequence

	dl dlWaits // dead letters whose DLQ acknowledgement a source awaits
	// dlTick orders the failures of dead letters (dlFailure.at).
	dlTick atomic.Uint64

	// ingestMu orders the decide-and-apply section of Ingest. Nearly every
	// batch touches every shard, so one mutex hands over faster than a
	// convoy through the shard locks; those are then held only briefly
	// against the fire loops.
	ingestMu sync.Mutex
	cpOwner  map[string]*commitTicket // last writer of each checkpoint key; under ingestMu

	// paused: firing paused, for either reason (pause.go): the catch-up at
	// start (PauseFiring) or an operator (PauseFiringByOperator). pauseMu
	// orders the changes of the two in memory; opMu, taken before it,
	// orders the operator's pauses and resumes with their store record
	// (held across the synced write, which pauseMu is not). Lock order:
	// opMu, pauseMu, shard.mu.
	paused        atomic.Bool
	opMu          sync.Mutex
	pauseMu       sync.Mutex
	catchUpPaused bool           // under pauseMu
	opPause       *OperatorPause // changed under opMu and pauseMu; nil: none

	// outages: the target groups in an outage, whose waiting tasks go
	// at once when one of them is delivered (recover.go).
	outages groupOutages

	errMu    sync.Mutex
	storeErr error // sticky: first failed write

	closeMu sync.RWMutex
	closed  bool
	running atomic.Bool

	commitIngest, commitFire, commitRetry, commitCancel, commitDrop prometheus.Observer

	// Index filters (filter.go): a background loop builds them at open and
	// when one is full.
	fltKick    chan struct{}
	fltBuildMu sync.Mutex // one build at a time
	fltMu      sync.Mutex
	fltCond    *sync.Cond
	fltBuilds  int // completed builds; under fltMu
	bgCancel   context.CancelFunc
	bgDone     chan struct{}

	// Test hooks, nil outside tests.
	testHookFilterScan    func() error // a build installed its filters, before the scan; an error fails it
	testHookIngestDecided func()       // an Ingest decided, before it applies
	testHookLookupWaits   func()       // a Lookup waits for the write its entry comes from
	testHookClaimRead     func(n int)  // a fire loop read the envelopes of n claimed entries, before it hands them to their lanes
	testHookStatsRead     func()       // Stats read a shard's first stored task and oldest held one, before it keeps them
	loadPage              int          // most stored tasks one loadLocked reads (defaultLoadPage; tests set less)
	// testHookBeginPublish sees each batch under its shard's lock right
	// after deliver's last supersession check, where its publish begins.
	testHookBeginPublish func(batch []*codec.Task)
	// testHookDispatch sees each batch the fire loop hands to a lane,
	// under its shard's lock, in the loop's order (deliver's publish
	// begins later, on the lane's goroutine).
	testHookDispatch func(part []fireItem)
	// testHookRelease sees the groups of each release (recover.go),
	// before the shards are told.
	testHookRelease func(groups []int64)
	// testHookProbe sees each waiting task pulled forward to probe its
	// down group (recover.go), before its shard is told.
	testHookProbe func(group int64, seq uint64)
	// testHookLaneDone: a lane's batch returned and the lane is free
	// again, before the fire loop is woken to use it.
	testHookLaneDone func()
	// testHookPark: a parking fire loop read the clock and is about to
	// arm its timer (under the shard lock).
	testHookPark func()
	// testHookPausedPark: a paused fire loop decided to park and let go
	// of its shard's lock, before park takes it again (tests).
	testHookPausedPark func()
	// testHookClear: clearFired is about to delete the range up to end
	// (without the shard lock).
	testHookClear func(end []byte)
	// testHookReclaimFlush: a reclaimFlush of the disk reserve started
	// a flush that closes flushed when done (nil: none started).
	testHookReclaimFlush func(flushed <-chan struct{})

	// fresh: Open created the store (see Fresh). Last, so the layout of
	// the fields above, the hot atomics among them, is as it was.
	fresh bool
}

// shard is one slice of the keyspace with its wheel and fire loop. mu
// guards everything below it and every index entry routed to the shard.
type shard struct {
	e     *Engine
	id    int
	label string

	mu sync.Mutex
	w  *wheel.Wheel
	// The wheel holds every stored task whose (fire, seq) is before
	// (horizonEnd, horizonSeq): all due before horizonEnd, and those due
	// at horizonEnd with a seq below horizonSeq (0 unless the loader
	// stopped a page inside a herd of equal dues; see loadLocked).
	horizonEnd int64 // ms
	horizonSeq uint64
	lastNow    int64 // the engine time the fire loop last read (rebaseLocked)
	pending    int64
	nextSweep  int64
	queue      []*pendingBatch         // applied batches waiting for their fsync, in apply order
	unwheeled  map[uint64]struct{}     // seqs of those batches' tasks: the loader skips them
	overlay    map[string]overlayEntry // index decisions of those batches
	// inflight holds the seqs of the tasks handed to the sink; a replace
	// or cancel that deletes one meanwhile marks it superseded, so the
	// outcome is not recorded for it (only counted: a replaced or
	// cancelled task the broker acknowledged anyway was fired, one it did
	// not was replaced or cancelled). A task that is not superseded still owns its index
	// entry (every change of an id's entry deletes the task it pointed
	// to, under this lock), so the ack deletes both without reading the
	// index.
	inflight map[uint64]supersession
	// cancelSrc is the source of each replace or cancel that superseded a
	// task in flight (replacedInFlight, cancelledInFlight), for counting
	// it replaced or cancelled when the task turns out gone before it was
	// read (claimed, then superseded, then read): no delivery is left to
	// count it. Entries leave with their inflight entry
	// (endInflightLocked).
	cancelSrc map[uint64]string
	// deleting holds the seqs of stored tasks that an applied-but-not-yet-
	// durable (or not yet applied) batch deletes by a replace or cancel:
	// they may still be visible in Pebble, so claimLocked must not hand them
	// to the sink.
	deleting map[uint64]struct{}
	// churn counts the overlay and unwheeled entries deleted since those
	// maps were last rebuilt (see rebuilt).
	churn int
	// firedSinceClear counts the tasks fired since the last range
	// deletion of fired tombstones, clears those deletions (fire.go).
	firedSinceClear, clears int
	// clearing: the ticket of a range deletion of fired tombstones
	// decided and not yet applied (clearFired); clearEnd: the end it was
	// decided with, at or after the one it is applied with. A batch that
	// stores a task key of the shard below clearEnd applies after it
	// (addOpLocked).
	clearing *commitTicket
	clearEnd wheelOp
	// late: the tasks waiting for a retry, by seq; see late.go.
	late      map[uint64]lateTask
	lateMin   int64 // smallest of late unless lateDirty
	lateDirty bool
	// released: waiting tasks of targets back from an outage, to take
	// out of the wheel and deliver at once, in order (recover.go).
	released []releasedTask
	// dlFailing: the shard's dead letters whose last delivery failed, by
	// seq, until their DLQ acknowledges them or they leave the store; of
	// them, dlParked are parked (see dlFailedLocked), dlHeld not.
	// dlByDest sums the dlHeld ones by DLQ; dlParkedLast is the last
	// refusal while any is parked (see dlSetLocked).
	dlFailing        map[uint64]dlFailure
	dlHeld, dlParked int
	dlByDest         map[string]*dlDest
	dlParkedLast     dlLast
	// statsNext, statsHeld: the first stored task's fire time and the
	// oldest held due as Stats last read them without error, for one
	// whose read fails.
	statsNext, statsHeld statsRead
	statsSeq             uint64 // numbers Stats's reads, each made under mu
	// dlqLeft: the DLQs whose last failing dead letter of the shard (not
	// parked) left dlByDest since dlqClearedLocked last ran: acknowledged,
	// parked or dropped (dlqlog.go); dlqGone: those of them that one left
	// by leaving the store (dropped); dlqParkGone: the DLQs of parked
	// dead letters that left the store (dlqlog.go: parkGone).
	dlqLeft, dlqGone, dlqParkGone []string
	// lanes: per target transport, the fire batch in flight and its
	// outage (see lane.go), so a target that holds a publish or cannot be
	// reached delays only its own transport's tasks.
	lanes [transportSlots]lane

	// undecodable: stored tasks whose envelope the fire loop could not
	// decode, by seq (see stuck.go); they stay in the store, out of the
	// wheel, until an operator drops them.
	undecodable map[uint64]undecodable

	// paused: due tasks set aside while firing is paused (pause.go), not
	// in flight, 16 bytes each; pausedMin is the earliest due of them,
	// pausedSorted whether they are in due order.
	paused       []wheelOp
	pausedMin    int64
	pausedSorted bool
	// pauseParked: the fire loop parks because firing is paused (park).
	pauseParked bool

	// Fire-loop parking, so Ingest can wake the loop for an earlier due and
	// tests can tell when the loop is idle.
	parked bool
	wakeAt int64 // ms the parked loop wakes for
	// parkTimer is the loop's timer, for tests: a fake clock's tells
	// when it fires (clock.Deadliner), so a test knows the loop is idle.
	parkTimer clock.Timer
	notify    chan struct{}

	rng *rand.Rand // jitter; used by the fire loop only

	// flt holds every key of the shard's index (nil until the first
	// build); fltNext is the one being built. See filter.go.
	flt, fltNext *idFilter
	fltScanned   int64 // keys the last build found in the shard
	indexReads   int64 // lookups that read the store

	pendingG, inWheelG prometheus.Gauge
}

func (o *Options) setDefaults() {
	if o.Shards <= 0 {
		o.Shards = defaultShards
	}
	if o.Horizon <= 0 {
		o.Horizon = 10 * time.Minute
	}
	if o.Horizon < 2*time.Millisecond {
		o.Horizon = 2 * time.Millisecond
	}
	if o.stallGrace <= 0 {
		o.stallGrace = storeStallGrace
	}
	if o.filterMinKeys <= 0 {
		o.filterMinKeys = filterMinKeys
	}
	if o.FireBatch <= 0 {
		o.FireBatch = 512
	}
	if o.FireBatchBytes <= 0 {
		o.FireBatchBytes = DefaultFireBatchBytes
	}
	if o.LaneGrace <= 0 {
		o.LaneGrace = 2 * time.Second
	}
	if o.OutageMemory == 0 {
		o.OutageMemory = defaultOutageMemory
	} else if o.OutageMemory < 0 { // negative: none
		o.OutageMemory = 0
	}
	if o.CancelRetention == 0 {
		o.CancelRetention = 24 * time.Hour
	} else if o.CancelRetention < 0 { // negative: none
		o.CancelRetention = 0
	}
	r := &o.Retry
	if r.Initial <= 0 {
		r.Initial = 500 * time.Millisecond
	}
	if r.Max <= 0 {
		r.Max = 5 * time.Minute
	}
	if r.Max < r.Initial {
		r.Max = r.Initial
	}
	if r.Multiplier < 1 {
		r.Multiplier = 2
	}
	if r.Jitter == 0 {
		r.Jitter = 0.2
	} else if r.Jitter < 0 { // negative: none
		r.Jitter = 0
	}
	if r.Jitter > 1 {
		r.Jitter = 1
	}
	if r.MaxAttempts <= 0 {
		r.MaxAttempts = 10
	}
	if o.Clock == nil {
		o.Clock = clock.Real{}
	}
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	if o.Metrics == nil {
		o.Metrics = metrics.New(nil)
	}
}

// defaultShards is the default Options.Shards.
const defaultShards = 8

// maxShards keeps the shard number, and the next one (the exclusive upper
// bound of a shard's key ranges), in the u16 of the keys.
const maxShards = 1<<16 - 1

// Open opens the store at opts.Dir and recovers: the pending counts and the
// sequence are read back, and each shard's wheel is filled with the stored
// tasks due before now+Horizon (overdue ones fire as soon as Run starts).
// The engine is ready when Open returns.
func Open(opts Options) (*Engine, error) { return OpenContext(context.Background(), opts) }

// OpenContext is Open, stopped by ctx while Pebble opens the store: a
// process told to stop during a start whose WAL replay cannot be flushed
// (a full volume) returns at once rather than after the open's grace.
// The error then wraps ctx's cause; the store is left as it was.
func OpenContext(ctx context.Context, opts Options) (*Engine, error) {
	if opts.Dir == "" {
		return nil, errors.New("shard: open: Options.Dir is required")
	}
	if opts.Shards > maxShards {
		return nil, fmt.Errorf("shard: open: %d shards, at most %d", opts.Shards, maxShards)
	}
	opts.setDefaults()
	if opts.FS == nil {
		// The store holds every payload: a directory it creates is the
		// process user's alone (Pebble would make it 0755). An existing
		// one keeps the mode its operator gave it.
		if err := os.MkdirAll(opts.Dir, 0o700); err != nil {
			return nil, fmt.Errorf("shard: open: %w", err)
		}
	}
	health := newStoreHealth(opts.stallGrace)
	db, err := openPebble(ctx, opts.Dir, opts.FS, opts.Logger, opts.CacheBytes, opts.MemTableBytes, health, opts.openGrace, opts.noBlockCache)
	if err != nil {
		return nil, err
	}
	e := &Engine{
		loadPage: defaultLoadPage,
		opts:     opts,
		log:      opts.Logger,
		m:        opts.Metrics,
		clk:      opts.Clock,
		db:       db,
		health:   health,
		reserve:  newDiskReserve(&opts, opts.Logger),
	}
	e.reserve.flush = e.reclaimFlush
	e.storeLines.log = opts.Logger
	e.dlqLines.log = opts.Logger
	e.cpOwner = make(map[string]*commitTicket)
	e.commitIngest = e.m.StoreCommit.WithLabelValues("ingest")
	e.commitFire = e.m.StoreCommit.WithLabelValues("fire")
	e.commitRetry = e.m.StoreCommit.WithLabelValues("retry")
	e.commitCancel = e.m.StoreCommit.WithLabelValues("cancel")
	e.commitDrop = e.m.StoreCommit.WithLabelValues("drop")
	if err := e.recover(); err != nil {
		// The shards recovered so far may have counted failing and
		// parked dead letters in; a failed Open leaves no engine to take them out.
		for _, sh := range e.shards {
			if sh != nil {
				e.m.DeadLettersParkedNow.Sub(float64(sh.dlParked))
				e.m.DeadLettersFailing.Sub(float64(sh.dlHeld))
			}
		}
		e.clearPauseGauges() // an operator's pause recover restored (R226)
		db.Close()
		return nil, err
	}
	e.startFilterLoop()
	e.unsetDisk = e.m.StoreDisk.Set(e.diskStats)
	return e, nil
}

// checkFormat refuses a store of a newer format than storeFormat and
// records this binary's format in one written before the key existed.
func (e *Engine) checkFormat() error {
	v, found, err := getCopy(e.db, formatKey)
	if err != nil {
		return fmt.Errorf("shard: recover: read store format: %w", err)
	}
	if found {
		if len(v) != 2 {
			return fmt.Errorf("shard: recover: corrupt store format record (%d bytes)", len(v))
		}
		if f := int(binary.BigEndian.Uint16(v)); f > storeFormat {
			return fmt.Errorf("%w: format %d, this binary reads up to %d: run the release that wrote it or a newer one (rolling back past a store format change is not supported)",
				ErrStoreFormat, f, storeFormat)
		} else if f == storeFormat {
			return nil
		}
	}
	// No format record: a new store, or one written before the record
	// existed, which holds other keys.
	empty, err := e.empty()
	if err != nil {
		return fmt.Errorf("shard: recover: %w", err)
	}
	e.fresh = empty
	if err := safeCall(func() error {
		return e.db.Set(formatKey, binary.BigEndian.AppendUint16(nil, storeFormat), pebble.Sync)
	}); err != nil {
		return fmt.Errorf("shard: recover: write store format: %w", err)
	}
	return nil
}

// empty reports whether the store holds no key at all.
func (e *Engine) empty() (bool, error) {
	it, err := e.db.NewIter(nil)
	if err != nil {
		return false, fmt.Errorf("read the store: %w", err)
	}
	first := it.First()
	if err := it.Close(); err != nil {
		return false, fmt.Errorf("read the store: %w", err)
	}
	return !first, nil
}

// Fresh reports whether Open created the store: its directory held none,
// or an empty one. A source that finds its broker's consumer position
// ahead of a fresh store's knowledge can tell that another store took
// those messages in (a changed data_dir, a replaced volume).
func (e *Engine) Fresh() bool { return e.fresh }

func (e *Engine) startFilterLoop() {
	e.fltCond = sync.NewCond(&e.fltMu)
	e.fltKick = make(chan struct{}, 1)
	ctx, cancel := context.WithCancel(context.Background())
	e.bgCancel, e.bgDone = cancel, make(chan struct{})
	e.kickFilter()
	go func() {
		defer close(e.bgDone)
		e.filterLoop(ctx)
	}()
}

// ShardCountError is Open's error for a store created with another
// number of shards than Options.Shards: tasks are routed to shards by a
// hash modulo the count, so it cannot change.
type ShardCountError struct {
	Stored, Asked int
}

func (e *ShardCountError) Error() string {
	return fmt.Sprintf("store has %d shards, options ask for %d: changing the shard count is not supported", e.Stored, e.Asked)
}

func (e *Engine) recover() error {
	if err := e.checkFormat(); err != nil {
		return err
	}
	n := e.opts.Shards
	v, found, err := getCopy(e.db, shardsKey)
	if err != nil {
		return fmt.Errorf("shard: recover: read shard count: %w", err)
	}
	if found {
		if len(v) != 2 {
			return fmt.Errorf("shard: recover: corrupt shard count")
		}
		if stored := int(uint16(v[0])<<8 | uint16(v[1])); stored != n {
			return fmt.Errorf("shard: recover: %w", &ShardCountError{Stored: stored, Asked: n})
		}
	} else if err := safeCall(func() error { return e.db.Set(shardsKey, []byte{byte(n >> 8), byte(n)}, pebble.Sync) }); err != nil {
		return fmt.Errorf("shard: recover: write shard count: %w", err)
	}
	if err := e.loadOperatorPause(); err != nil {
		return err
	}
	seq, _, err := getU64(e.db, seqKey)
	if err != nil {
		return fmt.Errorf("shard: recover: read sequence: %w", err)
	}
	e.seq.Store(seq)
	now := e.nowMs()
	e.shards = make([]*shard, n)
	for i := range e.shards {
		s := &shard{
			e:         e,
			id:        i,
			label:     strconv.Itoa(i),
			w:         wheel.New(now),
			notify:    make(chan struct{}, 1),
			unwheeled: make(map[uint64]struct{}),
			overlay:   make(map[string]overlayEntry),
			inflight:  make(map[uint64]supersession),
			deleting:  make(map[uint64]struct{}),
			rng:       rand.New(rand.NewPCG(uint64(now), uint64(i))),
		}
		for l := range s.lanes {
			s.lanes[l].publishingDue = noDue
		}
		s.pendingG = e.m.Pending.WithLabelValues(s.label)
		s.inWheelG = e.m.InWheel.WithLabelValues(s.label)
		pending, _, err := getU64(e.db, countKey(i))
		if err != nil {
			return fmt.Errorf("shard: recover: read pending count of shard %d: %w", i, err)
		}
		s.pending = int64(pending)
		s.pendingG.Set(float64(s.pending))
		e.shards[i] = s
	}
	e.dlqLines.wake = e.shards[0].wake
	// Fill the wheels with everything due before now+Horizon (overdue
	// included), shards in parallel: after a long outage this is the bulk
	// of the recovery time.
	errs := make([]error, n)
	var wg sync.WaitGroup
	sem := make(chan struct{}, max(runtime.GOMAXPROCS(0), 1))
	for i, s := range e.shards {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			s.mu.Lock()
			defer s.mu.Unlock()
			// The wheel starts at the earliest stored fire time, not now:
			// what is overdue then waits in its FIFO buckets, not in its
			// late list (dues before the wheel's time), where a task
			// ingested due before an overdue backlog goes into a heap,
			// O(log n) to add and to fire, instead of an append. (When
			// that list was a sorted slice alone, each such task was
			// inserted with a copy of the rest: 130 µs with a 200 k herd.)
			// A read that fails fails Open, as the load's would: the
			// load reads this range next.
			first, ok, err := s.firstStoredLocked(math.MinInt64)
			if err != nil {
				errs[i] = err
				return
			}
			if ok && first < now {
				s.w = wheel.New(first)
			}
			// The tasks waiting for an outage first: the load gives
			// those in the wheel their handles (wheeledLateLocked).
			if errs[i] = s.loadWaitingLocked(); errs[i] == nil {
				errs[i] = s.loadLocked(now)
			}
			if errs[i] == nil {
				errs[i] = s.loadHeldLocked()
			}
			if errs[i] == nil {
				errs[i] = s.loadDLFailuresLocked()
			}
			if errs[i] == nil {
				errs[i] = s.loadDLWaitsLocked()
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("shard: recover: %w", err)
	}
	e.logRestoredDLQs()
	return nil
}

// logRestoredDLQs logs, per DLQ, the dead letters that were failing (not
// parked) at the last restart, and begins their failure, which ends as
// any: a DLQ that failed before a restart and took them after it logged
// neither (TestDLQFailingAcrossRestart).
func (e *Engine) logRestoredDLQs() {
	byDest := map[string]map[int]int{}
	last := map[string]dlLast{}
	for _, s := range e.shards {
		s.mu.Lock()
		for dest, d := range s.dlByDest {
			if dest == "" {
				continue
			}
			if byDest[dest] == nil {
				byDest[dest] = map[int]int{}
			}
			byDest[dest][s.id] = d.n
			if l, ok := last[dest]; !ok || d.last.at > l.at {
				last[dest] = d.last
			}
		}
		s.mu.Unlock()
	}
	now := e.clk.Now()
	for _, dest := range slices.Sorted(maps.Keys(byDest)) {
		e.dlqLines.restored(now, dest, byDest[dest], last[dest].err)
	}
}

func (e *Engine) nowMs() int64 { return e.clk.Now().UnixMilli() }

func (e *Engine) horizonMs() int64 { return e.opts.Horizon.Milliseconds() }

// shardOf routes a (source, id) to its shard.
func (e *Engine) shardOf(source, id string) int { return shardOfN(source, id, len(e.shards)) }

// shardOfN is the shard of a task id among n: xxhash of source, 0, id.
func shardOfN(source, id string, n int) int {
	var d xxhash.Digest
	d.Reset()
	d.WriteString(source)
	d.Write([]byte{0})
	d.WriteString(id)
	return int(d.Sum64() % uint64(n))
}

// shardOfIndexKey is shardOfN of the (source, id) an index key holds: the
// key is the prefix byte, source, 0, id, so the hash is that of the rest.
func shardOfIndexKey(ik []byte, n int) int { return int(xxhash.Sum64(ik[1:]) % uint64(n)) }

// failed returns the sticky store error, if any.
func (e *Engine) failed() error {
	e.errMu.Lock()
	defer e.errMu.Unlock()
	return e.storeErr
}

// fail records a failed write. Every later write is refused: after a failed
// fsync the state of the WAL is unknown, so only a reopen (which replays the
// valid prefix) is safe.
func (e *Engine) fail(op string, err error) error {
	e.m.StoreErrors.Inc()
	e.errMu.Lock()
	if e.storeErr == nil {
		e.storeErr = fmt.Errorf("%w: %s: %w", ErrStoreFailed, op, err)
		e.log.Error("store write failed; refusing further writes until restart", zap.String("op", op), zap.Error(err))
	}
	e.errMu.Unlock()
	return fmt.Errorf("%w: %s: %w", ErrStoreFailed, op, err)
}

func (e *Engine) lockShards(touched []bool) {
	for i, ok := range touched {
		if ok {
			e.shards[i].mu.Lock()
			e.shards[i].drainLocked()
		}
	}
}

func (e *Engine) unlockShards(touched []bool) {
	for i, ok := range touched {
		if ok {
			e.shards[i].mu.Unlock()
		}
	}
}

// applyNoSyncWait applies b to the memtable and queues its WAL fsync; the
// caller must then call b.SyncWait before the batch counts as durable.
func (e *Engine) applyNoSyncWait(b *pebble.Batch, op string) error {
	if err := e.failed(); err != nil {
		return err
	}
	if err := safeCall(func() error { return e.db.ApplyNoSyncWait(b, pebble.Sync) }); err != nil {
		return e.fail(op, err)
	}
	return nil
}

// wheelOp is a wheel insertion decided under the shard lock and carried out
// once the batch that stored the task is durable.
type wheelOp struct {
	fire int64
	seq  uint64
}

// pendingBatch is one shard's part of an applied batch whose fsync is not
// confirmed yet. Its tasks are already visible in Pebble, so the loader
// must skip them (unwheeled) and they enter the wheel in apply order once
// durable.
type pendingBatch struct {
	ops    []wheelOp
	delta  int64
	keys   []string // overlay entries written by this batch
	dels   []uint64 // seqs of tasks this batch deletes (replace, cancel): in shard.deleting
	undo   []overlayUndo
	tk     *commitTicket
	synced atomic.Bool // durable; set without the shard lock
	// held: the change of the shard's held tasks per transport (hold.go).
	held [transportSlots]int64
	// waitDels: seqs of tasks this batch deletes that waited for an
	// outage: their waiting records go too (writeWaitDels).
	waitDels []uint64
}

func (s *shard) enqueueLocked(pb *pendingBatch) {
	s.queue = append(s.queue, pb)
	for _, op := range pb.ops {
		s.unwheeled[op.seq] = struct{}{}
	}
}

// markDurable records that pb's commit is durable. The durable batches at
// the head of the queue enter the wheel in apply (= seq) order, so
// equal-due tasks fire in ingest order. If another goroutine holds the
// shard lock, the head is left to the next lock holder and the fire loop
// is woken to take it (park drains after consuming stale wake-ups, so the
// wake-up cannot be lost); no batch waits for a shard lock here.
func (s *shard) markDurable(pb *pendingBatch) {
	pb.synced.Store(true)
	if s.mu.TryLock() {
		s.drainLocked()
		s.mu.Unlock()
		return
	}
	s.wake()
}

// wake tells the fire loop to look again (a wake-up already pending is
// enough).
func (s *shard) wake() {
	select {
	case s.notify <- struct{}{}:
	default:
	}
}

// drainLocked moves the durable batches at the head of the queue into the
// wheel and the pending count.
func (s *shard) drainLocked() {
	if len(s.queue) == 0 || !s.queue[0].synced.Load() {
		return
	}
	for len(s.queue) > 0 && s.queue[0].synced.Load() {
		head := s.queue[0]
		s.queue[0] = nil
		s.queue = s.queue[1:]
		// Replaced or cancelled by id, or dropped: gone from the store,
		// so neither undecodable nor a failing dead letter any more. For
		// a drop this must happen here, with its deleting mark cleared,
		// or a second drop of the same entry would find it stuck again.
		for _, seq := range head.dels {
			s.forgetUndecodableLocked(seq)
			s.dlGoneLocked(seq)
		}
		s.dlqClearedLocked()
		s.dropOverlayLocked(head)
		for _, op := range head.ops {
			delete(s.unwheeled, op.seq)
			s.addLocked(op.fire, op.seq)
		}
		s.pending += head.delta
		s.heldDoneLocked(head)
		s.churn += len(head.ops) + len(head.keys)
	}
	if len(s.queue) == 0 {
		s.queue = nil
	}
	if s.churn >= churnRebuild {
		s.churn = 0
		s.overlay = rebuilt(s.overlay)
		s.unwheeled = rebuilt(s.unwheeled)
		// Every claim passes through inflight too: after a burst (a
		// backlog claimed and set aside while its lane fails, say) it
		// would keep the burst's size.
		s.inflight = rebuilt(s.inflight)
		if len(s.cancelSrc) == 0 {
			s.cancelSrc = nil
		}
	}
	s.pendingG.Set(float64(s.pending))
	s.inWheelG.Set(float64(s.w.Len()))
}

// supersession is what happened to a task in flight meanwhile.
type supersession uint8

const (
	notSuperseded supersession = iota
	replacedInFlight
	cancelledInFlight
	// An operator dropped a failing dead letter (Engine.DropStuck) held,
	// or parked.
	droppedHeldInFlight
	droppedParkedInFlight
)

// endInflightLocked takes seq out of the in-flight set, returning what
// superseded it meanwhile and, for a replace or cancel, its source.
func (s *shard) endInflightLocked(seq uint64) (sup supersession, cancelSource string) {
	sup, cancelSource = s.inflight[seq], s.cancelSrc[seq]
	delete(s.inflight, seq)
	delete(s.cancelSrc, seq)
	return sup, cancelSource
}

// dropped reports whether an operator's drop superseded the task.
func (s supersession) dropped() bool {
	return s == droppedHeldInFlight || s == droppedParkedInFlight
}

// state is the state of a dropped dead letter at its drop.
func (s supersession) state() StuckState {
	if s == droppedParkedInFlight {
		return StuckParked
	}
	return StuckHeld
}

// supersedeLocked records that pb deletes the stored task seq (a replace
// or a cancel of source, by replacedInFlight or cancelledInFlight). If
// the task is in flight its delivery outcome is not recorded, and
// inFlight tells the caller so: the replace or cancel is then counted by
// the delivery, as replaced or cancelled only if the broker did not take
// the task (it was fired if it did). Until pb is durable, claimLocked
// skips the task.
func (s *shard) supersedeLocked(seq uint64, pb *pendingBatch, by supersession, source string) (inFlight bool) {
	if _, ok := s.inflight[seq]; ok {
		s.inflight[seq], inFlight = by, true
		if by == replacedInFlight || by == cancelledInFlight {
			if s.cancelSrc == nil {
				s.cancelSrc = make(map[uint64]string)
			}
			s.cancelSrc[seq] = source
		}
	}
	s.deleting[seq] = struct{}{}
	if lt, ok := s.clearLateLocked(seq); ok && lt.group() != 0 {
		pb.waitDels = append(pb.waitDels, seq)
	}
	pb.dels = append(pb.dels, seq)
	return inFlight
}

// abandonLocked drops a batch that will not be applied: its commit failed
// (the store is failed), or the Ingest that decided it failed a lookup.
// Every decision it made is taken back: a task in flight it superseded
// records its own delivery outcome again, and the overlay entries of
// earlier undurable batches it replaced are restored, so later lookups
// see those batches' decisions rather than a Pebble that may not have
// them yet.
func (s *shard) abandonLocked(pb *pendingBatch) {
	for _, seq := range pb.dels {
		if _, ok := s.inflight[seq]; ok {
			s.inflight[seq] = notSuperseded
			delete(s.cancelSrc, seq)
		}
	}
	undo := pb.undo
	s.dropOverlayLocked(pb)
	for i := len(undo) - 1; i >= 0; i-- {
		u := undo[i]
		if _, ok := s.overlay[u.key]; !ok && slices.Contains(s.queue, u.prev.owner) {
			s.overlay[u.key] = u.prev
		}
	}
	for _, op := range pb.ops {
		delete(s.unwheeled, op.seq)
	}
	if i := slices.Index(s.queue, pb); i >= 0 {
		s.queue = slices.Delete(s.queue, i, i+1)
	}
}

// addLocked puts a durable task in the wheel if it is due before the
// horizon end (else the loader will find it) and wakes the fire loop if it
// is parked past the task's due.
func (s *shard) addLocked(fire int64, seq uint64) {
	if !s.belowHorizonLocked(fire, seq) {
		return
	}
	h := s.w.Add(fire, seq)
	if len(s.late) > 0 {
		s.wheeledLateLocked(fire, seq, h)
	}
	if s.parked && fire < s.wakeAt {
		s.parked = false
		s.wake()
	}
}

// Ingest stores a batch of tasks (schedules, cancels, dead letters) and the
// checkpoints in ONE synced commit, processing the tasks in order. It
// returns only when the batch is durable; the tasks are then in the wheels
// or, if another goroutine held a shard lock at that moment, enter them as
// soon as the fire loop or the next lock holder drains the shard.
func (e *Engine) Ingest(ctx context.Context, tasks []codec.Task, cps []Checkpoint) error {
	_, err := e.ingest(ctx, tasks, cps, false)
	return err
}

// IngestAwait is Ingest that also returns a DeadLetters for the batch's
// dead letters, whose Wait returns once the DLQ broker acknowledged each of
// them (CONTRACT §3: a source commits its offset only after the DLQ write
// is acknowledged). Nil when the batch holds no dead letter.
func (e *Engine) IngestAwait(ctx context.Context, tasks []codec.Task, cps []Checkpoint) (*DeadLetters, error) {
	return e.ingest(ctx, tasks, cps, true)
}

func (e *Engine) ingest(ctx context.Context, tasks []codec.Task, cps []Checkpoint, await bool) (*DeadLetters, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("shard: ingest: %w", err)
	}
	e.closeMu.RLock()
	defer e.closeMu.RUnlock()
	if e.closed {
		return nil, ErrClosed
	}
	if err := e.failed(); err != nil {
		return nil, err
	}
	if len(tasks) == 0 && len(cps) == 0 {
		return nil, nil
	}
	if len(tasks) > 0 {
		// A checkpoint-only batch is a few bytes: taken even so.
		e.reserve.refresh()
		if err := e.reserve.err(); err != nil {
			return nil, err
		}
	}
	sc := getScratch(len(tasks), len(e.shards))
	defer putScratch(sc)
	route, touched := sc.route, sc.touched
	for i := range tasks {
		t := &tasks[i]
		switch t.Kind {
		case codec.KindSchedule, codec.KindCancel:
			route[i] = e.shardOf(t.Source, t.ID)
		case codec.KindDeadLetter:
			route[i] = e.shardOf(t.Source, t.Origin)
		default:
			return nil, fmt.Errorf("%w: task %d (%s/%s): kind %v", ErrInvalidTask, i, t.Source, t.ID, t.Kind)
		}
		touched[route[i]] = true
	}
	// Encode outside the shard locks: envelopes and index keys into two
	// arenas, so the critical section only looks up, decides and copies.
	envEnd, ikEnd := sc.envEnd, sc.ikEnd
	// Sized up front: codec.AppendTask grows its dst to the exact need, so
	// appending many envelopes to a small buffer would copy quadratically.
	envCap, ikCap := 0, 0
	for i := range tasks {
		envCap += envelopeBound(&tasks[i])
		ikCap += 2 + len(tasks[i].Source) + len(tasks[i].ID)
	}
	envs, iks := sc.arenas(envCap, ikCap)
	e.reserve.wrote(envCap + ikCap)
	for i := range tasks {
		t := &tasks[i]
		if t.Kind != codec.KindCancel {
			envs = codec.AppendTask(envs, t)
		}
		envEnd[i] = len(envs)
		if t.Kind != codec.KindDeadLetter {
			iks = appendIndexKey(iks, t.Source, t.ID)
		}
		ikEnd[i] = len(iks)
	}
	envOf, ikOf := spans{envs, envEnd}, newKeySpans(iks, ikEnd)
	// Decide under the locks; ingestMu first, since nearly every batch
	// touches every shard and one mutex hands over faster than a convoy
	// through the shard locks (ascending order keeps those deadlock-free
	// against single-shard writers).
	e.ingestMu.Lock()
	e.lockShards(touched)
	now := e.nowMs()
	tk := newTicket()
	pbs := sc.pbs
	for sh, ok := range touched {
		if ok {
			pbs[sh] = &pendingBatch{tk: tk}
			e.shards[sh].enqueueLocked(pbs[sh])
		}
	}
	acts := sc.acts
	var stats ingestStats
	idx := indexReader{db: e.db}
	var maxSeq uint64
	// Seqs above base are allocated by this batch (only Ingest allocates,
	// under ingestMu).
	base := e.seq.Load()
	var derr error
	for i := range tasks {
		t := &tasks[i]
		sh := route[i]
		s, pb, a := e.shards[sh], pbs[sh], &acts[i]
		if t.Kind == codec.KindDeadLetter {
			a.seq, a.fire = e.seq.Add(1), now
			maxSeq = a.seq
			pb.delta++
			s.addOpLocked(pb, a.fire, a.seq)
			continue
		}
		ik := ikOf.at(i)
		var ex indexEntry
		found, err := s.lookupLocked(&idx, ik, &ex, tk)
		if err != nil {
			derr = fmt.Errorf("shard: ingest: %w", err)
			break
		}
		if found && ex.Cancel && ex.Expiry <= now {
			found = false // expired marker: forgotten
		}
		in := order{Stamp: t.Stamp, Partition: t.Partition, Incarnation: t.Incarnation, Offset: t.Offset}
		if found && !in.newerThan(ex.Order) {
			a.skip = true
			if t.Kind == codec.KindSchedule {
				why := "older"
				if ex.Cancel {
					why = "cancelled"
				}
				stats.dropped = append(stats.dropped, [2]string{t.Source, why})
			}
			continue
		}
		var oldInFlight bool
		if found && !ex.Cancel {
			by := replacedInFlight
			if t.Kind == codec.KindCancel {
				by = cancelledInFlight
			}
			a.delOld, a.oldFire, a.oldSeq = true, ex.Fire, ex.Seq
			if isHeld(ex.Fire) {
				pb.held[heldSlot(ex.Fire)]--
			}
			oldInFlight = s.supersedeLocked(ex.Seq, pb, by, t.Source)
			if ex.Seq > base {
				// Stored by this very batch and deleted by it again: not
				// a wheel entry once the batch is durable.
				for j := len(pb.ops) - 1; j >= 0; j-- {
					if pb.ops[j].seq == ex.Seq {
						pb.ops = slices.Delete(pb.ops, j, j+1)
						delete(s.unwheeled, ex.Seq)
						break
					}
				}
			}
			pb.delta--
		}
		if t.Kind == codec.KindSchedule {
			a.seq, a.fire = e.seq.Add(1), max(t.Due, 0)
			maxSeq = a.seq
			pb.delta++
			s.addOpLocked(pb, a.fire, a.seq)
			a.entry = indexEntry{Shard: sh, Fire: a.fire, Seq: a.seq, Order: in}
			if a.delOld && !oldInFlight {
				// One in flight is counted by its delivery, as a
				// cancelled one is: fired if the broker took it.
				stats.replaced = append(stats.replaced, t.Source)
			}
			if t.Due <= now {
				stats.overdue++
			}
		} else {
			a.entry = indexEntry{Cancel: true, Shard: sh, Order: in, Expiry: now + e.opts.CancelRetention.Milliseconds()}
			if a.delOld && !oldInFlight {
				stats.cancelled = append(stats.cancelled, t.Source)
			}
		}
		s.setOverlayLocked(ikOf.str(i), a.entry, false, pb)
	}
	idx.close()
	if derr != nil {
		for sh, pb := range pbs {
			if pb != nil {
				e.shards[sh].abandonLocked(pb)
			}
		}
		e.unlockShards(touched)
		e.ingestMu.Unlock()
		tk.release()
		return nil, derr
	}
	for _, cp := range cps {
		tk.dependOn(e.cpOwner[cp.Key])
		e.cpOwner[cp.Key] = tk
	}
	e.unlockShards(touched)
	e.ingestMu.Unlock()
	if e.testHookIngestDecided != nil {
		e.testHookIngestDecided()
	}

	// Build and apply outside the locks, after the batches this one
	// depends on (earlier undurable decisions it read, the last writer of
	// each of its checkpoint keys).
	b := e.db.NewBatchWithSize(len(envs) + len(iks) + len(tasks)*(2*taskKeyLen+indexEntryLen2+32) + 256)
	var key, val []byte
	// t keys first, shard by shard (in task order within a shard, so a
	// replace's delete still follows the set it deletes): consecutive
	// inserts then land near each other in the memtable's skiplist, whose
	// inserter reuses the previous splice. Index keys follow in task order.
	byShard := sc.byShard
	for i := range byShard {
		byShard[i] = i
	}
	slices.SortStableFunc(byShard, func(x, y int) int { return cmp.Compare(route[x], route[y]) })
	for _, i := range byShard {
		a, sh := &acts[i], route[i]
		if a.skip {
			continue
		}
		if a.delOld {
			key = appendTaskKey(key[:0], sh, a.oldFire, a.oldSeq)
			b.Delete(key, nil)
		}
		if a.seq != 0 {
			key = appendTaskKey(key[:0], sh, a.fire, a.seq)
			b.Set(key, envOf.at(i), nil)
		}
	}
	for i := range acts {
		a, t, sh := &acts[i], &tasks[i], route[i]
		if a.skip || t.Kind == codec.KindDeadLetter {
			continue
		}
		if a.entry.Cancel {
			key = appendExpiryKey(key[:0], sh, a.entry.Expiry, t.Source, t.ID)
			b.Set(key, nil, nil)
		}
		val = appendIndexEntry(val[:0], &a.entry)
		b.Set(ikOf.at(i), val, nil)
	}
	if maxSeq != 0 {
		b.Merge(seqKey, u64(maxSeq), nil)
	}
	for sh, pb := range pbs {
		if pb != nil && pb.delta != 0 {
			b.Merge(countKey(sh), u64(uint64(pb.delta)), nil)
		}
		if pb != nil {
			writeHeldCounts(b, sh, pb)
			writeWaitDels(b, sh, pb)
		}
	}
	for _, cp := range cps {
		b.Set(offsetKey(cp.Key), appendCheckpointValue(nil, cp), nil)
	}
	// The dead letters the source waits for, with the batch's checkpoint
	// keys: a restart holds the source of those keys for them again (see
	// AwaitStored). Not those of a batch without checkpoints: no source
	// resumes past them.
	var waitKeys []string
	if await {
		waitKeys = dlWaitKeys(cps)
	}
	if len(waitKeys) > 0 {
		for i := range tasks {
			if a := &acts[i]; tasks[i].Kind == codec.KindDeadLetter && a.seq != 0 {
				val = appendDLWait(val[:0], a.fire, waitKeys)
				b.Set(dlWaitKey(route[i], a.seq), val, nil)
			}
		}
	}
	start := time.Now()
	applied, err := e.applyInOrder(tk, b, "ingest")
	if applied {
		if err = b.SyncWait(); err != nil {
			err = e.fail("ingest", err)
		}
		e.commitIngest.Observe(time.Since(start).Seconds())
	}
	if err == nil {
		b.Close()
	}
	// Durable. Dead letters to await are registered before the wheels see
	// them, so no delivery can come before its waiter.
	var dls *DeadLetters
	if await && err == nil {
		dls = e.awaitDeadLetters(tasks, acts, waitKeys)
	}
	// The wheels may see the tasks.
	for sh, pb := range pbs {
		if pb == nil {
			continue
		}
		s := e.shards[sh]
		if err != nil {
			s.mu.Lock()
			s.abandonLocked(pb)
			s.mu.Unlock()
		} else {
			s.markDurable(pb)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("shard: ingest %d tasks: %w", len(tasks), err)
	}
	if len(tasks) > 0 {
		src, n := tasks[0].Source, 0
		for i := range tasks {
			if tasks[i].Source != src {
				e.m.Ingested.WithLabelValues(src).Add(float64(n))
				src, n = tasks[i].Source, 0
			}
			n++
		}
		e.m.Ingested.WithLabelValues(src).Add(float64(n))
	}
	stats.report(e.m)
	return dls, nil
}

// spans are consecutive pieces of one buffer: piece i ends at end[i] and
// starts where piece i-1 ends (it may be empty).
type spans struct {
	buf []byte
	end []int
}

func (sp spans) bounds(i int) (lo, hi int) {
	if i > 0 {
		lo = sp.end[i-1]
	}
	return lo, sp.end[i]
}

// at returns piece i, capped so that appending to it cannot overwrite
// piece i+1.
func (sp spans) at(i int) []byte {
	lo, hi := sp.bounds(i)
	return sp.buf[lo:hi:hi]
}

// keySpans are the index keys of a batch with one string copy of their
// buffer: the overlay keeps its keys as strings until the batch is
// durable, and substrings of one copy cost one allocation per batch
// instead of one per task.
type keySpans struct {
	spans
	s string
}

func newKeySpans(buf []byte, end []int) keySpans {
	return keySpans{spans{buf, end}, string(buf)}
}

// str returns key i as a substring of the batch's copy.
func (k keySpans) str(i int) string {
	lo, hi := k.bounds(i)
	return k.s[lo:hi]
}

// ingestScratch holds the buffers of one Ingest call. At thousands of
// batches a second with ~1 KB envelopes, allocating them for every batch
// kept the GC busy enough to cost about a tenth of the ingest rate.
// Nothing in them outlives the call: Pebble copies keys and values into
// its batch, the overlay keeps its own string keys, and the pending
// batches are only pointed to.
type ingestScratch struct {
	route, envEnd, ikEnd []int
	byShard              []int // task indexes in shard order
	touched              []bool
	pbs                  []*pendingBatch
	acts                 []ingestAction
	envs, iks            []byte
}

// maxPooledArena bounds the envelope arena kept for reuse, so one batch
// of large messages does not pin its arena.
const maxPooledArena = 4 << 20

var scratchPool = sync.Pool{New: func() any { return new(ingestScratch) }}

// getScratch returns scratch sized for n tasks over shards shards, zeroed.
func getScratch(n, shards int) *ingestScratch {
	sc := scratchPool.Get().(*ingestScratch)
	sc.route = zeroed(sc.route, n)
	sc.envEnd = zeroed(sc.envEnd, n)
	sc.ikEnd = zeroed(sc.ikEnd, n)
	sc.byShard = zeroed(sc.byShard, n)
	sc.touched = zeroed(sc.touched, shards)
	sc.pbs = zeroed(sc.pbs, shards)
	sc.acts = zeroed(sc.acts, n)
	return sc
}

// arenas returns the (empty) envelope and index-key arenas with at least
// the given capacities.
func (sc *ingestScratch) arenas(envCap, ikCap int) (envs, iks []byte) {
	if cap(sc.envs) < envCap {
		sc.envs = make([]byte, 0, envCap)
	}
	if cap(sc.iks) < ikCap {
		sc.iks = make([]byte, 0, ikCap)
	}
	return sc.envs[:0], sc.iks[:0]
}

func putScratch(sc *ingestScratch) {
	clear(sc.pbs) // do not keep pending batches alive (acts hold no pointers)
	if cap(sc.envs) > maxPooledArena {
		sc.envs = nil
	}
	scratchPool.Put(sc)
}

// zeroed returns s resized to n with every element zero, reusing its
// array when it is large enough.
func zeroed[T any](s []T, n int) []T {
	if cap(s) < n {
		return make([]T, n)
	}
	s = s[:n]
	clear(s)
	return s
}

// envelopeBound is at least the size codec.AppendTask writes for t.
func envelopeBound(t *codec.Task) int {
	n := 256 + len(t.ID) + len(t.Source) + len(t.Origin) + len(t.Target) + len(t.DLQ) + len(t.Code) + len(t.Detail) +
		len(t.Key) + len(t.Value)
	for _, h := range t.Headers {
		n += 20 + len(h.Key) + len(h.Value)
	}
	return n
}

// ingestAction is what Ingest decided for one task.
type ingestAction struct {
	skip    bool       // dropped: older than what is held
	seq     uint64     // new t key (schedule, dead letter); 0 for a cancel
	fire    int64      //
	delOld  bool       // delete the pending task it replaces or cancels
	oldFire int64      //
	oldSeq  uint64     //
	entry   indexEntry // new index entry (schedule or cancel marker)
}

type ingestStats struct {
	dropped   [][2]string
	replaced  []string
	cancelled []string
	overdue   int
}

func (s *ingestStats) report(m *metrics.Metrics) {
	for _, d := range s.dropped {
		m.Dropped.WithLabelValues(d[0], d[1]).Inc()
	}
	for _, src := range s.replaced {
		m.Replaced.WithLabelValues(src).Inc()
	}
	for _, src := range s.cancelled {
		m.Cancelled.WithLabelValues(src).Inc()
	}
	if s.overdue > 0 {
		m.Overdue.Add(float64(s.overdue))
	}
}

// Checkpoint returns the offset stored for key by Ingest (LoadCheckpoint
// returns its fingerprint too).
func (e *Engine) Checkpoint(key string) (offset int64, ok bool, err error) {
	cp, ok, err := e.LoadCheckpoint(key)
	return cp.Offset, ok, err
}

// Lookup reports the pending task (source, id); ErrNotFound if none.
func (e *Engine) Lookup(source, id string) (TaskInfo, error) {
	if err := checkSource(source); err != nil {
		return TaskInfo{}, err
	}
	e.closeMu.RLock()
	defer e.closeMu.RUnlock()
	if e.closed {
		return TaskInfo{}, ErrClosed
	}
	s := e.shards[e.shardOf(source, id)]
	var ex indexEntry
	var v []byte
	for attempt := 0; ; attempt++ {
		// tk collects the write the entry comes from when that is not
		// applied yet (a new task, a retry moving its key): the task key
		// is then missing for a moment, and Lookup waits for it rather
		// than report a pending task as not found.
		tk := newTicket()
		found, ok, val, err := s.lookupTask(appendIndexKey(nil, source, id), &ex, tk)
		if err != nil {
			return TaskInfo{}, err
		}
		if !found {
			return TaskInfo{}, ErrNotFound
		}
		if ok {
			v = val
			break
		}
		if len(tk.deps) == 0 || attempt == 2 {
			return TaskInfo{}, ErrNotFound
		}
		if e.testHookLookupWaits != nil {
			e.testHookLookupWaits()
		}
		if !tk.awaitDeps(time.Second) {
			return TaskInfo{}, ErrNotFound
		}
	}
	var t codec.Task
	if err := codec.DecodeTask(v, &t); err != nil {
		return TaskInfo{}, fmt.Errorf("shard: lookup %s/%s: %w", source, id, err)
	}
	return taskInfo(source, id, s.id, &ex, &t), nil
}

// lookupTask reads the index entry of key into ex and its task envelope
// (ok false: the task key is missing) as the shard's decisions see them;
// tk collects the write the entry comes from if it is not applied yet.
// Only the overlay is read under the shard's lock, and the iterator made
// there: the store is read after the lock is released, as it was when
// the iterator was made (the reads of a lookup under the lock held up
// the shard's fire loop and every Ingest for as long as a slow disk took
// to answer them; TestLookupStalledReadHoldsNoShard).
func (s *shard) lookupTask(key []byte, ex *indexEntry, tk *commitTicket) (found, ok bool, v []byte, err error) {
	s.mu.Lock()
	s.drainLocked()
	found, known := s.decidedLocked(key, ex, tk)
	if known && (!found || ex.Cancel) {
		s.mu.Unlock()
		return false, false, nil, nil
	}
	// One iterator over the index and the task keys: both are read from
	// one state of the store, in which every decision not in the overlay
	// is applied. Creating it reads nothing.
	it, err := s.e.db.NewIter(&pebble.IterOptions{
		LowerBound:   []byte{prefixIndex},
		UpperBound:   []byte{prefixTask + 1},
		UseL6Filters: true,
	})
	s.mu.Unlock()
	if err != nil {
		return false, false, nil, fmt.Errorf("shard: lookup: %w", err)
	}
	defer it.Close()
	if !known {
		r := indexReader{it: it}
		if found, err = r.get(key, ex); err != nil {
			return false, false, nil, fmt.Errorf("shard: lookup: %w", err)
		}
		if !found || ex.Cancel {
			return false, false, nil, nil
		}
	}
	tkey := appendTaskKey(nil, s.id, ex.Fire, ex.Seq)
	if !it.SeekPrefixGE(tkey) || !bytes.Equal(it.Key(), tkey) {
		if err := it.Error(); err != nil {
			return false, false, nil, fmt.Errorf("shard: lookup: read task: %w", err)
		}
		return true, false, nil, nil
	}
	val, err := it.ValueAndErr()
	if err != nil {
		return false, false, nil, fmt.Errorf("shard: lookup: read task: %w", err)
	}
	return true, true, slices.Clone(val), nil
}

// checkSource refuses a source that holds a NUL byte with ErrNotFound:
// the store keys a task by source, 0, id, so source "a\x00b" with id "c"
// would name source "a"'s task "b\x00c", and no source of a
// configuration holds one.
func checkSource(source string) error {
	if strings.IndexByte(source, 0) >= 0 {
		return fmt.Errorf("%w: source %q holds a NUL byte", ErrNotFound, source)
	}
	return nil
}

// Cancel removes the pending task (source, id) like a delay-cancel stamped
// with the current clock, so an older schedule arriving later is dropped.
// ErrNotFound if no task is pending.
func (e *Engine) Cancel(source, id string) error {
	if err := checkSource(source); err != nil {
		return err
	}
	e.closeMu.RLock()
	defer e.closeMu.RUnlock()
	if e.closed {
		return ErrClosed
	}
	if err := e.failed(); err != nil {
		return err
	}
	s := e.shards[e.shardOf(source, id)]
	ik := appendIndexKey(nil, source, id)
	// Read once without the lock: the lookup under it then finds the
	// entry's blocks in the cache, rather than holding the shard (its
	// fire loop, Err, every Ingest) for as long as the disk takes
	// (TestCancelStalledReadHoldsNoShard). Only a hint: the decision
	// reads it again.
	warm := indexReader{db: e.db}
	var ex indexEntry
	_, _ = warm.get(ik, &ex)
	warm.close()
	s.mu.Lock()
	s.drainLocked()
	idx := indexReader{db: e.db}
	tk := newTicket()
	found, err := s.lookupLocked(&idx, ik, &ex, tk)
	idx.close()
	if err != nil || !found || ex.Cancel {
		s.mu.Unlock()
		if err != nil {
			return fmt.Errorf("shard: cancel: %w", err)
		}
		return ErrNotFound
	}
	now := e.nowMs()
	// Partition -1 matches no source partition, so the stamp decides. The
	// marker is at least as new as the task it cancels, whose broker time
	// may be ahead of this clock (a producer's CreateTime, skew): that
	// message read again, or an older schedule of the id from another
	// partition, must not be scheduled again.
	marker := indexEntry{Cancel: true, Shard: s.id, Order: order{Stamp: max(now, ex.Order.Stamp), Partition: -1, Offset: -1},
		Expiry: now + e.opts.CancelRetention.Milliseconds()}
	pb := &pendingBatch{delta: -1, tk: tk}
	if isHeld(ex.Fire) {
		pb.held[heldSlot(ex.Fire)]--
	}
	s.enqueueLocked(pb)
	s.setOverlayLocked(string(ik), marker, false, pb)
	inFlight := s.supersedeLocked(ex.Seq, pb, cancelledInFlight, source)
	s.mu.Unlock()

	b := e.db.NewBatch()
	b.Delete(appendTaskKey(nil, s.id, ex.Fire, ex.Seq), nil)
	b.Set(ik, appendIndexEntry(nil, &marker), nil)
	b.Set(appendExpiryKey(nil, s.id, marker.Expiry, source, id), nil, nil)
	b.Merge(countKey(s.id), u64(math.MaxUint64), nil) // -1
	writeHeldCounts(b, s.id, pb)
	writeWaitDels(b, s.id, pb)
	if err := s.commitDecided(tk, pb, b, "cancel", e.commitCancel); err != nil {
		return fmt.Errorf("shard: cancel %s/%s: %w", source, id, err)
	}
	if !inFlight {
		e.m.Cancelled.WithLabelValues(source).Inc()
	}
	return nil
}

// Stats describes the engine.
func (e *Engine) Stats() Stats {
	e.closeMu.RLock()
	defer e.closeMu.RUnlock()
	var st Stats
	if e.closed {
		return st
	}
	now := e.nowMs()
	horizon := int64(math.MaxInt64)
	for _, s := range e.shards {
		s.mu.Lock()
		s.drainLocked()
		ss := ShardStats{Shard: s.id, Pending: s.pending, InWheel: s.w.Len()}
		// The wheel's Next is exact only for its finest level; coarser
		// ones give a bucket start. The store holds every pending task by
		// fire time, and none between that bound and the wheel's earliest
		// entry (tasks in flight fired before it), so the first key from
		// there is exact. Without wheel entries the store's first task is
		// past the horizon. The iterator is made under the lock, so it
		// reads the store as it is now, and used after it: finding the
		// first key may step over many deletions (a herd of equal dues
		// being fired leaves one a task, about 6 ms for 100 k), which
		// must not hold up the shard's ingest and fire loop.
		from, inWheel := s.w.Next()
		if !inWheel {
			from = s.horizonEnd
		}
		var (
			stored *pebble.Iterator
			nerr   error // reading the first stored task
			held   *pebble.Iterator
			herr   error // reading the held tasks
		)
		if inWheel || s.pending > 0 {
			stored, nerr = s.storedIterLocked(from)
		}
		// The number of this read, made now: only a later one replaces
		// the values it keeps (statsRead).
		s.statsSeq++
		seq := s.statsSeq
		// Claimed but not delivered yet: a batch being published, and
		// due tasks set aside while their lane is stuck.
		claimedDue, parkedFire, parked := s.lanesDueLocked()
		late, isLate := s.oldestLateLocked()
		// Set aside while firing is paused: due, waiting.
		pausedMin, hasPaused := s.pausedMin, len(s.paused) > 0
		if hasPaused && (!isLate || pausedMin < late) {
			late, isLate = pausedMin, true
		}
		for l := range s.lanes {
			ss.Held += s.lanes[l].hold.n
		}
		if ss.Held > 0 {
			held, herr = s.heldIterLocked()
		}
		if claimedDue <= now && (!isLate || claimedDue < late) {
			late, isLate = claimedDue, true
		}
		horizon = min(horizon, s.horizonEnd)
		s.mu.Unlock()
		next, ok, ferr := firstFire(stored)
		if ferr != nil {
			nerr = fmt.Errorf("shard %d: %w", s.id, ferr)
		}
		var (
			heldDue int64
			hasHeld bool
		)
		if held != nil {
			heldDue, hasHeld, herr = s.heldOldestDue(held)
		}
		if h := e.testHookStatsRead; h != nil {
			h()
		}
		// A read that fails (a disk's I/O error) gives the last values
		// read without error, not none or those of the part read, and is
		// logged once per engine (storeLines).
		s.mu.Lock()
		next, ok = s.statsNext.use(next, ok, nerr, seq)
		if nerr != nil && inWheel && (!ok || next < from) {
			// The wheel's earliest entry is at or after from, and the
			// store holds no task between the two: the last one read
			// has fired since.
			next, ok = from, true
		}
		heldDue, hasHeld = s.statsHeld.use(heldDue, hasHeld, herr, seq)
		s.mu.Unlock()
		if err := errors.Join(nerr, herr); err != nil {
			e.storeLines.failed(e.clk.Now(), zap.WarnLevel, msgStatsReadFailed, s.id, err)
		} else {
			e.storeLines.ok(e.clk.Now(), msgStatsReadFailed, s.id)
		}
		if parked && (!ok || parkedFire < next) {
			next, ok = parkedFire, true
		}
		if hasPaused && (!ok || pausedMin < next) {
			next, ok = pausedMin, true
		}
		if hasHeld && heldDue <= now && (!isLate || heldDue < late) {
			late, isLate = heldDue, true
		}
		if ok {
			ss.NextDue = msTime(next)
			if next <= now {
				ss.OldestOverdue = ss.NextDue
			}
		}
		if isLate && (ss.OldestOverdue.IsZero() || late < ss.OldestOverdue.UnixMilli()) {
			// Waiting for a retry: overdue since its due time.
			ss.OldestOverdue = msTime(late)
		}
		st.Pending += ss.Pending
		st.Held += ss.Held
		if !ss.NextDue.IsZero() && (st.NextDue.IsZero() || ss.NextDue.Before(st.NextDue.Time)) {
			st.NextDue = ss.NextDue
		}
		if !ss.OldestOverdue.IsZero() && (st.OldestOverdue.IsZero() || ss.OldestOverdue.Before(st.OldestOverdue.Time)) {
			st.OldestOverdue = ss.OldestOverdue
		}
		st.Shards = append(st.Shards, ss)
	}
	if horizon != math.MaxInt64 {
		st.Horizon = msTime(horizon)
	}
	return st
}

// firstStoredLocked returns the fire time of the first stored task at or
// after from.
func (s *shard) firstStoredLocked(from int64) (int64, bool, error) {
	it, err := s.storedIterLocked(from)
	if err != nil {
		return 0, false, err
	}
	fire, ok, err := firstFire(it)
	if err != nil {
		return 0, false, fmt.Errorf("shard %d: %w", s.id, err)
	}
	return fire, ok, nil
}

// storedIterLocked returns an iterator over the shard's stored tasks with
// a fire time from from (held tasks, hold.go, have none). It reads the
// store as it was when made.
func (s *shard) storedIterLocked(from int64) (*pebble.Iterator, error) {
	it, err := s.e.db.NewIter(&pebble.IterOptions{LowerBound: taskBound(s.id, from), UpperBound: taskBound(s.id, heldBase)})
	if err != nil {
		return nil, fmt.Errorf("shard %d: read the first task: %w", s.id, err)
	}
	return it, nil
}

// firstFire returns the fire time of it's first task and closes it; ok
// false for none, or a nil it. A read that fails returns its error, not
// none.
func firstFire(it *pebble.Iterator) (fire int64, ok bool, err error) {
	if it == nil {
		return 0, false, nil
	}
	if it.First() {
		_, fire, _, ok = parseTaskKey(it.Key())
	}
	if err := errors.Join(it.Error(), it.Close()); err != nil {
		return 0, false, fmt.Errorf("read the first task: %w", err)
	}
	return fire, ok, nil
}

// statsRead is a time Stats read from the store without error (ok false:
// none), kept for a read that fails, with the number of its read (seq,
// shard.statsSeq).
type statsRead struct {
	at  int64
	ok  bool
	seq uint64
}

// use returns at and ok as read by read number seq when err is nil, and
// keeps them unless a later read's are kept already: two Stats calls
// racing kept theirs in the order they finished, so the slower one's
// older values replaced the newer ones (TestStatsLastGoodMonotonic).
// With err, it returns the last ones read without error (none if no read
// succeeded yet).
func (r *statsRead) use(at int64, ok bool, err error, seq uint64) (int64, bool) {
	if err == nil {
		if seq > r.seq {
			*r = statsRead{at, ok, seq}
		}
		return at, ok
	}
	return r.at, r.ok
}

// Err is nil when the engine is healthy. It reports the sticky store error,
// a write stall of the store that lasted 5 s (ErrStoreStalled: Pebble holds
// every write while its flushes fail, a full disk, and Ingest waits), a
// volume with less than Options.ReserveBytes free (ErrStoreLowSpace:
// Ingest refuses batches until there is room again), or dead letters whose delivery fails: held ones (their DLQ failing, their
// source waiting) until each is delivered, and parked ones (refused by
// their DLQ as the message they are, see deadLetterParked) until each is
// delivered or leaves the store. Both survive a restart (see
// loadDLFailuresLocked). It also reports the entries the fire loops found
// undecodable (see StuckEntries) until they leave the store: they can
// never be delivered, and an awaited dead letter among them holds its
// source. That set is found again after a restart as the entries come due.
func (e *Engine) Err() error {
	if err := e.failed(); err != nil {
		return err
	}
	e.reserve.refresh()
	return errors.Join(e.health.err(), e.reserve.err(), e.deadLetterErr(), e.undecodableErr(), e.outageErr())
}

// Close flushes and closes the store. Call it after Run returned. Every
// acknowledged write is already synced; the flush only shortens the next
// open (no WAL to replay).
func (e *Engine) Close() error { return e.close(true) }

// CloseNoFlush closes the store without that flush: for a shutdown out of
// time. The next open replays the WAL instead; nothing is lost.
func (e *Engine) CloseNoFlush() error { return e.close(false) }

func (e *Engine) close(flush bool) error {
	e.closeMu.Lock()
	defer e.closeMu.Unlock()
	if e.running.Load() {
		return fmt.Errorf("shard: close: %w", ErrRunning)
	}
	if e.closed {
		return nil
	}
	e.closed = true
	e.unsetDisk()
	e.bgCancel()
	<-e.bgDone
	// The gauges of state this engine holds in memory leave with it (a
	// store reopened in the same process counts its own again).
	for _, sh := range e.shards {
		sh.mu.Lock()
		e.m.Undecodable.Sub(float64(len(sh.undecodable)))
		e.m.DeadLettersParkedNow.Sub(float64(sh.dlParked))
		e.m.DeadLettersFailing.Sub(float64(sh.dlHeld))
		sh.mu.Unlock()
	}
	e.clearPauseGauges()
	var errs []error
	if flush && e.failed() == nil {
		// Pebble treats a store directory gone from under it as fatal
		// (Fatalf with its own lock released, which no recover can
		// survive), and a flush rotates the WAL in it. The flush only
		// shortens the next open, so without the directory Close skips it
		// and says so; Pebble's Close writes nothing there.
		if err := e.storeDirReadable(); err != nil {
			errs = append(errs, fmt.Errorf("shard: close: flush skipped: %w", err))
		} else if err := safeCall(e.db.Flush); err != nil {
			errs = append(errs, fmt.Errorf("shard: close: flush: %w", err))
		}
	}
	if err := safeCall(e.db.Close); err != nil {
		if ferr := e.failed(); ferr != nil {
			// Expected: Pebble reports the WAL error again.
			err = errors.Join(ferr, err)
		}
		errs = append(errs, fmt.Errorf("shard: close: %w", err))
	}
	return errors.Join(errs...)
}

// churnRebuild is how many deletions a shard's overlay and unwheeled maps
// take before they are rebuilt (with the in-flight map).
const churnRebuild = 1 << 14

// rebuilt copies m into a new map sized for its live entries. A Go map that
// only ever sees short-lived keys accumulates deleted slots in its groups,
// and its lookups probe further: in
// BenchmarkStoreIngest's profile, map probing fell from 6% of the CPU to 2%
// once the shard maps were rebuilt every churnRebuild deletions.
func rebuilt[K comparable, V any](m map[K]V) map[K]V {
	n := make(map[K]V, len(m))
	for k, v := range m {
		n[k] = v
	}
	return n
}

// storeDirReadable reports whether the store's directory is still
// there: a flush rotates the WAL in it, and Pebble treats one removed
// from under it as fatal (Fatalf with its own lock released, which no
// recover survives), so Close and the reclaim flush check it first.
func (e *Engine) storeDirReadable() error {
	fsys := e.opts.FS
	if fsys == nil {
		fsys = vfs.Default
	}
	_, err := fsys.Stat(e.opts.Dir)
	return err
}
