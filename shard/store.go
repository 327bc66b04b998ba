package shard

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unicode/utf8"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/bloom"
	"github.com/cockroachdb/pebble/v2/vfs"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/internal/logthrottle"
)

// Key layout. Every integer is big-endian so byte order is numeric order and
// a range scan over t keys of one shard walks the tasks in (fire, seq) order.
//
//	t|shard u16|fire_ms u64|seq u64   -> task envelope (codec.AppendTask)
//	i|source 0x00 id                  -> indexEntry (pending task or cancel marker)
//	x|shard u16|expiry_ms u64|source 0x00 id -> "" (cancel-marker expiry queue)
//	o|checkpoint key                  -> offset i64 [fingerprint u64] (checkpoint.go)
//	c|shard u16                       -> pending count i64 (merge: sum)
//	m                                 -> last sequence u64 (merge: max)
//	n                                 -> shard count u16 (fixed at creation)
//	f|shard u16|seq u64               -> failing dead letter (appendDLFailure)
//	w|shard u16|seq u64               -> awaited dead letter: fire u64, its
//	                                     batch's checkpoint keys (appendDLWait)
//	h|shard u16|transport u8          -> held count i64 (merge: sum; hold.go)
//	u|shard u16|seq u64               -> task waiting for an outage: its
//	                                     retry's fire u64, lateTask.dg u64
//	                                     (appendWaiting; recover.go)
//	v                                 -> store format u16 (storeFormat)
//	p                                 -> operator's pause: since_ms u64,
//	                                     reason (pause.go)
//
// A task held on disk for an unreachable target (hold.go) keeps its t key
// at a fire time past any clock's, heldBase + its transport slot, target
// group and due time (heldFire).
//
// The pending counters and the sequence are merge operands, so concurrent
// batches never read-modify-write them and recovery reads N+1 keys instead
// of counting every stored task.
const (
	prefixTask   = 't'
	prefixIndex  = 'i'
	prefixExpiry = 'x'
	prefixOffset = 'o'
	prefixCount  = 'c'
	prefixSeq    = 'm'
	prefixShards = 'n'
	// prefixDLFailure: a dead letter whose last delivery failed (see
	// appendDLFailure), so a restart knows it is still failing.
	prefixDLFailure = 'f'
	// prefixDLWait: a dead letter a source waits for (see appendDLWait),
	// so that after a restart its partition still waits for it.
	prefixDLWait = 'w'
	// prefixHeld: the count of a shard's tasks held on disk for an
	// unreachable target, per transport (hold.go).
	prefixHeld = 'h'
	// prefixFormat: the store's format (see storeFormat).
	prefixFormat = 'v'
	// prefixWaiting: a task waiting for a retry because its target was
	// unreachable (see appendWaiting), so that after a restart it is
	// known to wait for the outage and a release takes it (recover.go).
	// Binaries before it ignore these keys (they read the store by
	// prefix): the store format stays 1.
	prefixWaiting = 'u'
	// prefixPause: an operator's pause of firing (pause.go), so that it
	// outlasts a restart. Binaries before it ignore the key and fire.
	prefixPause = 'p'
)

// storeFormat is the format of the records this binary writes, kept in
// the store as the oldest format a binary must read to open it: a release
// that starts writing records an older one would misread (as held tasks,
// at fire times past any clock, were: a release without them loaded them
// as due in millions of years and never delivered them) raises it, and
// the older binaries that check it (from this one on) refuse such a store
// at open with ErrStoreFormat instead. Stores written before the key
// existed are format 1.
const storeFormat = 1

const taskKeyLen = 1 + 2 + 8 + 8

var (
	seqKey    = []byte{prefixSeq}
	shardsKey = []byte{prefixShards}
	formatKey = []byte{prefixFormat}
	pauseKey  = []byte{prefixPause}
)

func fireU64(fire int64) uint64 {
	if fire < 0 {
		return 0
	}
	return uint64(fire)
}

func appendTaskKey(dst []byte, shard int, fire int64, seq uint64) []byte {
	dst = append(dst, prefixTask)
	dst = binary.BigEndian.AppendUint16(dst, uint16(shard))
	dst = binary.BigEndian.AppendUint64(dst, fireU64(fire))
	return binary.BigEndian.AppendUint64(dst, seq)
}

