// Package wheel is a hierarchical timing wheel that holds the tasks a shard
// will fire soon, keyed by due time in Unix milliseconds.
//
// The wheel is pure: it starts no goroutines, takes no locks and never reads
// the clock. Its owner passes the time in (Advance, AdvanceN) and decides when
// to call again (Next). A Wheel is not safe for concurrent use.
//
// # Placement
//
// Times are mapped to unsigned 64-bit keys (sign bit flipped, so key order is
// time order over the whole int64 range). The wheel has 11 levels of 64 slots;
// level L holds bits [6L, 6L+6) of the key, so a level-0 slot is 1 ms, level 1
// is 64 ms, level 2 about 4 s, level 3 about 4.4 min, level 4 about 4.7 h,
// level 5 about 12.4 days, level 6 about 2.2 years, and levels 7..10 cover the
// rest of the int64 range. Because the levels span every bit of the key there
// is no overflow list: a due 500 days ahead, or math.MaxInt64, is placed like
// any other, never clamped.
//
// An entry with due key d is placed, relative to the wheel's current key c, at
// the level of the highest bit in which d and c differ, in the slot given by
// d's digit at that level (the Linux and Kafka placement). Two invariants
// follow and everything else rests on them:
//
//   - every entry in level L shares all digits above L with c and has a digit
//     at L greater than c's, so the lowest occupied slot of the lowest
//     occupied level is always the next bucket in time, found with two
//     TrailingZeros calls on occupancy bitmaps: no idle ticking, and a jump of
//     days costs O(non-empty buckets + levels), not O(elapsed ms);
//   - an entry's level is always the level of the highest differing bit of its
//     due and c, because c can only enter an entry's slot by stopping at that
//     slot's start and cascading it. So entries with the same due are always
//     in the same bucket, and buckets are FIFO: equal-due entries keep their
//     Add order even when some were cascaded from a coarser level and others
//     were added later straight into a finer one.
//
// Entries due exactly at c wait in the "now" queue (a level-0 bucket becomes
// that queue when c reaches it, in O(1)); entries due before c, which only
// Add with a due in the past produces, wait in the late list, ordered by
// (due, Add order). It has two parts, merged when read: a sorted run that
// takes the Adds in order (a loader scanning by key, each one an append and
// each read a step along the slice), and a 4-ary min-heap that takes the
// others, so a due in the past added out of order costs O(log n), not a copy
// of the rest of the list. Each late item carries a 32-bit Add counter that
// keeps equal dues FIFO across the two parts; the counter restarts whenever
// the late list is empty and, should it ever run out while the list never
// empties, the pending items are renumbered in order.
//
// # Memory
//
// Each entry costs 28 bytes and no pointers, so the GC never scans them: a
// 16-byte slab record (seq, generation, state) addressed by an int32 index,
// and a 12-byte (due, index) item in its bucket. Buckets are FIFO queues of
// items in 64-item chunks drawn from one shared, recycled pool. Keeping the
// due in the queue rather than in a linked list threaded through the slab
// matters for speed: cascading a bucket streams through its chunks and never
// touches the slab, and firing one loads the slab records whose indexes are
// all known up front, so the CPU overlaps those cache misses instead of
// chasing one pointer at a time. The slab and the chunk pool keep their peak
// size; freed records and chunks are reused, not returned to the GC.
//
// Remove is O(1) amortised and lazy: it marks the record dead and makes its
// handle stale at once; the record is recycled when its item is next
// dequeued, or by a sweep cycle that starts once removed entries outnumber
// live ones and compacts one bucket per Remove, so a cancel-heavy wheel stays
// within about twice its live size without any call scanning the whole
// wheel.
package wheel

import (
	"math"
	"math/bits"
	"slices"
)

