// Package wheel is a hierarchical timing wheel that holds the tasks a shard
// will fire soon, keyed by due time in Unix milliseconds.
//
// The wheel is pure: it starts no goroutines, takes no locks and never reads
// the clock. Its owner passes the time in (Advance, AdvanceN) and decides when
// to call again (Next). A Wheel is not safe for concurrent use.
//
// # Layout
//
// Times are mapped to unsigned 64-bit keys (sign bit flipped, so key order is
// time order over the whole int64 range). The wheel has 11 levels of 64 slots;
// level L holds bits [6L, 6L+6) of the key, so a level-0 slot is 1 ms, level 1
// is 64 ms, level 2 about 4 s, level 3 about 4.4 min, level 4 about 4.7 h,
// level 5 about 12.4 days, level 6 about 2.2 years, and levels 7..10 cover the
// rest of the int64 range. Because the levels span every bit of the key there
// is no overflow list: a due time of 500 days or math.MaxInt64 is placed like
// any other, never clamped.
//
// An entry with due key d is placed, relative to the wheel's current key c, at
// the level of the highest bit in which d and c differ, in the slot given by
// d's digit at that level (Linux's and Kafka's placement). Two invariants
// follow and everything else rests on them:
//
//   - every pending entry in level L shares all digits above L with c and has
//     a digit at L greater than c's, so the lowest occupied slot of the lowest
//     occupied level is always the next bucket in time, found with two
//     TrailingZeros calls on the occupancy bitmaps (no idle ticking);
//   - an entry's level is always the level of the highest differing bit of its
//     due and c, because c can only enter an entry's slot by stopping at that
//     slot's start and cascading it. Entries with the same due are therefore
//     always in the same bucket, and buckets are FIFO, so equal-due entries
//     keep their Add order even when some were cascaded from a coarser level
//     and others were added later straight into a finer one.
//
// Entries due at or before the current key live in a ready list sorted by due
// (stable, so FIFO for equal due). Advance drains the ready list, then jumps
// the current key to the start of the next non-empty bucket, moving a level-0
// bucket into the ready list in O(1) or cascading a coarser bucket one or more
// levels down, until the next bucket starts after the target time. A jump of
// days costs O(non-empty buckets + levels), not O(elapsed ms).
//
// # Memory
//
// Entries live in one slab ([]entry, 32 bytes each, no pointers, so the GC
// never scans it) linked into circular doubly-linked lists by int32 index.
// Every list (ready list and the 704 buckets) has a sentinel entry at a fixed
// low index, which makes Remove O(1) without storing a bucket id per entry and
// lets a whole level-0 bucket be spliced into the ready list in O(1). Freed
// entries are recycled through a free list, so a wheel in steady state does not
// allocate.
package wheel

import (
	"math"
	"math/bits"
)

const (
	slotBits  = 6
	numSlots  = 1 << slotBits // 64: one uint64 occupancy word per level
	slotMask  = numSlots - 1
	numLevels = (64 + slotBits - 1) / slotBits // 11: levels cover all 64 key bits

	readyList = 0                              // sentinel index of the ready list
	firstSlot = 1                              // sentinel index of bucket (0, 0)
	numSent   = firstSlot + numLevels*numSlots // sentinels at the start of the slab
	freeMark  = -1                             // prev of a free entry
	noEntry   = -1                             // end of the free list

	// maxEntries keeps every index representable as a positive int32.
	maxEntries = math.MaxInt32
)

// Handle identifies an entry returned by Add. It stays valid until the entry
// is yielded or removed; after that Remove reports false, even if the slab
// slot has been reused, because the handle carries the slot's generation.
// The zero Handle is never valid.
type Handle uint64

// entry is one pending task or a list sentinel. No pointers: the slab is a
// single noscan allocation however many millions of entries it holds.
type entry struct {
	due  int64
	seq  uint64
	next int32
	prev int32 // freeMark while the entry is on the free list
	gen  uint32
}

// Wheel is a hierarchical timing wheel. See the package documentation.
type Wheel struct {
	slab      []entry
	free      int32 // head of the free list, linked through next
	count     int
	cur       uint64 // key of the time up to which buckets have been processed
	now       int64  // highest time passed to New/Advance, for Now
	occ       [numLevels]uint64
	levels    uint16 // bit L set when occ[L] != 0
	inAdvance bool
}

// key maps a time to an unsigned key with the same order.
func key(t int64) uint64 { return uint64(t) ^ (1 << 63) }

