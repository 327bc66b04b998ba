package shard

import (
	"context"
	"errors"
	"strconv"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/clock"
	"github.com/delaybridge/delaybridge/metrics"
)

// Errors callers branch on.
var (
	// ErrClosed is returned by calls on a closed engine.
	ErrClosed = errors.New("shard: engine closed")
	// ErrStoreFormat means the store was written by a newer delaybridge,
	// in a format this binary does not read: Open refuses it rather than
	// misread it.
	ErrStoreFormat = errors.New("shard: store written in a newer format")
	// ErrStoreFailed wraps the sticky store write error: after one failed
	// synced commit the store refuses every write until reopened.
	ErrStoreFailed = errors.New("shard: store failed")
	// ErrStoreStalled is reported by Err while Pebble has held every
	// write back for a while: its flushes or compactions fail (a full
	// disk) or cannot keep up. Ingest waits meanwhile.
	ErrStoreStalled = errors.New("shard: store stalled")
	// ErrStoreLowSpace is returned by Ingest, and reported by Err, while
	// the volume holding the store has less than Options.ReserveBytes
	// free: nothing of the batch is written; retry it later. Fires and
	// deletes go on (they free space), and the reserve clears by itself
	// once a tenth more than it is free again.
	ErrStoreLowSpace = errors.New("shard: store volume low on space")
	// ErrNotFound is returned by Lookup and Cancel for an unknown task.
	ErrNotFound = errors.New("shard: task not found")
	// ErrUnavailable is wrapped by a Sink's error for a task whose target
	// broker could not be reached (no connection, or the cluster answered
	// that it cannot take writes now). The engine retries such a task
	// without charging an attempt, so an outage of any length never
	// dead-letters it as publish-failed.
	ErrUnavailable = errors.New("shard: target broker unavailable")
	// ErrRefused is wrapped by a Sink's error for a task the target
	// refused as this message, so it will never take it as is: larger
	// than the destination allows, or a record the broker rejects itself.
	// It is not wrapped for a failure of the destination as a whole (no
	// permission to write it, no stream for the subject, a full stream):
	// those heal when the operator fixes the destination. For a task it
	// changes nothing (it is charged an attempt like any failure); a dead
	// letter its DLQ refuses this way Retry.MaxAttempts times is parked
	// (see DeadLetters.Wait), while any other DLQ failure holds its
	// source.
	ErrRefused = errors.New("shard: target refused the message itself; it will never take it as is")
)

// RejectedError is returned by a Sink (possibly wrapped) for a task it
// will not publish at all, whatever the broker says: the config it runs
// with refuses the task's target (targets.allow narrowed after the task
// was stored, say). The engine charges no retries: the task becomes a dead
// letter at once, with Code and the error as its detail, and no attempt
// counted. A Sink must not return one for a dead letter (its DLQ is the
// operator's): there it is a failure of the DLQ like any other.
type RejectedError struct {
	Code codec.Code
	Err  error
}

func (e *RejectedError) Error() string { return e.Err.Error() }
func (e *RejectedError) Unwrap() error { return e.Err }

// Sink delivers due tasks. Deliver returns after the broker acknowledged
// (or refused) every task of the batch: a nil slice means all were
// acknowledged, otherwise errs[i] is the error for batch[i] (nil = acked).
// The engine deletes a task only after its delivery was acknowledged.
// Deliver must not keep the slice or the tasks after it returns.
type Sink interface {
	Deliver(ctx context.Context, batch []*codec.Task) (errs []error)
}