const (
	slotBits   = 6
	numSlots   = 1 << slotBits // 64: one uint64 occupancy word per level
	slotMask   = numSlots - 1
	numLevels  = (64 + slotBits - 1) / slotBits // 11: levels cover all 64 key bits
	numBuckets = numLevels * numSlots

	// chunkSize items per chunk (776 bytes): small enough that the few
	// hundred part-filled tails of a sparse wheel cost little, large enough
	// that following chunk links is rare.
	chunkSize = 64

	// Entry states, kept in entry.link. Values >= noLink are free entries,
	// where link is the next free index.
	linkLive = -2
	linkDead = -3
	noLink   = -1

	// compactMin keeps small wheels from sweeping for a handful of Removes.
	compactMin = 1024

	// lateKeep is the late-list capacity kept once the list is drained.
	lateKeep = 4096

	// maxSlab keeps every slab index a positive int32.
	maxSlab = math.MaxInt32
)

// Handle identifies an entry returned by Add. It stays valid until the entry
// is yielded or removed; after that Remove reports false, even once the slab
// slot has been reused, because the handle carries the slot's generation.
// The zero Handle is never valid.
type Handle uint64

// entry is one task's identity: what to yield and how to recognise its
// handle. The due time is not here but in the queue item that points at the
// entry, so cascading a bucket never touches the slab. No pointers: the slab
// is a single noscan allocation however many millions of entries it holds.
type entry struct {
	seq  uint64
	gen  uint32
	link int32 // linkLive, linkDead, or the next free index
}

// chunk is a piece of a FIFO queue of (due, slab index) items, stored as two
// arrays so an item takes 12 bytes rather than a padded 16.
type chunk struct {
	due  [chunkSize]int64
	idx  [chunkSize]int32
	next int32
}

// item is a queued entry outside chunks (the late list). ord is its Add
// order among late items, so equal dues stay FIFO across the sorted run and
// the heap; with idx it packs into the 8 bytes after due (16 per item).
type item struct {
	due int64
	ord uint32
	idx int32
}

// before reports whether a fires before b: earlier due, or the same due and
// added earlier.
func (a item) before(b item) bool {
	return a.due < b.due || a.due == b.due && a.ord < b.ord
}

// queue is a FIFO of items: a linked list of chunks, read from
// (head, off) and appended at (tail, fill). head == noLink means empty.
type queue struct {
	head, tail int32
	off, fill  int32
}

var emptyQueue = queue{head: noLink, tail: noLink}

// Wheel is a hierarchical timing wheel. See the package documentation.
type Wheel struct {
	slab      []entry
	freeEnt   int32
	chunks    []chunk
	freeChunk int32

	buckets [numBuckets]queue
	occ     [numLevels]uint64 // bit s of occ[L]: bucket (L, s) is non-empty
	levels  uint16            // bit L: occ[L] != 0

	cur      uint64 // key of the time up to which buckets have been taken
	nowQ     queue  // entries due exactly at cur, FIFO
	late     []item // entries due before cur added in order, sorted by (due, ord)
	lateAt   int    // read position in late
	lateHeap []item // entries due before cur added out of order: min-heap by (due, ord)
	lateOrd  uint32 // ord of the next late item
	ordLimit uint32 // renumber the late items when lateOrd reaches it; a field so tests can force it

	count     int
	dead      int   // removed entries whose items are still queued
	sweepMin  int   // compactMin; a field so tests can force sweeps
	sweepAt   int   // next bucket of the sweep cycle; -1: no cycle running
	now       int64 // highest time passed to New/Advance, for Now
	advancing bool
	sink      int32 // keeps touch's loads from being optimised away
	expired   int   // buckets taken by expire, for tests
	renumbers int   // renumberLate calls, for tests
}

// key maps a time to an unsigned key with the same order.
func key(t int64) uint64 { return uint64(t) ^ (1 << 63) }

// unkey is the inverse of key.
func unkey(k uint64) int64 { return int64(k ^ (1 << 63)) }

// New returns an empty wheel whose current time is now (Unix milliseconds).
func New(now int64) *Wheel {
	w := &Wheel{
		freeEnt:   noLink,
		freeChunk: noLink,
		cur:       key(now),
		nowQ:      emptyQueue,
		now:       now,
		sweepMin:  compactMin,
		sweepAt:   -1,
		ordLimit:  math.MaxUint32,
	}
	for i := range w.buckets {
		w.buckets[i] = emptyQueue
	}
	return w
}

