package nats

import (
	"context"
	"fmt"

	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/bridge"
)

// awaitDeadLetters holds the consumer, before it pulls (and so acks)
// anything, until the DLQ acknowledged (or the engine parked) the dead
// letters of the batches stored under the stream's floor key: the Handle
// that waited for them ended with the bridge or with consuming, and the
// stored floor is past their messages, so the redelivered messages at or
// below it would be acked at once (CONTRACT §3: on NATS the consumer
// holds). The engine reports their failing delivery (not ready). It
// returns ctx's error when ctx ended first.
func (s *Source) awaitDeadLetters(ctx context.Context, h bridge.Handler) error {
	a, ok := h.(bridge.DeadLetterAwaiter)
	if !ok {
		return nil
	}
	n := a.AwaitedDeadLetters(s.key)
	if n == 0 {
		return nil
	}
	s.log.Warn("nats source: consumer held: waiting for the DLQ to acknowledge the dead letters of batches stored before it started; nothing is pulled or acked meanwhile",
		zap.String("stream", s.cfg.Stream), zap.Int("dead_letters", n))
	if err := a.AwaitDeadLetters(ctx, s.key); err != nil {
		return fmt.Errorf("nats source: held for dead letters: %w", err)
	}
	s.log.Info("nats source: consumer released: the DLQ took its awaited dead letters (or they were parked)",
		zap.String("stream", s.cfg.Stream), zap.Int("dead_letters", n))
	return nil
}