// taskBound is the smallest t key of shard at fire (inclusive lower bound,
// or exclusive upper bound when used as UpperBound).
func taskBound(shard int, fire int64) []byte {
	b := make([]byte, 0, 11)
	b = append(b, prefixTask)
	b = binary.BigEndian.AppendUint16(b, uint16(shard))
	return binary.BigEndian.AppendUint64(b, fireU64(fire))
}

func parseTaskKey(k []byte) (shard int, fire int64, seq uint64, ok bool) {
	// A fire time with the top bit set would read as negative: no encoder
	// writes one (fireU64 clamps at 0, held times stay below 2^63).
	if len(k) != taskKeyLen || k[0] != prefixTask || k[3]&0x80 != 0 {
		return 0, 0, 0, false
	}
	return int(binary.BigEndian.Uint16(k[1:3])), int64(binary.BigEndian.Uint64(k[3:11])), binary.BigEndian.Uint64(k[11:19]), true
}

func appendIndexKey(dst []byte, source, id string) []byte {
	dst = append(dst, prefixIndex)
	dst = append(dst, source...)
	dst = append(dst, 0)
	return append(dst, id...)
}

func appendExpiryKey(dst []byte, shard int, expiry int64, source, id string) []byte {
	dst = append(dst, prefixExpiry)
	dst = binary.BigEndian.AppendUint16(dst, uint16(shard))
	dst = binary.BigEndian.AppendUint64(dst, fireU64(expiry))
	dst = append(dst, source...)
	dst = append(dst, 0)
	return append(dst, id...)
}

func expiryBound(shard int, expiry int64) []byte {
	b := []byte{prefixExpiry}
	b = binary.BigEndian.AppendUint16(b, uint16(shard))
	return binary.BigEndian.AppendUint64(b, fireU64(expiry))
}

// parseExpiryKey returns the expiry and the index key the entry refers to.
// A key without the 0 between source and id is not one appendExpiryKey
// wrote, and names no index key: ok is false.
func parseExpiryKey(k []byte) (expiry int64, indexKey []byte, ok bool) {
	if len(k) < 11 || k[0] != prefixExpiry || k[3]&0x80 != 0 || bytes.IndexByte(k[11:], 0) < 0 {
		return 0, nil, false
	}
	ik := make([]byte, 0, 1+len(k)-11)
	ik = append(ik, prefixIndex)
	ik = append(ik, k[11:]...)
	return int64(binary.BigEndian.Uint64(k[3:11])), ik, true
}

func offsetKey(key string) []byte {
	return append([]byte{prefixOffset}, key...)
}

func countKey(shard int) []byte {
	return binary.BigEndian.AppendUint16([]byte{prefixCount}, uint16(shard))
}

func u64(v uint64) []byte { return binary.BigEndian.AppendUint64(nil, v) }

// shardSeqKeyLen is the length of a record key named by shard and seq:
// prefix | shard u16 | seq u64 (the f and w records of a dead letter).
const shardSeqKeyLen = 1 + 2 + 8

func shardSeqKey(prefix byte, shard int, seq uint64) []byte {
	k := make([]byte, 0, shardSeqKeyLen)
	k = append(k, prefix)
	k = binary.BigEndian.AppendUint16(k, uint16(shard))
	return binary.BigEndian.AppendUint64(k, seq)
}

func dlFailureKey(shard int, seq uint64) []byte { return shardSeqKey(prefixDLFailure, shard, seq) }

// dlFailureMaxText bounds the error text kept with a failing dead letter.
const dlFailureMaxText = 512

// appendDLFailure encodes a failing dead letter's record: its t key's fire
// time (so a restart can tell the record still matches a stored dead
// letter), whether it is parked, and its last error's text.
func appendDLFailure(dst []byte, fire int64, parked bool, err error) []byte {
	dst = binary.BigEndian.AppendUint64(dst, fireU64(fire))
	flag := byte(0)
	if parked {
		flag = 1
	}
	dst = append(dst, flag)
	text := ""
	if err != nil {
		text = err.Error()
	}
	if len(text) > dlFailureMaxText {
		// Cut at a rune start: the text is logged and served as JSON.
		// A rune is at most utf8.UTFMax bytes; text that is not UTF-8
		// is cut at the limit rather than backed up to nothing.
		n := dlFailureMaxText
		for n > dlFailureMaxText-utf8.UTFMax+1 && !utf8.RuneStart(text[n]) {
			n--
		}
		if !utf8.RuneStart(text[n]) {
			n = dlFailureMaxText
		}
		text = text[:n]
	}
	return append(dst, text...)
}