// unkey is the inverse of key.
func unkey(k uint64) int64 { return int64(k ^ (1 << 63)) }

// New returns an empty wheel whose current time is now (Unix milliseconds).
func New(now int64) *Wheel {
	w := &Wheel{
		slab: make([]entry, numSent),
		free: noEntry,
		cur:  key(now),
		now:  now,
	}
	for i := range w.slab {
		w.slab[i].next = int32(i)
		w.slab[i].prev = int32(i)
	}
	return w
}

// Grow makes room for n more entries without further allocation, so that a
// loader that knows how many tasks it is about to add pays for one slab growth
// instead of several.
func (w *Wheel) Grow(n int) {
	if n <= 0 {
		return
	}
	need := len(w.slab) + n
	if need > maxEntries {
		need = maxEntries
	}
	if need > cap(w.slab) {
		s := make([]entry, len(w.slab), need)
		copy(s, w.slab)
		w.slab = s
	}
}

// Len returns the number of pending entries.
func (w *Wheel) Len() int { return w.count }

// Now returns the latest time passed to New, Advance or AdvanceN. A clock
// step back does not lower it.
func (w *Wheel) Now() int64 { return w.now }

// Add schedules seq at due and returns a handle for Remove. A due at or before
// the wheel's current time is yielded by the next Advance whose now reaches
// it. Any int64 due is accepted; there is no horizon limit.
func (w *Wheel) Add(due int64, seq uint64) Handle {
	i := w.alloc()
	e := &w.slab[i]
	e.due = due
	e.seq = seq
	gen := e.gen
	w.count++
	w.place(i, key(due))
	return Handle(uint64(gen)<<32 | uint64(uint32(i)))
}

// Remove cancels the entry behind h in O(1). It returns false if h is zero,
// forged, or stale (the entry was already yielded or removed).
func (w *Wheel) Remove(h Handle) bool {
	i := uint64(h) & math.MaxUint32
	if i < numSent || i >= uint64(len(w.slab)) {
		return false
	}
	e := &w.slab[i]
	if e.prev == freeMark || e.gen != uint32(h>>32) {
		return false
	}
	w.unlink(int32(i))
	w.release(int32(i))
	return true
}

// Next returns a time t no later than the earliest pending due, such that an
// Advance to any time before t yields nothing. It is exact for entries in the
// ready list and level 0, and the bucket start for coarser levels (Advance
// to that time cascades the bucket, after which Next is finer). ok is false
// when the wheel is empty. O(1).
func (w *Wheel) Next() (at int64, ok bool) {
	if h := w.slab[readyList].next; h != readyList {
		return w.slab[h].due, true
	}
	if w.levels == 0 {
		return 0, false
	}
	l := uint(bits.TrailingZeros16(w.levels))
	return unkey(w.bucketStart(l)), true
}

// Advance yields, through fn, every pending entry with due <= now in (due,
// Add order) order: ascending due, FIFO among equal dues. Each entry is
// removed before fn sees it, so its handle is already stale inside fn. A now
// earlier than a previous one (clock stepped back) fires nothing that is not
// due by that now: the wheel never fires early.
//
// fn may call Add and Remove; an entry it adds with due <= now is yielded by
// the same call. fn must not call Advance or AdvanceN (such a call does
// nothing).
func (w *Wheel) Advance(now int64, fn func(due int64, seq uint64)) {
	w.AdvanceN(now, math.MaxInt, fn)
}

