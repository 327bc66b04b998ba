package shard

import (
	"context"
	"fmt"
	"math/bits"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/cockroachdb/pebble/v2"
	"go.uber.org/zap"
)

// The index filter spares Ingest the Pebble lookup of an id the store has
// never seen, which is nearly every id. Such a lookup walks the memtables'
// skiplists (there are no filters for those) at a random place: with
// random ids (UUIDs, order numbers) it took a third of the ingest CPU.
//
// Each shard keeps a Bloom filter over the index keys of its range. A key
// the filter does not hold is not in the index, so:
//
//   - every index write is announced to setOverlayLocked, under the shard
//     lock, before its batch is applied; that adds the key to the filter
//     (and to the one being built);
//   - a build installs its new filter in every shard first, seeding it with
//     the keys of the shard's undurable decisions (the overlay), and only
//     then opens the iterator it scans the index with. A key decided before
//     the install is either in the overlay (copied) or durable, and so
//     visible to that iterator; a key decided after is added directly.
//
// Deleted keys stay in the filter until the next build. Builds run in the
// background: at open (until the first one ends every lookup reads the
// store, as without a filter) and whenever a shard's filter has taken as
// many keys as it was sized for.

// filterBitsPerKey and filterProbes give about 1% false positives at a
// filter's capacity.
const (
	filterBitsPerKey = 10
	filterProbes     = 7
)

// filterMinKeys is the capacity of all shards' filters together when the
// store is small.
const filterMinKeys = 1 << 19

// idFilter is a blocked Bloom filter: each key sets filterProbes bits in
// one 64-byte block, one cache line per add or test.
type idFilter struct {
	blocks   [][8]uint64
	n        int // keys added
	capacity int // keys it was sized for
}

func newIDFilter(capacity int) *idFilter {
	capacity = max(capacity, 64)
	nb := (capacity*filterBitsPerKey + 511) / 512
	return &idFilter{blocks: make([][8]uint64, nb), capacity: capacity}
}

// filterHash is the hash a filter takes for an index key;
// filterHashString the same of the key as a string.
func filterHash(indexKey []byte) uint64 { return xxhash.Sum64(indexKey) }

func filterHashString(indexKey string) uint64 { return xxhash.Sum64String(indexKey) }

func (f *idFilter) block(h uint64) (*[8]uint64, uint64) {
	hi, _ := bits.Mul64(h, uint64(len(f.blocks)))
	// The probe bits come from a remix of h, independent of the block.
	h ^= h >> 33
	h *= 0xff51afd7ed558ccd
	h ^= h >> 33
	return &f.blocks[hi], h
}

// add sets h's bits. Only a key that sets a new bit counts towards full:
// a key the filter holds already (every replace and retry announces its
// id again) fills nothing, and counting it made a filter of a few hot ids
// full, and rebuilt from a scan of the whole index, every capacity
// replaces. (So does a new key that is a false positive, about 1% at
// capacity: the count measures what the filter holds.)
func (f *idFilter) add(h uint64) {
	b, p := f.block(h)
	set := false
	for range filterProbes {
		bit := p >> 55 // 9 bits: 0..511
		w, m := &b[bit>>6], uint64(1)<<(bit&63)
		set = set || *w&m == 0
		*w |= m
		p <<= 9
	}
	if set {
		f.n++
	}
}

func (f *idFilter) mayContain(h uint64) bool {
	b, p := f.block(h)
	for range filterProbes {
		bit := p >> 55
		if b[bit>>6]&(1<<(bit&63)) == 0 {
			return false
		}
		p <<= 9
	}
	return true
}

func (f *idFilter) full() bool { return f.n > f.capacity }

func (f *idFilter) bytes() int { return len(f.blocks) * 64 }

// filterAddLocked records that the index key with hash h may be written.
func (s *shard) filterAddLocked(h uint64) {
	if s.flt != nil {
		s.flt.add(h)
		if s.flt.full() && s.fltNext == nil {
			s.e.kickFilter()
		}
	}
	if s.fltNext != nil {
		s.fltNext.add(h)
	}
}