// parseDLFailure decodes a record of appendDLFailure.
func parseDLFailure(k, v []byte) (shard int, seq uint64, fire int64, parked bool, text string, ok bool) {
	if len(k) != shardSeqKeyLen || k[0] != prefixDLFailure || len(v) < 9 || v[8] > 1 {
		return 0, 0, 0, false, "", false
	}
	return int(binary.BigEndian.Uint16(k[1:3])), binary.BigEndian.Uint64(k[3:11]),
		int64(binary.BigEndian.Uint64(v[:8])), v[8] == 1, string(v[9:]), true
}

func dlWaitKey(shard int, seq uint64) []byte { return shardSeqKey(prefixDLWait, shard, seq) }

// dlWaitMaxKeys bounds the checkpoint keys of one awaited dead letter's
// record (a batch has one or two, not counting those kept aside).
const dlWaitMaxKeys = 64

// appendDLWait encodes the record of a dead letter a source waits for: the
// fire time it was stored with (so a restart can tell the record still
// matches a stored dead letter) and the checkpoint keys of its batch, each
// a u16 length and the key:
//
//	fire u64 | n u16 | n × (len u16 | key)
//
// Keys longer than 65535 bytes or more than dlWaitMaxKeys keys are not
// written (checkpoint keys are short): the caller passes what fits.
func appendDLWait(dst []byte, fire int64, keys []string) []byte {
	dst = binary.BigEndian.AppendUint64(dst, fireU64(fire))
	dst = binary.BigEndian.AppendUint16(dst, uint16(len(keys)))
	for _, k := range keys {
		dst = binary.BigEndian.AppendUint16(dst, uint16(len(k)))
		dst = append(dst, k...)
	}
	return dst
}

// errDLWaitRecord: a stored awaited-dead-letter record that does not decode.
var errDLWaitRecord = errors.New("corrupt awaited dead-letter record")

// parseDLWait decodes a record of appendDLWait: at least one key, none
// empty, no trailing bytes.
func parseDLWait(k, v []byte) (shard int, seq uint64, fire int64, keys []string, err error) {
	if len(k) != shardSeqKeyLen || k[0] != prefixDLWait {
		return 0, 0, 0, nil, fmt.Errorf("%w: key %x", errDLWaitRecord, k)
	}
	if len(v) < 10 {
		return 0, 0, 0, nil, fmt.Errorf("%w: value of %d bytes", errDLWaitRecord, len(v))
	}
	shard, seq = int(binary.BigEndian.Uint16(k[1:3])), binary.BigEndian.Uint64(k[3:11])
	f := binary.BigEndian.Uint64(v[:8])
	if f > math.MaxInt64 {
		return 0, 0, 0, nil, fmt.Errorf("%w: fire time %d", errDLWaitRecord, f)
	}
	n := int(binary.BigEndian.Uint16(v[8:10]))
	if n == 0 || n > dlWaitMaxKeys {
		return 0, 0, 0, nil, fmt.Errorf("%w: %d checkpoint keys", errDLWaitRecord, n)
	}
	rest := v[10:]
	keys = make([]string, 0, n)
	for range n {
		if len(rest) < 2 {
			return 0, 0, 0, nil, fmt.Errorf("%w: truncated", errDLWaitRecord)
		}
		l := int(binary.BigEndian.Uint16(rest))
		rest = rest[2:]
		if l == 0 || len(rest) < l {
			return 0, 0, 0, nil, fmt.Errorf("%w: key of %d bytes, %d left", errDLWaitRecord, l, len(rest))
		}
		keys = append(keys, string(rest[:l]))
		rest = rest[l:]
	}
	if len(rest) != 0 {
		return 0, 0, 0, nil, fmt.Errorf("%w: %d trailing bytes", errDLWaitRecord, len(rest))
	}
	return shard, seq, int64(f), keys, nil
}

func waitingKey(shard int, seq uint64) []byte { return shardSeqKey(prefixWaiting, shard, seq) }

// waitingLen is the length of a waiting record's value (appendWaiting).
const waitingLen = 16