// Checkpoint is the high-water offset of a source partition, stored in the
// same synced commit as the tasks that message produced. Key is chosen by
// the source adapter (e.g. "kafka|topic|3", "nats|DELAY|delaybridge").
type Checkpoint struct {
	Key    string
	Offset int64
	// Fingerprint, when not 0, identifies the message at Offset, so the
	// source can tell on restart whether the log it resumes is the one
	// the checkpoint was taken from (the Kafka source: a hash of the
	// record; a topic deleted and created again numbers from 0). 0 means
	// none: it is not stored, and a checkpoint stored without one (NATS,
	// or by an older version) reads back with 0.
	Fingerprint uint64
	// Incarnation is the log of the source partition the offset counts
	// in: 0 for the first one read, one more for each time the source
	// found its topic or stream deleted and created again (see
	// codec.Task.Incarnation). Stored when not 0.
	Incarnation uint32
	// Aside marks a record a source keeps beside its position (the NATS
	// source's spans of sequences held above its floor), not a position
	// it resumes from: a batch's dead letters are not awaited under it
	// (see AwaitStored). Not stored.
	Aside bool
}

// RetryPolicy is the backoff for fire-time publish failures.
type RetryPolicy struct {
	Initial     time.Duration // first backoff; default 500ms
	Max         time.Duration // cap; default 5m
	Multiplier  float64       // default 2
	Jitter      float64       // +-fraction of each backoff; default 0.2, negative: none
	MaxAttempts int           // then dead-letter publish-failed; default 10
}

// Options configure an Engine. Zero values take the documented defaults.
type Options struct {
	Dir    string // Pebble directory; required
	FS     vfs.FS // nil: the OS file system (tests inject errors here)
	Shards int    // default 8
	// Horizon bounds memory: the wheels hold only tasks due before
	// now+Horizon, the rest stays on disk until the loader reaches it.
	Horizon   time.Duration // default 10m
	FireBatch int           // max tasks per Deliver call; default 512
	// FireBatchBytes bounds the stored envelopes (plus 40 bytes a header,
	// their decoded cost) a fire round reads into memory: the rest of its
	// claim goes back to the wheel for the next round. At least one task is
	// read. Default 4 MiB.
	FireBatchBytes int
	// LaneGrace is how long (real time) a fire batch may be in the sink
	// before its target transport's lane counts as stuck: the shard then
	// claims and delivers the other transport's due tasks without waiting
	// for it (see lane.go). Default 2s.
	LaneGrace time.Duration
	// OutageMemory is how many tasks waiting for an unreachable target
	// each shard keeps in memory (110-290 bytes each); beyond it such
	// tasks are held on disk and released once the target answers again
	// (hold.go). Default 65536; negative: none (every such task is held
	// on disk).
	OutageMemory int
	// CacheBytes is Pebble's memory: its block cache, from which the
	// memtables are reserved too. Default DefaultCacheBytes.
	CacheBytes int64
	// MemTableBytes is the size of one Pebble memtable; at most two are in
	// memory (one filling, one flushing). A task fired and deleted while
	// its memtable is still in memory never reaches a file, so short
	// delays at high rates want it large; but Pebble flushes the memtables
	// replayed from the WAL before Open returns, so after a crash recovery
	// takes longer the larger they are (with 1 M pending: 1-1.4 s for two
	// 128 MiB ones, about 3 s for two of 256 MiB). Default
	// DefaultMemTableBytes; at most CacheBytes/2.
	MemTableBytes int64
	// ReserveBytes is the free space Ingest leaves on the volume holding
	// Dir: below it, Ingest refuses batches that hold tasks with
	// ErrStoreLowSpace (checkpoint-only ones are taken), so the store
	// never fills the volume by taking messages in. It should be room for
	// two write-ahead logs at least (2 × 1.1 × MemTableBytes), which
	// Pebble preallocates. 0 (the default): none. Off Linux it is not
	// enforced.
	ReserveBytes    int64
	Retry           RetryPolicy
	CancelRetention time.Duration    // default 24h; negative: none (a cancel only deletes what is pending)
	Clock           clock.Clock      // default clock.Real{}
	Logger          *zap.Logger      // default zap.NewNop()
	Metrics         *metrics.Metrics // default: unregistered instruments

	filterMinKeys int           // capacity of all index filters together, at least; tests lower it
	stallGrace    time.Duration // default storeStallGrace; tests lower it
	openGrace     time.Duration // default storeOpenGrace; tests lower it
	// noBlockCache (tests): no block stays in Pebble's cache, so every
	// read goes to the files and a fault injected there is met. A small
	// CacheBytes is not enough: the blocks it keeps depend on the
	// memtables reserved from it at the time (one recycled after a flush
	// or not), and a test aiming a fault at one read found it cached.
	noBlockCache bool
	// statVolume reads the free space of the store's volume (default
	// statVolume: statfs); tests inject a volume.
	statVolume func(dir string) (volumeStats, error)
	// reserveCheckEvery is how long the reserve's last check counts
	// (default reserveCheckEvery); negative: check at every call.
	reserveCheckEvery time.Duration
	// reserveFlushEvery is how often the memtable is flushed while the
	// reserve holds ingest (default reserveFlushEvery); negative: at
	// each check.
	reserveFlushEvery time.Duration
	// quietFlushAfter is how long a memtable that took writes waits for
	// a flush before the engine starts one (default quietFlushAfter);
	// negative: never.
	quietFlushAfter time.Duration
}

