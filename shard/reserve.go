package shard

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/metrics"
)

// volumeStats is what statfs says of the volume holding the store.
type volumeStats struct {
	Free       uint64 // bytes an unprivileged process may still use (f_bavail)
	Size       uint64 // bytes in all
	FreeInodes uint64
	Inodes     uint64 // 0: the file system does not count them
}

// Disk reserve checks: at most one statfs a second, or after
// reserveCheckShare of the reserve was ingested since the last one
// (reserveCheckMinBytes at least), so a fast ingest cannot write through
// much of the reserve between two checks.
const (
	reserveCheckEvery    = time.Second
	reserveCheckShare    = 16
	reserveCheckMinBytes = 1 << 20
)

// reserveFlushEvery: while the reserve holds ingest, the memtable is
// flushed this often (and when it engages). The fired tasks' deletions
// free nothing while they sit in the memtable: with no message taken in
// it would not fill and flush for a long time, and the volume would stay
// below the reserve with every task delivered (hunt D155: a 300 MiB
// volume held 196 MiB of blob files of deleted tasks for minutes). Once
// flushed, Pebble's compactions drop the deleted tasks and their blob
// files within seconds. The flush rotates the write-ahead log, which the
// reserve has room for.
const reserveFlushEvery = 10 * time.Second

// diskReserve keeps Ingest from filling the store's volume: below
// Options.ReserveBytes free it refuses batches (ErrStoreLowSpace) until
// the volume has a tenth more than the reserve free again. The room it
// keeps is for what must still be written: Pebble preallocates each new
// write-ahead log at 1.1 × the memtable size, and a flush or compaction
// writes before it deletes; a write that fails for want of space makes
// the store refuse every write until a restart (and Pebble may end the
// process while closing a full log), while fires and deletes, which go on,
// free space.
type diskReserve struct {
	dir        string
	reserve    uint64 // bytes; 0: no reserve
	resume     uint64 // an engaged reserve clears at this much free
	every      time.Duration
	everyBytes int64
	stat       func(dir string) (volumeStats, error)
	log        *zap.Logger
	// flush starts a flush of the memtable (Engine.reclaimFlush), run in
	// its own goroutine; flushEvery is reserveFlushEvery (negative: at
	// each check while engaged).
	flush      func()
	flushEvery time.Duration
	lastFlush  int64 // under mu; -1: none yet

	mu      sync.Mutex   // one check at a time
	last    atomic.Int64 // time of the last check, ns since epoch (monotonic)
	epoch   time.Time
	written atomic.Int64 // bytes ingested since the last check
	low     atomic.Pointer[volumeStats]
	statErr atomic.Bool // a failed statfs was logged
}

func newDiskReserve(o *Options, log *zap.Logger) *diskReserve {
	r := &diskReserve{dir: o.Dir, every: o.reserveCheckEvery, stat: o.statVolume, log: log, epoch: time.Now(),
		flushEvery: o.reserveFlushEvery, lastFlush: -1}
	if o.ReserveBytes > 0 {
		r.reserve = uint64(o.ReserveBytes)
	}
	r.resume = r.reserve + max(r.reserve/10, 1<<20)
	r.everyBytes = max(o.ReserveBytes/reserveCheckShare, reserveCheckMinBytes)
	if r.every == 0 {
		r.every = reserveCheckEvery
	}
	if r.stat == nil {
		r.stat = statVolume
	}
	if r.flushEvery == 0 {
		r.flushEvery = reserveFlushEvery
	}
	r.last.Store(-1) // checked at the first call
	return r
}

// wrote counts n bytes ingested towards the next check.
func (r *diskReserve) wrote(n int) {
	if r.reserve != 0 {
		r.written.Add(int64(n))
	}
}