// appendWaiting encodes the record of a task waiting for an outage: its
// retry's fire time (its t key's, so a restart can tell the record still
// matches the stored task) and its lateTask.dg (due time and target
// group).
func appendWaiting(dst []byte, fire, dg int64) []byte {
	dst = binary.BigEndian.AppendUint64(dst, fireU64(fire))
	return binary.BigEndian.AppendUint64(dst, uint64(dg))
}

// parseWaiting decodes a record of appendWaiting: ok false unless it is
// one, names a target group and a fire time below the held ones.
func parseWaiting(k, v []byte) (shard int, seq uint64, fire, dg int64, ok bool) {
	if len(k) != shardSeqKeyLen || k[0] != prefixWaiting || len(v) != waitingLen {
		return 0, 0, 0, 0, false
	}
	f, d := binary.BigEndian.Uint64(v[:8]), binary.BigEndian.Uint64(v[8:])
	if i := d >> heldDueBits; f >= heldBase || i == 0 || i > transportSlots<<heldGroupBits {
		return 0, 0, 0, 0, false
	}
	return int(binary.BigEndian.Uint16(k[1:3])), binary.BigEndian.Uint64(k[3:11]), int64(f), int64(d), true
}

// order is the replace/cancel stamp of CONTRACT §1.
type order struct {
	Stamp       int64
	Partition   int32
	Incarnation uint32
	Offset      int64
}

// newerThan reports whether a message at o supersedes one at old: in the
// same log (same partition and incarnation) the larger offset wins;
// otherwise, across partitions or across the logs a re-created topic or
// stream had, the later broker timestamp. A tie keeps the existing one.
func (o order) newerThan(old order) bool {
	if o.Partition == old.Partition && o.Incarnation == old.Incarnation {
		return o.Offset > old.Offset
	}
	return o.Stamp > old.Stamp
}

// indexEntry is the value of an i key: either the position of the pending
// task with that id, or a cancel marker remembered until Expiry.
type indexEntry struct {
	Cancel bool
	Shard  int
	Fire   int64
	Seq    uint64
	Order  order
	Expiry int64 // cancel markers only
}

// An index entry is version 1 (indexEntryLen bytes) when its order's
// incarnation is 0, as every entry before incarnations existed, and
// version 2, the same with the incarnation appended, otherwise.
const (
	indexVersion    = 1
	indexVersion2   = 2
	indexEntryLen   = 1 + 1 + 2 + 8 + 8 + 8 + 4 + 8 + 8
	indexEntryLen2  = indexEntryLen + 4
	indexKindTask   = 1
	indexKindCancel = 2
)

var errBadIndex = errors.New("shard: corrupt index entry")

func appendIndexEntry(dst []byte, e *indexEntry) []byte {
	kind := byte(indexKindTask)
	if e.Cancel {
		kind = indexKindCancel
	}
	version := byte(indexVersion)
	if e.Order.Incarnation != 0 {
		version = indexVersion2
	}
	dst = append(dst, version, kind)
	dst = binary.BigEndian.AppendUint16(dst, uint16(e.Shard))
	dst = binary.BigEndian.AppendUint64(dst, uint64(e.Fire))
	dst = binary.BigEndian.AppendUint64(dst, e.Seq)
	dst = binary.BigEndian.AppendUint64(dst, uint64(e.Order.Stamp))
	dst = binary.BigEndian.AppendUint32(dst, uint32(e.Order.Partition))
	dst = binary.BigEndian.AppendUint64(dst, uint64(e.Order.Offset))
	dst = binary.BigEndian.AppendUint64(dst, uint64(e.Expiry))
	if version == indexVersion2 {
		dst = binary.BigEndian.AppendUint32(dst, e.Order.Incarnation)
	}
	return dst
}

func decodeIndexEntry(b []byte, e *indexEntry) error {
	if len(b) < 2 || (b[1] != indexKindTask && b[1] != indexKindCancel) {
		return errBadIndex
	}
	var inc uint32
	switch {
	case b[0] == indexVersion && len(b) == indexEntryLen:
	case b[0] == indexVersion2 && len(b) == indexEntryLen2:
		// 0 is written as version 1: a version 2 entry with it was not
		// written by appendIndexEntry.
		if inc = binary.BigEndian.Uint32(b[indexEntryLen:]); inc == 0 {
			return errBadIndex
		}
	default:
		return errBadIndex
	}
	*e = indexEntry{
		Cancel: b[1] == indexKindCancel,
		Shard:  int(binary.BigEndian.Uint16(b[2:4])),
		Fire:   int64(binary.BigEndian.Uint64(b[4:12])),
		Seq:    binary.BigEndian.Uint64(b[12:20]),
		Order: order{
			Stamp:       int64(binary.BigEndian.Uint64(b[20:28])),
			Partition:   int32(binary.BigEndian.Uint32(b[28:32])),
			Offset:      int64(binary.BigEndian.Uint64(b[32:40])),
			Incarnation: inc,
		},
		Expiry: int64(binary.BigEndian.Uint64(b[40:48])),
	}
	return nil
}