// Grow makes room for n more entries without further allocation, so a loader
// that knows how many tasks it is about to add pays for one growth instead of
// several, and a benchmark can measure the steady state.
func (w *Wheel) Grow(n int) {
	if n <= 0 {
		return
	}
	n = min(n, maxSlab-len(w.slab))
	w.slab = slices.Grow(w.slab, n)
	// Every entry's index sits in one chunk, plus one part-filled chunk per
	// queue at most.
	w.chunks = slices.Grow(w.chunks, n/chunkSize+numBuckets+2)
}

// Len returns the number of pending entries (removed ones are not counted).
func (w *Wheel) Len() int { return w.count }

// Now returns the latest time passed to New, Advance or AdvanceN. A clock
// step back does not lower it.
func (w *Wheel) Now() int64 { return w.now }

// Add schedules seq at due and returns a handle for Remove. A due at or before
// the wheel's current time is yielded by the next Advance whose now reaches
// it. Any int64 due is accepted; there is no horizon limit.
func (w *Wheel) Add(due int64, seq uint64) Handle {
	i := w.allocEntry()
	e := &w.slab[i]
	e.seq = seq
	e.link = linkLive
	w.count++
	w.place(due, i)
	return Handle(uint64(e.gen)<<32 | uint64(uint32(i)))
}

// Remove cancels the entry behind h in O(1) amortised (see the package
// documentation on sweeping). It returns false if h is zero, forged, or
// stale (the entry was already yielded or removed).
func (w *Wheel) Remove(h Handle) bool {
	i := uint64(h) & math.MaxUint32
	if i >= uint64(len(w.slab)) {
		return false
	}
	e := &w.slab[i]
	if e.link != linkLive || e.gen != uint32(h>>32) {
		return false
	}
	// The item stays queued; whoever dequeues it recycles the slot. Once
	// removed entries outnumber live ones a sweep cycle starts, one bucket
	// per Remove, so a cancel-heavy wheel stays within about twice its live
	// size, the cost is O(1) amortised, and no single call scans the whole
	// wheel (the longest pause is one bucket's items).
	e.link = linkDead
	e.gen = nextGen(e.gen)
	w.count--
	w.dead++
	if !w.advancing {
		if w.sweepAt < 0 && w.dead > w.count && w.dead >= w.sweepMin {
			w.sweepAt = 0
			w.sweepLate()
			w.compactQueue(&w.nowQ)
		}
		if w.sweepAt >= 0 {
			w.sweepStep()
		}
	}
	return true
}

// Next returns a time t no later than the earliest pending due, such that an
// Advance to any time before t yields nothing. It is exact for entries due
// at or before the wheel's time and for level 0 (the next 64 ms or so), and a
// bucket start for coarser levels: an Advance to that time cascades the
// bucket, after which Next is finer. It can be early after a Remove. ok is
// false when the wheel is empty. O(1).
func (w *Wheel) Next() (at int64, ok bool) {
	if w.count == 0 {
		return 0, false
	}
	if it, _, ok := w.peekLate(); ok {
		return it.due, true
	}
	if !w.nowQ.empty() {
		return unkey(w.cur), true
	}
	if w.levels == 0 {
		// Unreachable while count > 0; kept so Next never lies.
		return 0, false
	}
	l := uint(bits.TrailingZeros16(w.levels))
	return unkey(w.bucketStart(l)), true
}

// Advance yields, through fn, every pending entry with due <= now in (due,
// Add order) order: ascending due, FIFO among equal dues. Each entry leaves
// the wheel before fn sees it, so its handle is already stale inside fn. A now
// earlier than a previous one (clock stepped back) yields only what is due by
// that now: the wheel never fires early.
//
// fn may call Add and Remove; an entry it adds with due <= now is yielded by
// the same call, in order. fn must not call Advance or AdvanceN (such a call
// does nothing and returns false).
func (w *Wheel) Advance(now int64, fn func(due int64, seq uint64)) {
	w.AdvanceN(now, math.MaxInt, fn)
}