// refresh reads the volume's free space if the last check is old enough
// (every, or everyBytes ingested since; every < 0: at each call), and
// engages or clears the reserve. A goroutine that finds another one
// checking goes on with the state as it is.
func (r *diskReserve) refresh() {
	if r.reserve == 0 {
		return
	}
	now := int64(time.Since(r.epoch))
	if last := r.last.Load(); last >= 0 && r.every > 0 && now-last < int64(r.every) && r.written.Load() < r.everyBytes {
		return
	}
	if !r.mu.TryLock() {
		return
	}
	defer r.mu.Unlock()
	r.last.Store(now)
	r.written.Store(0)
	st, err := r.stat(r.dir)
	if err != nil {
		// The reserve then holds nothing back: a volume whose space
		// cannot be read is not taken for a full one.
		if !r.statErr.Swap(true) {
			r.log.Warn("cannot read the free space of the store's volume; store.reserve_mb is not enforced",
				zap.String("data_dir", r.dir), zap.Error(err))
		}
		return
	}
	r.statErr.Store(false)
	engaged := r.low.Load() != nil
	switch {
	case !engaged && st.Free < r.reserve:
		r.low.Store(&st)
		r.log.Warn("store volume low on space: taking no messages in until it has room again (fires and deletes go on); grow the volume or lower store.reserve_mb",
			zap.String("data_dir", r.dir), zap.Uint64("free_mib", st.Free>>20),
			zap.Uint64("reserve_mib", r.reserve>>20), zap.Uint64("resume_at_mib", r.resume>>20))
	case engaged && st.Free >= r.resume:
		r.low.Store(nil)
		r.log.Info("store volume has room again: taking messages in",
			zap.String("data_dir", r.dir), zap.Uint64("free_mib", st.Free>>20), zap.Uint64("reserve_mib", r.reserve>>20))
	case engaged:
		r.low.Store(&st) // the free space err reports
	}
	if r.low.Load() != nil && r.flush != nil && (r.lastFlush < 0 || r.flushEvery < 0 || now-r.lastFlush >= int64(r.flushEvery)) {
		r.lastFlush = now
		go r.flush()
	}
}

// err reports an engaged reserve (ErrStoreLowSpace).
func (r *diskReserve) err() error {
	st := r.low.Load()
	if st == nil {
		return nil
	}
	return fmt.Errorf("%w: %d MiB free, reserve %d MiB (store.reserve_mb); taking no messages in until %d MiB are free",
		ErrStoreLowSpace, st.Free>>20, r.reserve>>20, r.resume>>20)
}

// reclaimFlush flushes the memtable so that the deletions of fired tasks
// reach the files and free their space (reserveFlushEvery). It does not
// wait for the flush.
func (e *Engine) reclaimFlush() {
	flushed := e.startReclaimFlush()
	if h := e.testHookReclaimFlush; h != nil {
		h(flushed)
	}
}

func (e *Engine) startReclaimFlush() <-chan struct{} {
	e.closeMu.RLock()
	defer e.closeMu.RUnlock()
	if e.closed || e.failed() != nil {
		return nil
	}
	var flushed <-chan struct{}
	err := safeCall(func() error {
		var err error
		flushed, err = e.db.AsyncFlush()
		return err
	})
	if err != nil {
		e.log.Warn("store volume low on space: flushing the store to free the space of delivered tasks failed", zap.Error(err))
		return nil
	}
	return flushed
}

// diskStats is what a scrape exports of the store's disk
// (metrics.StoreDisk).
func (e *Engine) diskStats() metrics.StoreDisk {
	d := metrics.StoreDisk{ReserveBytes: e.reserve.reserve}
	if st, err := e.reserve.stat(e.opts.Dir); err == nil {
		d.Volume = true
		d.FreeBytes, d.SizeBytes, d.FreeInodes, d.Inodes = st.Free, st.Size, st.FreeInodes, st.Inodes
	}
	if e.opts.FS == nil {
		if n, err := dirAllocated(e.opts.Dir); err == nil {
			d.StoreBytes = n
			return d
		}
	}
	// Another file system (tests): what Pebble counts of its files.
	e.closeMu.RLock()
	defer e.closeMu.RUnlock()
	if !e.closed {
		d.StoreBytes = e.db.Metrics().DiskSpaceUsage()
	}
	return d
}

// dirAllocated is the space the files in dir take on their volume, as du
// counts it. Pebble's own count (Metrics.DiskSpaceUsage) is of the files'
// lengths, and misses what it preallocated for its write-ahead logs: a
// new store on an 800 MiB tmpfs took 440 MiB of it while Pebble counted
// 22. Pebble keeps its files in dir itself; subdirectories (lost+found at
// a volume's root, which the bridge's user may not read) are not counted,
// and a file that goes away meanwhile is skipped.
func dirAllocated(dir string) (uint64, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return 0, fmt.Errorf("size of %s: %w", dir, err)
	}
	var n uint64
	for _, de := range ents {
		if de.IsDir() {
			continue
		}
		fi, err := de.Info()
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return 0, fmt.Errorf("size of %s: %w", dir, err)
		}
		n += allocatedBytes(fi)
	}
	return n, nil
}