// getIndex reads an index entry; found is false when there is none.
func getIndex(db *pebble.DB, key []byte, e *indexEntry) (found bool, err error) {
	v, closer, err := db.Get(key)
	if errors.Is(err, pebble.ErrNotFound) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("store: get index: %w", err)
	}
	err = decodeIndexEntry(v, e)
	closer.Close()
	if err != nil {
		return false, fmt.Errorf("store: index %q: %w", key, err)
	}
	return true, nil
}

// indexReader looks up index entries through one iterator per batch of
// lookups. Unlike DB.Get it consults the bloom filters of L6 too, where
// most ids live, so the common miss (a new id) reads no data block. The
// iterator is a snapshot: create it after taking the shard locks.
type indexReader struct {
	db *pebble.DB
	it *pebble.Iterator
}

func (r *indexReader) get(key []byte, e *indexEntry) (found bool, err error) {
	if r.it == nil {
		r.it, err = r.db.NewIter(&pebble.IterOptions{
			LowerBound:   []byte{prefixIndex},
			UpperBound:   []byte{prefixIndex + 1},
			UseL6Filters: true,
		})
		if err != nil {
			return false, fmt.Errorf("store: index iterator: %w", err)
		}
	}
	if !r.it.SeekPrefixGE(key) || !bytes.Equal(r.it.Key(), key) {
		if err := r.it.Error(); err != nil {
			return false, fmt.Errorf("store: seek index: %w", err)
		}
		return false, nil
	}
	v, err := r.it.ValueAndErr()
	if err != nil {
		return false, fmt.Errorf("store: read index: %w", err)
	}
	if err := decodeIndexEntry(v, e); err != nil {
		return false, fmt.Errorf("store: index %q: %w", key, err)
	}
	return true, nil
}

func (r *indexReader) close() {
	if r.it != nil {
		r.it.Close()
		r.it = nil
	}
}

// getU64 reads an 8-byte big-endian value (a counter, the sequence): ok
// false, and 0, when there is none of that size.
func getU64(db *pebble.DB, key []byte) (v uint64, ok bool, err error) {
	b, found, err := getCopy(db, key)
	if err != nil || !found || len(b) != 8 {
		return 0, false, err
	}
	return binary.BigEndian.Uint64(b), true, nil
}

// getCopy reads a value and copies it out of Pebble's buffer.
func getCopy(db *pebble.DB, key []byte) ([]byte, bool, error) {
	v, closer, err := db.Get(key)
	if errors.Is(err, pebble.ErrNotFound) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, err
	}
	out := append([]byte(nil), v...)
	closer.Close()
	return out, true, nil
}

// merger combines the counter (c, h: signed sum) and sequence (m: max)
// merge operands. Both operations are associative and commutative, so partial
// merges during compaction are correct too.
var merger = &pebble.Merger{
	Name: "delaybridge.counters.v1",
	Merge: func(key, value []byte) (pebble.ValueMerger, error) {
		if len(key) == 0 || (key[0] != prefixCount && key[0] != prefixHeld && key[0] != prefixSeq) {
			return nil, fmt.Errorf("store: merge on unexpected key %q", key)
		}
		m := &valueMerger{max: key[0] == prefixSeq}
		if err := m.MergeNewer(value); err != nil {
			return nil, err
		}
		return m, nil
	},
}

type valueMerger struct {
	max bool
	v   uint64
}

func (m *valueMerger) add(b []byte) error {
	if len(b) != 8 {
		return fmt.Errorf("store: merge operand of %d bytes", len(b))
	}
	x := binary.BigEndian.Uint64(b)
	if m.max {
		m.v = max(m.v, x)
	} else {
		m.v += x // two's complement: adding uint64(-1) subtracts
	}
	return nil
}

