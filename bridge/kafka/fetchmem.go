package kafka

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sync"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/delaybridge/delaybridge/bridge"
)

// Fetch memory. Each partition worker holds what it fetched until the
// store took it: the fetch being filled, a batch queued, a batch being
// stored, about three fetches of about Config.FetchMaxBytes decoded while
// it catches up. Over hundreds of partitions that has no bound (hunt H193:
// 420-590 MB of Go heap over 256 partitions), so the source's partitions
// share one budget, Config.FetchMemory: a worker reserves what it expects
// its next fetch to decode to before it sends it, the reservation becomes
// the fetch's actual size once it is decoded (more or less than reserved:
// the broker returns a fetch's first batch whole whatever its limit, and
// that batch must come through), and each batch gives its share back once
// it is stored. Waiting workers are served in order (FIFO): none starves.
// A reservation is at most the whole budget, and one is granted whenever
// nothing is held, so one partition always progresses, however small the
// budget.
//
// A worker whose batch is refused for its own source's sake (a dead-letter
// topic that cannot be written; CONTRACT §3: the batch is held and
// retried) would keep its shares for as long, and enough such workers
// would stop every other partition, other sources' too (review R195).
// Its holdings, at most about three fetches (it fetches one batch ahead
// of its handler), are moved out of the budget ("stuck") while it
// retries, however many such workers there are: a cap on them (one more
// budget, tried first) let a DLQ outage over a dozen busy partitions stop
// every other source's. A worker whose batch the store refuses keeps
// them counted instead: the store refuses every partition's, so none
// would go on with the room, and memory stays within the budget however
// long the store outage lasts.

// itemMemory is what a fetched record costs besides its key, value and
// headers (decodedBytes): its bridge.Item.
const itemMemory = int64(unsafe.Sizeof(bridge.Item{}))

// itemsMemory is what items hold in memory, as the budget counts it.
func itemsMemory(items []bridge.Item) int64 {
	return int64(decodedBytes(items)) + int64(len(items))*itemMemory
}

// idleFetchMemory is what a caught-up partition waits for when its last
// fetch held less and the budget is half used or more (else it takes a
// full fetch): a long poll on an idle partition holds its reservation for
// up to MaxWait, and a full fetch's worth each would keep busy partitions
// waiting behind idle ones (review R195). The fetch's limit shrinks to
// match; a burst that fills it is fetched at full size next.
const idleFetchMemory = 16 << 10

// fetchMem is the budget of fetched-but-not-yet-stored bytes of a Source.
type fetchMem struct {
	limit int64

	mu    sync.Mutex
	held  int64 // counted against limit: reservations and fetched records
	stuck int64 // held by workers whose batch is being retried, not counted
	// polling: long polls of caught-up partitions beyond the half of the
	// budget they may take (idleFetchMemory each): not counted, so that
	// they never hold busy partitions back (see poll).
	polling int64
	peak    int64 // the highest held seen (tests)
	peakAll int64 // the highest held+stuck seen (tests)
	waiters []*memWaiter

	heldG, stuckG prometheus.Gauge
	waits         prometheus.Counter
}

type memWaiter struct {
	n     int64
	ready chan struct{} // closed once granted
}

// newFetchMem returns a budget of limit bytes (at least 1). The gauges and
// counter may be nil.
func newFetchMem(limit int64, held, stuck prometheus.Gauge, waits prometheus.Counter) *fetchMem {
	return &fetchMem{limit: max(limit, 1), heldG: held, stuckG: stuck, waits: waits}
}

// clamp is n as a reservation: at least 1, at most the whole budget.
func (m *fetchMem) clamp(n int64) int64 { return min(max(n, 1), m.limit) }

