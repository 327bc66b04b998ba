package shard

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/cockroachdb/pebble/v2"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
)

// Limits of ListTasks.
const (
	DefaultListLimit = 100
	MaxListLimit     = 1000
	// maxListSkip bounds the index entries one page steps over without
	// listing them (cancel markers, entries whose envelope is gone or does
	// not decode): a source with a million remembered cancels costs a
	// page at most this many entry reads, not a million.
	maxListSkip = 10 * MaxListLimit
)

// ErrBadListQuery is returned by ListTasks for a query it cannot answer:
// an empty source, or one with a NUL byte (no source has one: NUL ends
// the source in the index keys, so such a name would list another
// source's ids).
var ErrBadListQuery = errors.New("shard: bad task list query")

// ListQuery selects a page of ListTasks.
type ListQuery struct {
	// Prefix: only the ids that start with it ("": every id).
	Prefix string
	// After: only the ids after it in byte order, it excluded ("": from
	// the first). The Next of a page is the After of the next one.
	After string
	// Limit: at most this many tasks; 0 or less is DefaultListLimit,
	// more than MaxListLimit is MaxListLimit.
	Limit int
}

// TaskList is a page of ListTasks.
type TaskList struct {
	// Tasks in id order (byte order); never nil, so it encodes as [].
	Tasks []TaskInfo `json:"tasks"`
	// Next, when not "", is the After of the next page: there may be more
	// tasks after it. It is the last id of Tasks, or, when the page
	// stopped after stepping over maxListSkip entries it does not list
	// (Tasks may then be shorter than the limit, even empty), the last id
	// it stepped over. "": the page reached the end of the prefix.
	Next string `json:"next,omitempty"`
}

// testHookListEntry, when set (tests), is called by ListTasks with each
// pending entry's id after it read the entry and before it reads the
// task's envelope.
var testHookListEntry func(id string)