func (m *valueMerger) MergeNewer(b []byte) error { return m.add(b) }
func (m *valueMerger) MergeOlder(b []byte) error { return m.add(b) }
func (m *valueMerger) Finish(bool) ([]byte, io.Closer, error) {
	return u64(m.v), nil, nil
}

// pebbleLogger routes Pebble's log through zap.
type pebbleLogger struct{ l *zap.SugaredLogger }

func (p pebbleLogger) Infof(format string, args ...interface{})  { p.l.Debugf(format, args...) }
func (p pebbleLogger) Errorf(format string, args ...interface{}) { p.l.Errorf(format, args...) }

// Fatalf must not return: Pebble calls it when a commit failed and would
// otherwise report the commit as successful. It panics with pebbleFatal,
// which safeCall turns back into an error on the committing goroutine, so a
// failed WAL write becomes the engine's sticky store error instead of a
// silent acknowledgement. On Pebble's background goroutines the panic ends
// the process, as Pebble's own default logger would.
//
// Once Exiting was called it parks the goroutine instead: the process is
// about to exit without waiting, and what it cleans up meanwhile (dev's
// sandbox, the store's directory with it) must not make a closing store
// crash it first.
func (p pebbleLogger) Fatalf(format string, args ...interface{}) {
	msg := fmt.Sprintf(format, args...)
	if exiting.Load() {
		parkExiting()
	}
	p.l.Error(msg)
	panic(pebbleFatal{msg})
}

// exiting is set by Exiting; parkExiting parks a goroutine for good (a
// variable for tests).
var (
	exiting     atomic.Bool
	parkExiting = func() { select {} }
)

// Exiting tells the engines of this process that it exits now without
// waiting for them (a second signal): from then on a store error that
// Pebble reports as fatal parks the goroutine that met it rather than end
// the process with a panic before its own exit. A forced exit of `dev`
// removed the store's directory under a closing store, whose flush then
// crashed the process (exit status 2, not 130).
func Exiting() { exiting.Store(true) }

type pebbleFatal struct{ msg string }

// Error makes a pebbleFatal that no safeCall recovers (one on Pebble's own
// goroutines) print its cause, not a pointer, when it ends the process.
func (f pebbleFatal) Error() string { return "pebble: fatal: " + f.msg }

// safeCall runs a Pebble write and converts Pebble's fatal panic to an error.
func safeCall(f func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			f, ok := r.(pebbleFatal)
			if !ok {
				panic(r)
			}
			err = errors.New(f.msg)
		}
	}()
	return f()
}

// Store memory defaults (Options.CacheBytes, Options.MemTableBytes).
const (
	DefaultCacheBytes    = 768 << 20
	DefaultMemTableBytes = 128 << 20
	flushBlockBytes      = 32 << 10
)

// storeManifestBytes is the size at which Pebble starts a new MANIFEST
// (its log of the store's files) with a snapshot of the files; it keeps
// the one before too. Its default, 128 MiB, is for stores of many
// thousands of files: this one holds a few dozen to a few thousand (a
// snapshot of some KiB), while every flush and compaction appends about
// 160 bytes (hunt H205: 50 KB per 1.4 GB of 1 KiB tasks), so on a
// long-running store the two manifests grew to 256 MiB of a fixed volume
// (at 10 MB/s of tasks the current one reaches 128 MiB in about four
// days), all of it replayed at each start.
const storeManifestBytes = 8 << 20

// storeStallGrace is how long Pebble may hold writes back (a write stall)
// before the engine reports it (Err): a stall that long is not a burst
// of load but flushes or compactions that fail (a full disk) or cannot
// keep up, and every Ingest waits in it meanwhile.
const storeStallGrace = 5 * time.Second

// abandonedOpens counts the pebble.Open calls openPebble gave up waiting
// for; each closes its store if it completes. Tests wait for them.
var abandonedOpens sync.WaitGroup

// storeHealth follows Pebble's write stalls and background errors, which
// no write returns: a flush that fails (ENOSPC) is retried by Pebble at
// once and forever, while writes wait in the stall once the memtables
// are full.
type storeHealth struct {
	grace      time.Duration // storeStallGrace
	epoch      time.Time     // stallSince counts from it, on the monotonic clock
	log        *zap.Logger
	stallSince atomic.Int64 // ns since epoch, +1; 0 while writes flow
	stallWhy   atomic.Pointer[string]
	bgErr      atomic.Pointer[error]
	bgFirst    atomic.Int64         // ns since epoch, +1, of the first background error; 0: none yet
	bgCount    atomic.Int64         // background errors so far
	bgLog      logthrottle.Throttle // Pebble retries a failed flush at once and forever
}