// reserve takes n bytes (clamped to [1, limit]) once they fit, after every
// reservation that waited before it. It returns what it took, or an error
// when ctx ended first (then it holds nothing).
func (m *fetchMem) reserve(ctx context.Context, n int64) (int64, error) {
	n = m.clamp(n)
	m.mu.Lock()
	if len(m.waiters) == 0 && m.fitsLocked(n) {
		m.addLocked(n)
		m.mu.Unlock()
		return n, nil
	}
	w := &memWaiter{n: n, ready: make(chan struct{})}
	m.waiters = append(m.waiters, w)
	if m.waits != nil {
		m.waits.Inc()
	}
	m.mu.Unlock()
	select {
	case <-w.ready:
		return n, nil
	case <-ctx.Done():
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if i := slices.Index(m.waiters, w); i >= 0 {
		m.waiters = slices.Delete(m.waiters, i, i+1)
		m.grantLocked() // those behind it may fit now
	} else {
		// Granted while ctx ended: give it back.
		m.addLocked(-n)
		m.grantLocked()
	}
	return 0, fmt.Errorf("kafka: waiting for %d bytes of fetch memory: %w", n, ctx.Err())
}

// tryReserve takes n bytes (clamped) only if nobody waits and they fit
// now; 0 when not.
func (m *fetchMem) tryReserve(n int64) int64 { return m.tryReserveWithin(n, m.limit) }

// tryReserveWithin is tryReserve with the bytes held kept within ceiling
// (at most the limit).
func (m *fetchMem) tryReserveWithin(n, ceiling int64) int64 {
	n = m.clamp(n)
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.waiters) > 0 || !m.fitsLocked(n) || m.held+n > min(ceiling, m.limit) {
		return 0
	}
	m.addLocked(n)
	return n
}

// settle turns a reservation of reserved bytes into used: it gives back
// what the fetch did not use, or takes what it used beyond (a first batch
// larger than the fetch's limit comes through whatever the budget).
func (m *fetchMem) settle(reserved, used int64) {
	if reserved == used {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.addLocked(used - reserved)
	if used < reserved {
		m.grantLocked()
	}
}

// release gives back n counted bytes.
func (m *fetchMem) release(n int64) {
	if n == 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.addLocked(-n)
	m.grantLocked()
}

// fitsLocked: n more fit in the budget, or nothing is held (one
// reservation always proceeds).
func (m *fetchMem) fitsLocked(n int64) bool { return m.held+n <= m.limit || m.held <= 0 }

func (m *fetchMem) addLocked(n int64) {
	m.held += n
	m.peak = max(m.peak, m.held)
	m.setHeldLocked()
}

// setHeldLocked sets the counted gauge, which shows the long polls beyond
// the budget too (fetches in flight), and the peak of everything held.
func (m *fetchMem) setHeldLocked() {
	m.peakAll = max(m.peakAll, m.held+m.stuck+m.polling)
	if m.heldG != nil {
		m.heldG.Set(float64(m.held + m.polling))
	}
}

// poll takes n bytes (at most idleFetchMemory) for the long poll of a
// caught-up partition that found no room within half the budget
// (fetchLoop), outside the budget: such polls wait up to MaxWait for
// records that mostly do not come, and counted, enough of them held the
// whole budget for as long, and a busy partition got one fetch per
// MaxWait (review R220: 128 idle partitions on a 1 MiB budget made a
// backlog of 3 000 records take 12 s, against 20 ms). They hold
// idleFetchMemory each at most, as the design meant (half the budget plus
// 16 KiB a partition). settlePoll counts what the poll fetched.
func (m *fetchMem) poll(n int64) int64 {
	n = min(max(n, 1), idleFetchMemory)
	m.mu.Lock()
	defer m.mu.Unlock()
	m.polling += n
	m.setHeldLocked()
	return n
}

// settlePoll ends a poll of polled bytes that fetched used: those are
// counted from now on, like a fetch's first batch past its reservation.
func (m *fetchMem) settlePoll(polled, used int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.polling -= polled
	m.addLocked(used)
}

// toStuckLocked moves n counted bytes out of the budget to stuck (n < 0:
// back), granting the waiters the room it frees.
func (m *fetchMem) toStuckLocked(n int64) {
	// The side that shrinks first: peakAll never counts n twice.
	if n > 0 {
		m.addLocked(-n)
		m.addStuckLocked(n)
		m.grantLocked()
		return
	}
	m.addStuckLocked(n)
	m.addLocked(-n)
}

func (m *fetchMem) addStuckLocked(n int64) {
	m.stuck += n
	m.peakAll = max(m.peakAll, m.held+m.stuck+m.polling)
	if m.stuckG != nil {
		m.stuckG.Set(float64(m.stuck))
	}
}

// grantLocked grants the waiters at the head of the queue that fit, in
// order.
func (m *fetchMem) grantLocked() {
	for len(m.waiters) > 0 && m.fitsLocked(m.waiters[0].n) {
		w := m.waiters[0]
		m.waiters = m.waiters[1:]
		m.addLocked(w.n)
		close(w.ready)
	}
}

// state returns the bytes held (long polls outside the budget too), held
// by stuck workers, and the peak held.
func (m *fetchMem) state() (held, stuck, peak int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.held + m.polling, m.stuck, m.peak
}

// partMem is one partition worker's share of the budget: what its fetches
// took and its handler has not stored yet, counted or (while its batch is
// retried) stuck.
type partMem struct {
	m              *fetchMem
	mu             sync.Mutex
	counted, stuck int64
	// stalled: its batch waits (stall(false)) until unstall; what it
	// fetches meanwhile (the fetch loop runs one batch ahead) is stuck
	// too, or its read-ahead would hold the budget while it waits.
	stalled bool
}

// fetched records n bytes a fetch decoded, reserved (and settled) already.
func (p *partMem) fetched(n int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.stalled {
		p.counted += n
		return
	}
	p.stuck += n
	p.m.mu.Lock()
	defer p.m.mu.Unlock()
	p.m.toStuckLocked(n)
}

// stored gives back the n bytes of a batch the store took.
func (p *partMem) stored(n int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	fromStuck := min(n, p.stuck)
	p.stuck -= fromStuck
	n -= fromStuck
	n = min(n, p.counted) // never more than was taken
	p.counted -= n
	p.m.mu.Lock()
	defer p.m.mu.Unlock()
	p.m.addStuckLocked(-fromStuck)
	if n > 0 {
		p.m.addLocked(-n)
		p.m.grantLocked()
	}
}

// stall moves the worker's counted bytes out of the budget while its batch
// is retried (see fetchMem). storeWide: the store refused it, as it does
// every partition's; the bytes stay counted.
func (p *partMem) stall(storeWide bool) {
	if storeWide {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.stalled = true
	p.m.mu.Lock()
	defer p.m.mu.Unlock()
	n := p.counted
	if n <= 0 {
		return
	}
	p.counted -= n
	p.stuck += n
	p.m.toStuckLocked(n)
}

// unstall counts the worker's bytes again: its batch was stored.
func (p *partMem) unstall() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.stalled = false
	if p.stuck == 0 {
		return
	}
	p.m.mu.Lock()
	defer p.m.mu.Unlock()
	p.m.toStuckLocked(-p.stuck)
	p.counted += p.stuck
	p.stuck = 0
}

// releaseAll gives back everything the worker holds: it stopped, and what
// it fetched and did not store is dropped.
func (p *partMem) releaseAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.m.mu.Lock()
	defer p.m.mu.Unlock()
	p.m.addStuckLocked(-p.stuck)
	p.m.addLocked(-p.counted)
	p.counted, p.stuck = 0, 0
	p.m.grantLocked()
}