// AdvanceN is Advance yielding at most max entries. It returns more = true
// exactly when entries with due <= now remain; the next call continues where
// this one stopped, so a caller can bound its fire batch without breaking the
// order. max <= 0 yields nothing and only reports whether entries are due.
func (w *Wheel) AdvanceN(now int64, max int, fn func(due int64, seq uint64)) (more bool) {
	if w.advancing {
		return false
	}
	if fn == nil {
		fn = func(int64, uint64) {} // discard rather than panic
	}
	w.advancing = true
	defer func() { w.advancing = false }()
	if now > w.now {
		w.now = now
	}
	target := key(now)
	n := 0
	for {
		// Entries due before cur come first; they only exist after an Add
		// in the past, so this list is usually empty.
		for {
			it, inHeap, ok := w.peekLate()
			if !ok {
				break
			}
			if w.slab[it.idx].link == linkDead {
				w.popLate(inHeap)
				w.reap(it.idx)
				continue
			}
			if key(it.due) > target {
				// Clock stepped back: the rest of the wheel is later still.
				return false
			}
			if n >= max {
				return true
			}
			w.popLate(inHeap)
			n++
			w.fire(it.due, it.idx, fn)
		}
		w.late, w.lateAt = w.late[:0], 0
		if cap(w.late) > lateKeep {
			w.late = nil // a backlog was drained; let the GC have it
		}
		if cap(w.lateHeap) > lateKeep {
			w.lateHeap = nil
		}

		if !w.nowQ.empty() {
			if w.cur > target {
				return false
			}
			if w.drainNow(&n, max, fn) {
				return true
			}
			if w.hasLate() {
				continue // fn added an entry due in the past
			}
		}

		if target <= w.cur {
			return false
		}
		if w.levels == 0 {
			w.cur = target
			return false
		}
		l := uint(bits.TrailingZeros16(w.levels))
		start := w.bucketStart(l)
		if start > target {
			// Moving cur to target keeps both invariants: target lies
			// between cur and start, so it shares start's higher digits and
			// its digit at every occupied level is still below the slot's.
			w.cur = target
			return false
		}
		w.cur = start
		w.expire(l)
	}
}

// drainNow yields live entries from the now queue until it is empty, max is
// reached (returns true: a live entry is still due), or fn added an entry due
// before cur (which must come first).
func (w *Wheel) drainNow(n *int, max int, fn func(due int64, seq uint64)) (stopped bool) {
	q := &w.nowQ
	for !q.empty() {
		if q.off == chunkSize {
			// Not empty, so head is not the tail: move to the next chunk.
			q.head = w.popChunk(q.head)
			q.off = 0
			continue
		}
		c := &w.chunks[q.head]
		if q.off == 0 {
			end := int32(chunkSize)
			if q.head == q.tail {
				end = q.fill
			}
			w.touch(c.idx[:end])
		}
		due, i := c.due[q.off], c.idx[q.off]
		if w.slab[i].link == linkDead {
			q.off++
			w.reap(i)
			continue
		}
		if *n >= max {
			return true
		}
		q.off++
		*n++
		w.fire(due, i, fn)
		if w.hasLate() {
			return false
		}
	}
	w.resetQueue(q)
	return false
}

// touch loads the slab records of a chunk's items before they are used. The loads
// are independent, so the CPU overlaps their cache misses; firing or
// sweeping then finds the records in cache instead of waiting on one miss at a time (Go has no
// prefetch intrinsic; this is the portable equivalent).
func (w *Wheel) touch(idx []int32) {
	var x int32
	for _, i := range idx {
		x |= w.slab[i].link
	}
	w.sink = x
}