// AdvanceN is Advance yielding at most max entries. It returns more = true
// when entries with due <= now remain; the next call continues exactly where
// this one stopped, so a caller can bound its fire batch without breaking the
// order. max <= 0 yields nothing and only reports whether entries are due.
func (w *Wheel) AdvanceN(now int64, max int, fn func(due int64, seq uint64)) (more bool) {
	if w.inAdvance {
		return false
	}
	w.inAdvance = true
	defer func() { w.inAdvance = false }()
	if now > w.now {
		w.now = now
	}
	target := key(now)
	n := 0
	for {
		for {
			h := w.slab[readyList].next
			if h == readyList {
				break
			}
			if key(w.slab[h].due) > target {
				// Only after a clock step back: every ready entry is due
				// after now, and every bucket is later still.
				return false
			}
			if n >= max {
				return true
			}
			due, seq := w.slab[h].due, w.slab[h].seq
			w.unlink(h)
			w.release(h)
			n++
			fn(due, seq)
		}
		if w.levels == 0 || target <= w.cur {
			if target > w.cur {
				w.cur = target
			}
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

// bucketStart returns the key at which the lowest occupied slot of level l
// begins: cur's digits above l, the slot's digit at l, zeros below.
func (w *Wheel) bucketStart(l uint) uint64 {
	s := uint64(bits.TrailingZeros64(w.occ[l]))
	shift := l * slotBits
	hi := w.cur >> shift >> slotBits << slotBits // cur's digits above level l
	return (hi | s) << shift
}

// expire empties the bucket of level l that starts at w.cur (the caller just
// moved cur there). Level 0 holds a single due time, so the whole list is
// spliced into the (empty) ready list; a coarser bucket is re-placed entry by
// entry, in list order so equal dues stay FIFO.
func (w *Wheel) expire(l uint) {
	slot := int32(w.cur>>(l*slotBits)) & slotMask
	s := firstSlot + int32(l)*numSlots + slot
	w.occ[l] &^= 1 << uint(slot)
	if w.occ[l] == 0 {
		w.levels &^= 1 << l
	}
	sl := w.slab
	first, last := sl[s].next, sl[s].prev
	sl[s].next, sl[s].prev = s, s
	if l == 0 && sl[readyList].next == readyList {
		sl[readyList].next, sl[readyList].prev = first, last
		sl[first].prev = readyList
		sl[last].next = readyList
		return
	}
	for i := first; i != s; {
		nx := sl[i].next
		w.place(i, key(sl[i].due))
		i = nx
	}
}

// place links entry i, due key k, at the tail of its list: the ready list
// (kept sorted by due) when k <= cur, else the bucket chosen by the highest
// bit in which k and cur differ.
func (w *Wheel) place(i int32, k uint64) {
	sl := w.slab
	if k <= w.cur {
		// Walk back from the tail past later dues. Ready entries normally
		// arrive in due order (a bucket at a time, or a loader scanning the
		// store in key order), so this is O(1) in practice; an adversarial
		// mix of past dues makes it linear in the ready list.
		p := sl[readyList].prev
		for p != readyList && key(sl[p].due) > k {
			p = sl[p].prev
		}
		w.linkAfter(i, p)
		return
	}
	l := uint(bits.Len64(k^w.cur)-1) / slotBits
	slot := int32(k>>(l*slotBits)) & slotMask
	s := firstSlot + int32(l)*numSlots + slot
	w.occ[l] |= 1 << uint(slot)
	w.levels |= 1 << l
	w.linkAfter(i, sl[s].prev)
}

// linkAfter inserts i after p in p's circular list.
func (w *Wheel) linkAfter(i, p int32) {
	sl := w.slab
	n := sl[p].next
	sl[i].prev, sl[i].next = p, n
	sl[p].next = i
	sl[n].prev = i
}

// unlink removes i from its list and clears the occupancy bit if that emptied
// a bucket. A neighbour that is a sentinel pointing at itself on both sides
// is the only way to see an emptied list: no per-entry bucket id is needed.
func (w *Wheel) unlink(i int32) {
	sl := w.slab
	p, n := sl[i].prev, sl[i].next
	sl[p].next = n
	sl[n].prev = p
	if p == n && p >= firstSlot && p < numSent {
		b := p - firstSlot
		l := uint(b / numSlots)
		w.occ[l] &^= 1 << uint(b%numSlots)
		if w.occ[l] == 0 {
			w.levels &^= 1 << l
		}
	}
}

// alloc returns a free slab index, growing the slab if the free list is empty.
func (w *Wheel) alloc() int32 {
	if i := w.free; i != noEntry {
		w.free = w.slab[i].next
		return i
	}
	if len(w.slab) >= maxEntries {
		// 2^31 entries is 64 GiB of slab; a process cannot get here without
		// running out of memory first, but fail loudly rather than corrupt.
		panic("wheel: more than 2^31-1 entries")
	}
	w.slab = append(w.slab, entry{gen: 1})
	return int32(len(w.slab) - 1)
}

// release puts i on the free list and bumps its generation so that handles
// to it go stale.
func (w *Wheel) release(i int32) {
	e := &w.slab[i]
	e.gen++
	if e.gen == 0 {
		e.gen = 1
	}
	e.prev = freeMark
	e.next = w.free
	w.free = i
	w.count--
}
