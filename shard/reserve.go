package shard

import (
	"context"
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

// quietFlushAfter: a memtable that took writes since the last flush the
// engine started is flushed once no flush has come for this long
// (Engine.quietFlushLoop). The deletions of delivered tasks free nothing
// while they sit in the memtable, and a memtable only flushes when it is
// full: a store that went quiet after a burst kept the burst's files,
// delivered, until another memtable_mb of writes came, hours or days at a
// low rate (hunt H205: 10 cycles of 100 k tasks, all delivered, held 124
// MiB of blob files and tables of delivered tasks through 10 idle
// minutes, and 0 after a flush). A memtable of deletions covers far more
// than its own size of stored payloads (about 130 bytes a task: 128 MiB
// of them cover 1 GB of 1 KiB tasks, 60 GB of 64 KiB ones), so a quiet
// store could keep nearly its whole volume and trip the disk reserve
// and alert with nothing pending. Under load the memtable fills sooner
// than this, so the check does nothing there.
const quietFlushAfter = time.Minute

// quietFlushLoop flushes the memtable (reclaimFlush) once it took writes
// since the last flush started here and no flush, Pebble's own (a full
// memtable) or one started here, came for quietFlushAfter, and once
// after Run starts for what was written before. A store that takes no
// writes is not flushed again. Run runs it until ctx is done,
// on the engine's clock.
func (e *Engine) quietFlushLoop(ctx context.Context) {
	after := e.opts.quietFlushAfter
	if after == 0 {
		after = quietFlushAfter
	}
	if after < 0 {
		return
	}
	check := max(after/4, time.Millisecond)
	m := e.db.Metrics()
	flushes, written, last := m.Flush.Count, m.WAL.BytesIn, e.clk.Now()
	// owed: what was written before Run (an Ingest, Open's own clean-up,
	// a WAL replayed at open) may sit in the memtable; counted from
	// written alone it was flushed only after a later write
	// (TestQuietFlushOfWritesBeforeRun). One flush here pays it.
	owed := true
	timer := e.clk.NewTimer(check)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-timer.C():
		}
		now := e.clk.Now()
		m := e.db.Metrics()
		if m.Flush.Count != flushes {
			// Pebble flushed: what was written until then is in the
			// files. What came after its switch of memtables is not
			// told apart: written stays, and at worst one flush more
			// comes after it.
			flushes, last = m.Flush.Count, now
		}
		// Not while a flush is queued or running (more than the one
		// mutable memtable), nor during a write stall: a flush that
		// fails (a full disk) would only queue another memtable and
		// log behind it.
		if (m.WAL.BytesIn != written || owed) && now.Sub(last) >= after && m.MemTable.Count <= 1 && e.health.stalled() == 0 && e.failed() == nil {
			written, last, owed = m.WAL.BytesIn, now, false
			e.reclaimFlush()
		}
		timer.Reset(check)
	}
}

// reclaimFlush flushes the memtable so that the deletions of fired tasks
// reach the files and free their space (reserveFlushEvery,
// quietFlushAfter). It does not wait for the flush.
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
	// A flush rotates the WAL in the store's directory: one removed from
	// under the store is fatal to Pebble in a way no recover survives
	// (see close). An idle engine's quiet flush ended the process a
	// minute after its last write (TestQuietFlushWithStoreDirGone).
	if err := e.storeDirReadable(); err != nil {
		e.log.Warn("flushing the store to free the space of delivered tasks skipped: its directory cannot be read", zap.Error(err))
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