// fire recycles entry i and then hands it to fn, so that fn sees a wheel in
// which the entry is gone and may reuse its slot.
func (w *Wheel) fire(due int64, i int32, fn func(due int64, seq uint64)) {
	e := &w.slab[i]
	seq := e.seq
	e.gen = nextGen(e.gen)
	w.count--
	w.freeEntry(i)
	fn(due, seq)
}

// bucketStart returns the key at which the lowest occupied slot of level l
// begins: cur's digits above l, the slot's digit at l, zeros below.
func (w *Wheel) bucketStart(l uint) uint64 {
	s := uint64(bits.TrailingZeros64(w.occ[l]))
	shift := l * slotBits
	hi := w.cur >> shift >> slotBits << slotBits // cur's digits above level l
	return (hi | s) << shift
}

// expire empties the bucket of level l that starts at w.cur (the caller just
// moved cur there, with the late list and now queue drained). A level-0
// bucket holds only entries due at cur, so it becomes the now queue in O(1);
// a coarser bucket is re-placed item by item, in order so equal dues stay
// FIFO. Cascading reads only the chunks, never the slab, so removed entries
// are carried along and recycled when they come due.
func (w *Wheel) expire(l uint) {
	w.expired++
	slot := uint(w.cur>>(l*slotBits)) & slotMask
	b := &w.buckets[l*numSlots+slot]
	w.occ[l] &^= 1 << slot
	if w.occ[l] == 0 {
		w.levels &^= 1 << l
	}
	q := *b
	*b = emptyQueue
	if l == 0 {
		w.resetQueue(&w.nowQ)
		w.nowQ = q
		return
	}
	for c := q.head; c != noLink; {
		end := int32(chunkSize)
		if c == q.tail {
			end = q.fill
		}
		// Copy the items out: place may append to w.chunks and move it.
		ch := w.chunks[c]
		for j, due := range ch.due[:end] {
			w.place(due, ch.idx[j])
		}
		c = w.popChunk(c)
	}
}

// place queues entry i due at due: in the late list when it is before cur,
// the now queue when it is at cur, else the bucket chosen by the highest bit
// in which its key and cur differ.
func (w *Wheel) place(due int64, i int32) {
	switch k := key(due); {
	case k > w.cur:
		l := uint(bits.Len64(k^w.cur)-1) / slotBits
		slot := uint(k>>(l*slotBits)) & slotMask
		w.occ[l] |= 1 << slot
		w.levels |= 1 << l
		w.push(&w.buckets[l*numSlots+slot], due, i)
	case k == w.cur:
		w.push(&w.nowQ, due, i)
	default:
		w.addLate(due, i)
	}
}

// addLate queues i in the late list after every entry due at or before
// due. Past dues normally arrive in order (a loader scanning the store by
// key), so this is an append to the sorted run; any other goes into the
// heap in O(log n).
func (w *Wheel) addLate(due int64, i int32) {
	if w.lateAt == len(w.late) {
		w.late, w.lateAt = w.late[:0], 0
		if len(w.lateHeap) == 0 {
			w.lateOrd = 0 // nothing late is pending: restart the counter
		}
	}
	if w.lateOrd >= w.ordLimit {
		w.renumberLate()
	}
	it := item{due: due, ord: w.lateOrd, idx: i}
	w.lateOrd++
	if n := len(w.late); n == w.lateAt || w.late[n-1].due <= due {
		w.late = append(w.late, it)
		return
	}
	w.lateHeap = append(w.lateHeap, it)
	w.siftUp(len(w.lateHeap) - 1)
}

// hasLate reports whether any item, live or removed, is in the late list.
func (w *Wheel) hasLate() bool {
	return w.lateAt < len(w.late) || len(w.lateHeap) > 0
}

// peekLate returns the first item of the late list (ok false when it is
// empty) and whether it is the heap's or the sorted run's.
func (w *Wheel) peekLate() (it item, inHeap, ok bool) {
	if w.lateAt < len(w.late) {
		it, ok = w.late[w.lateAt], true
	}
	if len(w.lateHeap) > 0 && (!ok || w.lateHeap[0].before(it)) {
		return w.lateHeap[0], true, true
	}
	return it, false, ok
}