// TaskInfo is what Lookup reports of a pending task.
type TaskInfo struct {
	Source   string `json:"source"`
	ID       string `json:"id"`
	Due      Time   `json:"due"`                // scheduled due (delay-due)
	NextFire Time   `json:"next_fire,omitzero"` // differs from Due after failed publishes; zero when held
	// Held: its target was unreachable and the task waits on disk until
	// a delivery to that transport succeeds again (no next fire time).
	Held     bool   `json:"held,omitempty"`
	Target   string `json:"target"` // "kafka:NAME" or "nats:SUBJECT"
	Origin   string `json:"origin"`
	Attempts uint32 `json:"attempts"`
	Shard    int    `json:"shard"`
}

// ShardStats describes one shard.
type ShardStats struct {
	Shard   int   `json:"shard"`
	Pending int64 `json:"pending"`
	// InWheel counts the shard's wheel entries: tasks due within the
	// horizon, and the entries of replaced or cancelled ones, which stay
	// until their due time and are skipped then (so it may exceed Pending).
	InWheel int `json:"in_wheel"`
	// Held counts the pending tasks held on disk until their target
	// broker answers again (Options.OutageMemory).
	Held int64 `json:"held"`
	// NextDue is the earliest fire time of the shard's stored tasks (a
	// task waiting for a retry fires at its retry time), zero if none.
	NextDue Time `json:"next_due,omitzero"`
	// OldestOverdue is the earliest due time that has passed without the
	// task being delivered yet (including tasks waiting for a retry after
	// a failed publish), zero if none.
	OldestOverdue Time `json:"oldest_overdue,omitzero"`
}

// Stats describes the engine.
type Stats struct {
	Shards        []ShardStats `json:"shards"`
	Pending       int64        `json:"pending"`
	Held          int64        `json:"held"`
	NextDue       Time         `json:"next_due,omitzero"`
	OldestOverdue Time         `json:"oldest_overdue,omitzero"`
	Horizon       Time         `json:"horizon"`
}

// Time is a time.Time that JSON-encodes the way delay-due is written
// (codec.FormatDue: RFC 3339 in UTC with exactly three fractional
// digits), so an admin answer's due reads the same as the header a
// consumer dedups on; a plain time.Time drops trailing zeros (".120Z"
// becomes ".12Z", ".000Z" nothing). The admin API's times are whole
// milliseconds.
type Time struct{ time.Time }

// msTime is the Time of a store's milliseconds since the epoch.
func msTime(ms int64) Time { return Time{time.UnixMilli(ms).UTC()} }

// MarshalJSON writes t as codec.FormatDue does.
func (t Time) MarshalJSON() ([]byte, error) {
	if y := t.Year(); y < 0 || y > 9999 {
		return t.Time.MarshalJSON() // its error: no RFC 3339 form
	}
	return strconv.AppendQuote(nil, codec.FormatDue(t.UnixMilli())), nil
}