// filterSaysAbsentLocked reports whether the index surely lacks the key.
func (s *shard) filterSaysAbsentLocked(key []byte) bool {
	return s.flt != nil && !s.flt.mayContain(filterHash(key))
}

func (e *Engine) kickFilter() {
	select {
	case e.fltKick <- struct{}{}:
	default:
	}
}

// filterLoop builds the shards' filters at open and again when one is full.
func (e *Engine) filterLoop(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-e.fltKick:
		}
		if err := e.buildFilters(ctx); err != nil && ctx.Err() == nil {
			// Every lookup keeps reading the store (or the older filter,
			// which stays right): slower, not wrong. Try again later.
			e.log.Warn("index filter build failed; retrying in a minute", zap.Error(err))
			t := e.clk.NewTimer(filterRetry)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C():
			}
			e.kickFilter()
		}
	}
}

// filterRetry is the wait before a failed filter build is tried again.
const filterRetry = time.Minute

// buildFilters replaces every shard's filter by one built from a scan of
// the index. Safe to run while ingesting; not concurrently with itself.
func (e *Engine) buildFilters(ctx context.Context) (err error) {
	e.fltBuildMu.Lock()
	defer e.fltBuildMu.Unlock()
	start := time.Now()
	n := len(e.shards)
	minPer := max(e.opts.filterMinKeys/n, 64)
	for _, s := range e.shards {
		s.mu.Lock()
		// Twice what the shard holds: a build every time it took as many
		// new keys again.
		s.fltNext = newIDFilter(max(minPer, 2*int(max(s.pending, s.fltScanned))))
		for k := range s.overlay {
			s.fltNext.add(filterHashString(k))
		}
		s.mu.Unlock()
	}
	defer func() {
		if err != nil {
			for _, s := range e.shards {
				s.mu.Lock()
				s.fltNext = nil
				s.mu.Unlock()
			}
		}
	}()
	if e.testHookFilterScan != nil {
		if err := e.testHookFilterScan(); err != nil {
			return fmt.Errorf("index filter: %w", err)
		}
	}
	it, err := e.db.NewIter(&pebble.IterOptions{
		LowerBound: []byte{prefixIndex},
		UpperBound: []byte{prefixIndex + 1},
	})
	if err != nil {
		return fmt.Errorf("index filter: %w", err)
	}
	const flushAt = 1024
	hashes := make([][]uint64, n)
	scanned := make([]int64, n)
	flush := func(sh int) {
		s := e.shards[sh]
		s.mu.Lock()
		for _, h := range hashes[sh] {
			s.fltNext.add(h)
		}
		s.mu.Unlock()
		scanned[sh] += int64(len(hashes[sh]))
		hashes[sh] = hashes[sh][:0]
	}
	keys := 0
	for ok := it.First(); ok; ok = it.Next() {
		k := it.Key()
		sh := shardOfIndexKey(k, n)
		hashes[sh] = append(hashes[sh], filterHash(k))
		if len(hashes[sh]) == flushAt {
			flush(sh)
		}
		if keys++; keys%(16*flushAt) == 0 && ctx.Err() != nil {
			break
		}
	}
	if err := it.Close(); err != nil {
		return fmt.Errorf("index filter: scan: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("index filter: %w", err)
	}
	size := 0
	for sh, s := range e.shards {
		flush(sh)
		s.mu.Lock()
		s.flt, s.fltNext = s.fltNext, nil
		s.fltScanned = scanned[sh]
		size += s.flt.bytes()
		s.mu.Unlock()
	}
	e.fltMu.Lock()
	e.fltBuilds++
	e.fltCond.Broadcast()
	e.fltMu.Unlock()
	e.log.Debug("index filter built", zap.Int("keys", keys), zap.Int("bytes", size),
		zap.Duration("took", time.Since(start)))
	return nil
}