// popLate drops the item peekLate returned.
func (w *Wheel) popLate(inHeap bool) {
	if !inHeap {
		w.lateAt++
		return
	}
	h := w.lateHeap
	last := len(h) - 1
	h[0] = h[last]
	w.lateHeap = h[:last]
	if last > 0 {
		w.siftDown(0)
	}
}

// The heap is 4-ary: half the levels of a binary heap and a node's
// children in 64 contiguous bytes, so a sift down at a few hundred thousand
// items takes fewer cache misses (BenchmarkLateFill/random: about a quarter
// faster than binary).
const heapArity = 4

func (w *Wheel) siftUp(j int) {
	h := w.lateHeap
	it := h[j]
	for j > 0 {
		p := (j - 1) / heapArity
		if !it.before(h[p]) {
			break
		}
		h[j] = h[p]
		j = p
	}
	h[j] = it
}

func (w *Wheel) siftDown(j int) {
	h := w.lateHeap
	n := len(h)
	it := h[j]
	for {
		c := j*heapArity + 1
		if c >= n {
			break
		}
		m := c
		for k := c + 1; k < min(c+heapArity, n); k++ {
			if h[k].before(h[m]) {
				m = k
			}
		}
		if !h[m].before(it) {
			break
		}
		h[j] = h[m]
		j = m
	}
	h[j] = it
}

// heapify restores the heap property of lateHeap in O(n).
func (w *Wheel) heapify() {
	if len(w.lateHeap) < 2 {
		return
	}
	for j := (len(w.lateHeap) - 2) / heapArity; j >= 0; j-- {
		w.siftDown(j)
	}
}

// renumberLate gives the pending late items the ords 0, 1, ... in their
// (due, ord) order and sets lateOrd past them: the counter ran out while
// the late list never emptied (2^32 late Adds). O(n log n), once per 2^32
// Adds. The run keeps its positions and the heap stays a heap; an Advance
// whose fn added the item that got here peeks afresh, so it is unaffected.
func (w *Wheel) renumberLate() {
	slices.SortFunc(w.lateHeap, func(a, b item) int {
		if a.before(b) {
			return -1
		}
		if b.before(a) {
			return 1
		}
		return 0
	}) // a sorted slice is a heap
	run, h := w.late[w.lateAt:], w.lateHeap
	ord := uint32(0)
	for len(run) > 0 || len(h) > 0 {
		if len(h) == 0 || len(run) > 0 && run[0].before(h[0]) {
			run[0].ord = ord
			run = run[1:]
		} else {
			h[0].ord = ord
			h = h[1:]
		}
		ord++
	}
	w.lateOrd = ord
	w.renumbers++
}

func (q *queue) empty() bool {
	return q.head == noLink || (q.head == q.tail && q.off == q.fill)
}

// push appends i to q, taking a chunk from the free list when the tail is full.
func (w *Wheel) push(q *queue, due int64, i int32) {
	if q.head == noLink {
		c := w.allocChunk()
		*q = queue{head: c, tail: c}
	} else if q.fill == chunkSize {
		c := w.allocChunk()
		w.chunks[q.tail].next = c
		q.tail, q.fill = c, 0
	}
	c := &w.chunks[q.tail]
	c.due[q.fill] = due
	c.idx[q.fill] = i
	q.fill++
}

// resetQueue returns q's chunks to the free list. Only called on a queue
// whose entries have all been consumed.
func (w *Wheel) resetQueue(q *queue) {
	for c := q.head; c != noLink; {
		c = w.popChunk(c)
	}
	*q = emptyQueue
}

// popChunk frees chunk c and returns the one after it.
func (w *Wheel) popChunk(c int32) int32 {
	next := w.chunks[c].next
	w.chunks[c].next = w.freeChunk
	w.freeChunk = c
	return next
}

func (w *Wheel) allocChunk() int32 {
	if c := w.freeChunk; c != noLink {
		w.freeChunk = w.chunks[c].next
		w.chunks[c].next = noLink
		return c
	}
	w.chunks = append(w.chunks, chunk{next: noLink})
	return int32(len(w.chunks) - 1)
}

