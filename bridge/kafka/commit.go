package kafka

import (
	"context"
	"sync"
	"time"

	"go.uber.org/zap"
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

	mu      sync.Mutex
	pending offsets
	kick    chan struct{}
}

func newCommitter(commit func(offsets) error, retry time.Duration, log *zap.Logger, failed func(string)) *committer {
	return &committer{commit: commit, retry: retry, log: log, failed: failed, kick: make(chan struct{}, 1)}
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

// take returns the queued offsets and clears them; nil when there are none.
func (c *committer) take() offsets {
	c.mu.Lock()
	defer c.mu.Unlock()
	p := c.pending
	c.pending = nil
	return p
}

// putBack requeues offsets whose commit failed, unless a newer offer for
// the same partition arrived meanwhile.
func (c *committer) putBack(p offsets) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for t, ps := range p {
		for part, off := range ps {
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
	c.log.Warn("offset commit failed; retrying", zap.Any("offsets", p), zap.Error(err))
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
				case <-time.After(c.retry):
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