// ListTasks lists the pending tasks of source whose id starts with
// q.Prefix, in id order, after q.After, at most q.Limit of them (see
// ListQuery), as Lookup would report each.
//
// The page is a point-in-time view of the store: its index entries and
// the envelopes they point to are read from one state of it (one Pebble
// iterator and its clone), without any shard lock, so a page does not
// hold up the fire loops or Ingest however long the disk takes. A task
// fired, cancelled or moved (retried, held) after that state was taken
// is listed as it was then; decisions not yet applied to the store
// (Lookup waits for those) are not seen yet. Pages are separate views:
// a task scheduled between two pages is listed if its id comes after the
// first page's Next. Cancel markers are not tasks and are left out, and
// so is an entry whose envelope is missing in that state or does not
// decode (Lookup reports the decode error; GET /v1/stuck lists such
// envelopes once the fire loop met them); those left out for a bad
// encoding are logged, once per call.
func (e *Engine) ListTasks(source string, q ListQuery) (TaskList, error) {
	if source == "" || strings.IndexByte(source, 0) >= 0 {
		return TaskList{}, fmt.Errorf("%w: source %q: want a non-empty name without NUL bytes", ErrBadListQuery, source)
	}
	limit := q.Limit
	if limit <= 0 {
		limit = DefaultListLimit
	}
	limit = min(limit, MaxListLimit)
	e.closeMu.RLock()
	defer e.closeMu.RUnlock()
	if e.closed {
		return TaskList{}, ErrClosed
	}
	base := appendIndexKey(nil, source, "") // i source 0x00
	lower := append(slices.Clip(base), q.Prefix...)
	start := lower
	if q.After != "" {
		// The smallest key after After's.
		after := append(append(slices.Clip(base), q.After...), 0)
		if bytes.Compare(after, start) > 0 {
			start = after
		}
	}
	idx, err := e.db.NewIter(&pebble.IterOptions{LowerBound: lower, UpperBound: prefixEnd(lower)})
	if err != nil {
		return TaskList{}, fmt.Errorf("shard: list %s: %w", source, err)
	}
	defer idx.Close()
	var tasks *pebble.Iterator // idx's clone over the task keys, made at the first pending entry
	defer func() {
		if tasks != nil {
			tasks.Close()
		}
	}()
	list := TaskList{Tasks: []TaskInfo{}}
	var (
		skipped int
		bad     int    // entries or envelopes that did not decode
		badID   string // the first of them
		badErr  error
	)
	var id string // the entry's id; at the top of the loop, the last one done with
	for ok := idx.SeekGE(start); ok; ok = idx.Next() {
		if skipped >= maxListSkip {
			// The entries stepped over are done with: the next page goes
			// on after the last of them.
			list.Next = id
			break
		}
		id = string(idx.Key()[len(base):])
		v, err := idx.ValueAndErr()
		if err != nil {
			return TaskList{}, fmt.Errorf("shard: list %s: read index: %w", source, err)
		}
		var ex indexEntry
		if err := decodeIndexEntry(v, &ex); err != nil {
			skipped++
			if bad++; bad == 1 {
				badID, badErr = id, err
			}
			continue
		}
		if ex.Cancel {
			skipped++
			continue
		}
		if len(list.Tasks) == limit {
			list.Next = list.Tasks[limit-1].ID
			break
		}
		if testHookListEntry != nil {
			testHookListEntry(id)
		}
		if tasks == nil {
			tasks, err = idx.Clone(pebble.CloneOptions{IterOptions: &pebble.IterOptions{
				LowerBound: []byte{prefixTask},
				UpperBound: []byte{prefixTask + 1},
			}})
			if err != nil {
				return TaskList{}, fmt.Errorf("shard: list %s: %w", source, err)
			}
		}
		sh := e.shardOf(source, id)
		tkey := appendTaskKey(nil, sh, ex.Fire, ex.Seq)
		if !tasks.SeekGE(tkey) || !bytes.Equal(tasks.Key(), tkey) {
			if err := tasks.Error(); err != nil {
				return TaskList{}, fmt.Errorf("shard: list %s: read task: %w", source, err)
			}
			skipped++ // not in this state of the store: not pending in it
			continue
		}
		tv, err := tasks.ValueAndErr()
		if err != nil {
			return TaskList{}, fmt.Errorf("shard: list %s: read task: %w", source, err)
		}
		var t codec.Task
		if err := codec.DecodeTask(tv, &t); err != nil {
			skipped++
			if bad++; bad == 1 {
				badID, badErr = id, err
			}
			continue
		}
		list.Tasks = append(list.Tasks, taskInfo(source, id, sh, &ex, &t))
	}
	if err := idx.Error(); err != nil {
		return TaskList{}, fmt.Errorf("shard: list %s: read index: %w", source, err)
	}
	if bad > 0 {
		e.log.Warn("list: left out entries that do not decode", zap.String("source", source),
			zap.Int("count", bad), zap.String("first_id", LogID(badID)), zap.Error(badErr))
	}
	return list, nil
}

// taskInfo is what Lookup and ListTasks report of the task t, pending in
// shard sh at ex.
func taskInfo(source, id string, sh int, ex *indexEntry, t *codec.Task) TaskInfo {
	var nextFire Time
	held := isHeld(ex.Fire)
	if !held {
		nextFire = msTime(ex.Fire)
	}
	return TaskInfo{
		Source:   source,
		ID:       id,
		Due:      msTime(t.Due),
		NextFire: nextFire,
		Held:     held,
		Target:   t.Destination(),
		Origin:   t.Origin,
		Attempts: t.Attempts,
		Shard:    sh,
	}
}

// prefixEnd is the smallest key after every key that starts with p (p
// ends with a byte below 0xff, as an index prefix does: its source's 0x00
// at least), nil if there is none.
func prefixEnd(p []byte) []byte {
	end := slices.Clone(p)
	for i := len(end) - 1; i >= 0; i-- {
		if end[i] < 0xff {
			end[i]++
			return end[:i+1]
		}
	}
	return nil
}