func (w *Wheel) allocEntry() int32 {
	if i := w.freeEnt; i != noLink {
		w.freeEnt = w.slab[i].link
		return i
	}
	if len(w.slab) >= maxSlab {
		// 2^31 entries would need some 60 GiB; a process runs out of memory
		// long before. Fail loudly rather than corrupt indexes.
		panic("wheel: more than 2^31-1 entries")
	}
	w.slab = append(w.slab, entry{gen: 1})
	return int32(len(w.slab) - 1)
}

// reap recycles removed entry i once its queued item has been consumed.
func (w *Wheel) reap(i int32) {
	w.dead--
	w.freeEntry(i)
}

// sweepLate drops removed entries from the late list.
func (w *Wheel) sweepLate() {
	kept := w.late[:w.lateAt]
	for _, it := range w.late[w.lateAt:] {
		if w.slab[it.idx].link == linkDead {
			w.reap(it.idx)
			continue
		}
		kept = append(kept, it)
	}
	w.late = kept
	if len(w.lateHeap) == 0 {
		return
	}
	h := w.lateHeap[:0]
	for _, it := range w.lateHeap {
		if w.slab[it.idx].link == linkDead {
			w.reap(it.idx)
			continue
		}
		h = append(h, it)
	}
	w.lateHeap = h
	w.heapify()
}

// sweepStep compacts the next non-empty bucket at or after w.sweepAt and
// moves the cursor past it, ending the cycle (sweepAt = -1) after the last.
// Items that cascade behind the cursor during a cycle wait for the next one.
func (w *Wheel) sweepStep() {
	for b := w.sweepAt; b < numBuckets; {
		l, s := uint(b/numSlots), uint(b%numSlots)
		m := w.occ[l] >> s << s
		if m == 0 {
			b = int(l+1) * numSlots
			continue
		}
		s = uint(bits.TrailingZeros64(m))
		q := &w.buckets[l*numSlots+s]
		w.compactQueue(q)
		if q.head == noLink {
			w.occ[l] &^= 1 << s
			if w.occ[l] == 0 {
				w.levels &^= 1 << l
			}
		}
		w.sweepAt = int(l*numSlots+s) + 1
		return
	}
	w.sweepAt = -1
}

// compactQueue filters q in place: a write cursor follows the read cursor
// through the same chunks, and the chunks left over at the end are freed.
func (w *Wheel) compactQueue(q *queue) {
	if q.head == noLink {
		return
	}
	rc, ro := q.head, q.off
	wc, wo := q.head, q.off
	for {
		end := int32(chunkSize)
		if rc == q.tail {
			end = q.fill
		}
		w.touch(w.chunks[rc].idx[ro:end])
		for ; ro < end; ro++ {
			due, i := w.chunks[rc].due[ro], w.chunks[rc].idx[ro]
			if w.slab[i].link == linkDead {
				w.reap(i)
				continue
			}
			if wo == chunkSize {
				wc, wo = w.chunks[wc].next, 0
			}
			w.chunks[wc].due[wo], w.chunks[wc].idx[wo] = due, i
			wo++
		}
		if rc == q.tail {
			break
		}
		rc, ro = w.chunks[rc].next, 0
	}
	for c := w.chunks[wc].next; c != noLink; {
		c = w.popChunk(c)
	}
	w.chunks[wc].next = noLink
	q.tail, q.fill = wc, wo
	if q.empty() {
		w.resetQueue(q)
	}
}

// freeEntry recycles slot i. Its generation was already bumped when it was
// fired or removed, so old handles are stale.
func (w *Wheel) freeEntry(i int32) {
	w.slab[i].link = w.freeEnt
	w.freeEnt = i
}

// nextGen skips 0 so that the zero Handle never matches.
func nextGen(g uint32) uint32 {
	if g++; g == 0 {
		g = 1
	}
	return g
}