func newStoreHealth(grace time.Duration) *storeHealth {
	return &storeHealth{grace: grace, epoch: time.Now(), bgLog: logthrottle.Throttle{Every: 10 * time.Second}}
}

func (h *storeHealth) listener() *pebble.EventListener {
	return &pebble.EventListener{
		WriteStallBegin: func(info pebble.WriteStallBeginInfo) {
			why := info.Reason
			h.stallWhy.Store(&why)
			h.stallSince.CompareAndSwap(0, int64(time.Since(h.epoch))+1)
		},
		WriteStallEnd: func() { h.stallSince.Store(0) },
		BackgroundError: func(err error) {
			h.bgErr.Store(&err)
			h.bgFirst.CompareAndSwap(0, int64(time.Since(h.epoch))+1)
			h.bgCount.Add(1)
			if held, ok := h.bgLog.Allow(time.Now()); ok {
				h.log.Error("store background error (a flush or compaction failed; Pebble retries it)",
					zap.Error(err), zap.Int("held_back", held))
			}
		},
	}
}

// stalled reports since when (ns since epoch, +1) Pebble holds writes
// back; 0 while writes flow or without h.
func (h *storeHealth) stalled() int64 {
	if h == nil {
		return 0
	}
	return h.stallSince.Load()
}

// err reports a write stall that has lasted the grace, with Pebble's
// reason and its last background error.
func (h *storeHealth) err() error {
	since := h.stallSince.Load()
	if since == 0 {
		return nil
	}
	d := time.Since(h.epoch) - time.Duration(since-1)
	if d < h.grace {
		return nil
	}
	msg := fmt.Sprintf("writes held for %s", d.Truncate(time.Second))
	if p := h.stallWhy.Load(); p != nil {
		msg += " (" + *p + ")"
	}
	if p := h.bgErr.Load(); p != nil {
		msg += "; last background error: " + (*p).Error()
	}
	return fmt.Errorf("%w: %s", ErrStoreStalled, msg)
}

// storeOpenGrace is how long Open lets Pebble retry a failing flush of the
// WAL it replays before it gives up (openWaiting).
const storeOpenGrace = 30 * time.Second

// openWaiting is pebble.Open, except that it does not wait forever for a
// flush that keeps failing. Pebble flushes the memtables it replays from
// the WAL before Open returns, and retries a failed flush at once and
// forever: on a full (or read-only) volume pebble.Open never returns, and
// the process would hang in its start, serving no probe, ignoring SIGTERM,
// spinning a core and leaving an empty blob file behind per try, while the
// log only says that Pebble retries. Once background errors have kept
// coming for grace (at least 3, the first grace ago: a slow flush that
// then succeeds does not count), openWaiting returns the last one with
// what to do, and leaves the open to the process exit; should it complete
// (tests free the space), its store is closed. A cancelled ctx (SIGTERM
// during the start) ends the wait the same way, at once.
func openWaiting(ctx context.Context, dir string, po *pebble.Options, health *storeHealth, grace time.Duration) (*pebble.DB, error) {
	if health == nil {
		return pebble.Open(dir, po)
	}
	if grace <= 0 {
		grace = storeOpenGrace
	}
	type result struct {
		db  *pebble.DB
		err error
	}
	done := make(chan result, 1)
	go func() {
		db, err := pebble.Open(dir, po)
		done <- result{db, err}
	}()
	abandon := func() {
		abandonedOpens.Add(1)
		go func() {
			defer abandonedOpens.Done()
			if r := <-done; r.db != nil {
				_ = r.db.Close()
			}
		}()
	}
	tick := time.NewTicker(min(grace/4, time.Second))
	defer tick.Stop()
	for {
		select {
		case r := <-done:
			return r.db, r.err
		case <-ctx.Done():
			abandon()
			return nil, fmt.Errorf("stopped while the store was opening (replaying its write-ahead log; the store is intact): %w", context.Cause(ctx))
		case <-tick.C:
		}
		first := health.bgFirst.Load()
		if first == 0 || health.bgCount.Load() < 3 {
			continue
		}
		failing := time.Since(health.epoch) - time.Duration(first-1)
		if failing < grace {
			continue
		}
		abandon()
		err := *health.bgErr.Load()
		return nil, fmt.Errorf("replaying the write-ahead log: its flush has failed %d times in %s (%w); %s",
			health.bgCount.Load(), failing.Truncate(time.Second), err, openFailHint(err))
	}
}

