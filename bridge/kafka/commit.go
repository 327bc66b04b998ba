package kafka

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/internal/logthrottle"
)

// offsets is what an OffsetCommit carries: topic -> partition -> next offset.
type offsets = map[string]map[int]int64

// committer sends one generation's offset commits, one request at a time,
// each carrying the newest stored offset of every partition that moved
// since the last one.
//
// The partition workers do not commit themselves: kafka-go's
// Generation.CommitOffsets goes over the one coordinator connection, and
// callers waiting on it concurrently poll it in a loop (re-arming the read
// deadline and yielding) until their own response arrives; with a few
// partitions busy that polling took a fifth of the bridge's CPU. Offsets
// reach Kafka after the store checkpoint, so a commit that lags or fails
// loses nothing: the checkpoint is where a restart resumes (startOffset).
type committer struct {
	commit func(offsets) error // Generation.CommitOffsets
	retry  time.Duration       // pause after a failed commit
	log    *zap.Logger
	failed func(topic string) // counts a failed commit

	// lines: the failure and end lines, the source's (see commitLines).
	// wait is the pause before the next retry, doubling from retry up to
	// maxRetry while commits fail.
	lines    *commitLines
	wait     time.Duration
	maxRetry time.Duration
	now      func() time.Time // nil: time.Now (tests set it)

	mu      sync.Mutex
	pending offsets
	rewinds []*rewindWait // rewinds waiting for their commit
	kick    chan struct{}
}

// rewindWait is a rewind waiting until a commit carrying it succeeded.
type rewindWait struct {
	topic     string
	partition int
	next      int64
	done      chan struct{}
}

// commitLines decides a source's "offset commit failed" and "offset
// commit succeeded again" lines, for the committers of all its
// generations: fails throttles the failure line per error shape (an error
// naming the client's ephemeral port is one failure); ended decides the
// end line after failures: at once after a logged failure line, else once
// per interval, without restarting fails (review R210: it logged after a
// failure held back, and restarted the throttle at every success, so
// commits failing and succeeding by turns logged two lines a turn);
// failing says the last commit failed. The source's, not a generation's
// (review R212: a coordinator that fails the commits ends the generation
// too, and the next generation's committer, which had seen no failure,
// never logged the end of the failure line of the one before; each
// generation of a rebalance loop logged its failure at once).
type commitLines struct {
	fails   logthrottle.Throttle
	ended   logthrottle.Episode
	failing atomic.Bool
}

// newCommitter returns a committer with lines of its own; the source's
// generations share the source's (Source.newGenCommitter).
func newCommitter(commit func(offsets) error, retry, maxRetry time.Duration, log *zap.Logger, failed func(string)) *committer {
	return &committer{commit: commit, retry: retry, wait: retry, maxRetry: max(retry, maxRetry), log: log, failed: failed,
		lines: &commitLines{}, kick: make(chan struct{}, 1)}
}

func (c *committer) clock() time.Time {
	if c.now != nil {
		return c.now()
	}
	return time.Now()
}

// offer queues next as the offset to commit for topic/partition. Offsets
// only move forward: an older offer than the one queued is ignored.
func (c *committer) offer(topic string, partition int, next int64) {
	c.mu.Lock()
	c.raiseLocked(topic, partition, next)
	c.mu.Unlock()
	c.kickSelf()
}

// raiseLocked sets the pending offset of topic/partition to next unless a
// higher one is pending already.
func (c *committer) raiseLocked(topic string, partition int, next int64) {
	if c.pending == nil {
		c.pending = offsets{}
	}
	ps := c.pending[topic]
	if ps == nil {
		ps = map[int]int64{}
		c.pending[topic] = ps
	}
	if cur, ok := ps[partition]; !ok || next > cur {
		ps[partition] = next
	}
}

// rewind commits next for topic/partition although it is below what the
// group has committed, and returns once a commit carrying it succeeded:
// true, or false when ctx (the source) or gctx (the generation) ended
// first. A partition worker rewinds before it stores anything of a log that
// replaced the one the group's offset was committed for (a topic deleted
// and created again): left in place, that offset would be taken for the new
// log's after a crash, and the start would skip the new log up to it. The
// caller is the partition's only worker, so no offer of the partition can
// raise the rewound offset until rewind returns.
func (c *committer) rewind(ctx, gctx context.Context, topic string, partition int, next int64) bool {
	w := &rewindWait{topic: topic, partition: partition, next: next, done: make(chan struct{})}
	c.mu.Lock()
	c.raiseLocked(topic, partition, next)
	c.pending[topic][partition] = next // lower than what is queued, too
	c.rewinds = append(c.rewinds, w)
	c.mu.Unlock()
	c.kickSelf()
	select {
	case <-w.done:
		return true
	case <-ctx.Done():
	case <-gctx.Done():
	}
	c.mu.Lock()
	c.rewinds = slices.DeleteFunc(c.rewinds, func(x *rewindWait) bool { return x == w })
	c.mu.Unlock()
	return false
}