// memSizer predicts the memory of a partition's next fetch. The fetch
// sizer aims each fetch at Config.FetchMaxBytes decoded (keys, values,
// headers); what that holds in memory depends on the records' sizes (a
// bridge.Item each), which memSizer learns from the partition's fetches.
type memSizer struct {
	target     int64   // decoded bytes a fetch aims at (Config.FetchMaxBytes)
	perDecoded float64 // memory per decoded byte; 0 until learned
	last       int64   // the memory of the last fetch
	caughtUp   bool    // the last fetch reached the end of the log
}

func newMemSizer(target int) memSizer { return memSizer{target: int64(max(target, 1))} }

// full is the memory of a fetch at the fetch sizer's limit.
func (e *memSizer) full() int64 {
	f := e.perDecoded
	if f <= 0 {
		f = 1
	}
	return int64(math.Ceil(float64(e.target) * f))
}

// want is what to reserve for the next fetch.
func (e *memSizer) want() int64 {
	w := e.full()
	if e.caughtUp {
		w = min(w, max(idleFetchMemory, 2*e.last))
	}
	return max(w, 1)
}

// limitFor is the byte limit of a fetch granted grant bytes when the fetch
// sizer asks for limit: limit shrunk in proportion when grant is less than
// a full fetch, never under minFetchBytes (the broker returns the first
// batch whole anyway). A run of steps past a compacted tail (stepping)
// keeps its limit: only a larger one gets the next batch.
func (e *memSizer) limitFor(grant int64, limit int, stepping bool) int {
	full := e.full()
	if stepping || grant >= full {
		return limit
	}
	return max(int(int64(limit)*grant/full), min(minFetchBytes, limit))
}

// observe learns from a fetch that decoded decoded bytes into mem bytes of
// memory.
func (e *memSizer) observe(mem int64, decoded int, caughtUp bool) {
	e.last, e.caughtUp = mem, caughtUp
	if decoded > 0 && mem > 0 {
		e.perDecoded = float64(mem) / float64(decoded)
	}
}
