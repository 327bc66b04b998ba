package kafka

import (
	"context"

	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/bridge"
)

// awaitDeadLetters holds the partition of key, before anything of it is
// read or committed, until the DLQ acknowledged (or the engine parked) the
// dead letters of its batches stored before it was assigned to this
// worker: the Handle that waited for them ended with the bridge or the
// generation, and the stored checkpoint resumes past their messages, so
// committing on would commit past them (CONTRACT §3). The engine reports
// their failing delivery (not ready). False when ctx ended first.
func (s *Source) awaitDeadLetters(ctx context.Context, h bridge.Handler, key string, log *zap.Logger) bool {
	a, ok := h.(bridge.DeadLetterAwaiter)
	if !ok {
		return true
	}
	n := a.AwaitedDeadLetters(key)
	if n == 0 {
		return true
	}
	log.Warn("partition held: waiting for the DLQ to acknowledge the dead letters of batches stored before the partition was assigned; nothing of it is read or committed meanwhile",
		zap.Int("dead_letters", n))
	if err := a.AwaitDeadLetters(ctx, key); err != nil {
		return false
	}
	log.Info("partition released: the DLQ took its awaited dead letters (or they were parked)", zap.Int("dead_letters", n))
	return true
}