// rewindingLocked reports whether a rewind of topic/partition waits.
func (c *committer) rewindingLocked(topic string, partition int) bool {
	return slices.ContainsFunc(c.rewinds, func(w *rewindWait) bool { return w.topic == topic && w.partition == partition })
}

// committedLocked releases the rewinds that the successful commit p carried.
func (c *committer) committedLocked(p offsets) {
	c.rewinds = slices.DeleteFunc(c.rewinds, func(w *rewindWait) bool {
		if off, ok := p[w.topic][w.partition]; ok && off == w.next {
			close(w.done)
			return true
		}
		return false
	})
}

// take returns the queued offsets and clears them; nil when there are none.
func (c *committer) take() offsets {
	c.mu.Lock()
	defer c.mu.Unlock()
	p := c.pending
	c.pending = nil
	return p
}

// putBack requeues offsets whose commit failed, unless a newer offer for
// the same partition arrived meanwhile. An offset of a partition being
// rewound is older than the rewind, and its commit would undo it: it is
// dropped, unless it is the rewind's own.
func (c *committer) putBack(p offsets) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for t, ps := range p {
		for part, off := range ps {
			if c.rewindingLocked(t, part) {
				if _, queued := c.pending[t][part]; queued {
					continue
				}
			}
			c.raiseLocked(t, part, off)
		}
	}
}

// flush commits what is queued. It reports false when the error means the
// generation is over (the member must rejoin).
func (c *committer) flush() (ok bool) {
	p := c.take()
	if len(p) == 0 {
		return true
	}
	err := c.commit(p)
	if err == nil {
		if c.lines.failing.Swap(false) {
			if held, ok := c.lines.ended.End(c.clock()); ok {
				c.log.Info("offset commit succeeded again", zap.Any("offsets", p), zap.Int("held_back", held))
			}
		} else if held, ok := c.lines.ended.Owed(c.clock()); ok {
			// Runs whose end lines were held back, their interval over
			// (logthrottle.Episode.Owed).
			c.log.Info("offset commit succeeded again", zap.Any("offsets", p), zap.Int("held_back", held))
		}
		c.wait = c.retry
		c.mu.Lock()
		c.committedLocked(p)
		c.mu.Unlock()
		return true
	}
	for t := range p {
		c.failed(t)
	}
	if generationOver(err) {
		c.log.Info("generation over; offsets not committed", zap.Any("offsets", p), zap.Error(err))
		return false
	}
	// The next commit carries these unless newer ones replace them; the
	// store checkpoint covers a crash meanwhile.
	c.lines.failing.Store(true)
	if n, ok := c.lines.fails.AllowKey(c.clock(), logthrottle.Shape(err.Error())); ok {
		c.lines.ended.Logged()
		c.log.Warn("offset commit failed; retrying", zap.Any("offsets", p), zap.Error(err), zap.Int("held_back", n))
	}
	c.putBack(p)
	return true
}

// run commits whenever offsets are offered until ctx (the source) or gctx
// (the generation) ends. When the source stops, it waits for the
// partition workers to finish (workersDone) and commits what they stored
// last: the generation is still ours until the group is left. When a
// rebalance ended the generation, what is queued is dropped: the
// partitions may belong to another member already, and the store
// checkpoints cover us if they come back. A generation-over error ends run
// early, which (run being a Generation.Start function) ends the generation
// so the member rejoins.
func (c *committer) run(ctx, gctx context.Context, workersDone <-chan struct{}) {
	stop := func() {
		<-workersDone
		c.flush()
	}
	for {
		select {
		case <-c.kick:
			if !c.flush() {
				return
			}
			if c.pendingLen() > 0 { // failed: pause, then retry
				select {
				case <-time.After(c.wait):
					c.wait = min(2*c.wait, c.maxRetry)
					c.kickSelf()
				case <-gctx.Done():
				case <-ctx.Done():
				}
			}
		case <-gctx.Done():
			if ctx.Err() == nil {
				if p := c.take(); len(p) > 0 {
					c.log.Debug("generation over; offsets not committed", zap.Any("offsets", p))
				}
				return
			}
			stop()
			return
		case <-ctx.Done():
			stop()
			return
		}
	}
}

func (c *committer) pendingLen() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.pending)
}

func (c *committer) kickSelf() {
	select {
	case c.kick <- struct{}{}:
	default:
	}
}