// openFailHint says what an operator can do about a flush that keeps
// failing while the store opens.
func openFailHint(err error) string {
	const intact = "the store is intact (the tasks are in its WAL)"
	switch {
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		return "the volume is full (of bytes or inodes): free space on it or grow it, then start again; " + intact
	case errors.Is(err, syscall.EROFS):
		return "the volume is read-only: remount it read-write (after a file system check if the kernel made it read-only), then start again; " + intact
	default:
		return "check the volume (space, inodes, I/O errors in the kernel log), then start again; " + intact
	}
}

// openPebble opens the store in dir. With health, an open whose WAL
// replay cannot be flushed gives up after openGrace (0: storeOpenGrace):
// see openWaiting.
func openPebble(ctx context.Context, dir string, fs vfs.FS, log *zap.Logger, cacheBytes, memTableBytes int64, health *storeHealth, openGrace time.Duration, noBlockCache bool) (*pebble.DB, error) {
	if fs == nil {
		fs = vfs.Default
	}
	if cacheBytes <= 0 {
		cacheBytes = DefaultCacheBytes
	}
	if memTableBytes <= 0 {
		memTableBytes = DefaultMemTableBytes
	}
	memTableBytes = min(memTableBytes, cacheBytes/2)
	blockCacheBytes := cacheBytes
	if noBlockCache {
		blockCacheBytes = 0 // each cache shard's target is then 1 byte: no block fits
	}
	cache := pebble.NewCache(blockCacheBytes)
	defer cache.Unref()
	po := &pebble.Options{
		FS:     fs,
		Cache:  cache,
		Merger: merger,
		// Pebble reserves each memtable from the cache: two of them (one
		// filling, one flushing) leave the rest of it for blocks (index
		// entries, filters, envelopes read at fire time).
		MemTableSize:                uint64(memTableBytes),
		MemTableStopWritesThreshold: 2,
		L0CompactionThreshold:       4,
		L0StopWritesThreshold:       24,
		MaxManifestFileSize:         storeManifestBytes,
		Logger:                      pebbleLogger{log.Named("pebble").Sugar()},
	}
	if health != nil {
		health.log = log.Named("pebble")
		po.EventListener = health.listener()
	}
	// Envelopes (~1 KB) go to blob files once flushed: compactions move
	// only keys, and the recovery/horizon scans, which need only the keys,
	// do not read the payloads.
	po.FormatMajorVersion = pebble.FormatValueSeparation
	po.Experimental.ValueSeparationPolicy = func() pebble.ValueSeparationPolicy {
		return pebble.ValueSeparationPolicy{
			Enabled:               true,
			MinimumSize:           256,
			MaxBlobReferenceDepth: 10,
			RewriteMinimumAge:     10 * time.Minute,
			TargetGarbageRatio:    0.3,
		}
	}
	for i := range po.Levels {
		// Ingest looks up the index of every new id; most are misses.
		po.Levels[i].FilterPolicy = bloom.FilterPolicy(10)
	}
	// Flushes write the envelopes to blob files in blocks of L0's size,
	// and a fire loop reads them back in about that order: 32 KiB blocks
	// instead of 4 KiB ones took a tenth off the bridge's CPU per message
	// (one block read, cache allocation and checksum per ~28 envelopes,
	// not per ~3). Deeper levels keep 4 KiB blocks for the index lookups
	// that do read a block.
	po.Levels[0].BlockSize = flushBlockBytes
	db, err := openWaiting(ctx, dir, po, health, openGrace)
	if errors.Is(err, syscall.EAGAIN) || errors.Is(err, syscall.EWOULDBLOCK) {
		// Pebble's LOCK file is held: another process has the store open.
		return nil, fmt.Errorf("store: open %s: the store is in use by another process (another delaybridge on this data_dir?): %w", dir, err)
	}
	if err != nil {
		return nil, fmt.Errorf("store: open %s: %w", dir, err)
	}
	return db, nil
}
