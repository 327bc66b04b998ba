package service

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"testing/synctest"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/config"
)

// TestConnectBackoff: a transport whose brokers do not answer is retried
// with a pause doubling from 500 ms up to retry.max, at most 30 s: a
// transport reached later than retry.max after its brokers are back would
// hold its due tasks longer than an outage of a connected one does (the
// pause was capped at 30 s whatever retry.max said). The publisher being
// up while a source is not yet counts as connecting: only the source is
// retried, the publisher is kept.
func TestConnectBackoff(t *testing.T) {
	for _, tc := range []struct {
		name     string
		retryMax time.Duration
		want     int // setup attempts within 59.9 s (no pause ends on its deadline)
	}{
		// 0, 0.5, 1.5, 3.5, then every 2 s: 3.5 + 28 × 2 = 59.5.
		{"retry.max 2s", 2 * time.Second, 32},
		// 0, 0.5, 1.5, 3.5, 7.5, 15.5, 31.5, then 30 s: 61.5 is past.
		{"retry.max 5m", 5 * time.Minute, 7},
		// Never below the first pause.
		{"retry.max 100ms", 100 * time.Millisecond, 120},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				s := &Service{cfg: &config.Config{Retry: config.Retry{Max: config.Duration(tc.retryMax)}}, log: zap.NewNop()}
				attempts := 0
				l := newLateSink("nats", func(context.Context, *built) error {
					attempts++
					return fmt.Errorf("connect: %w", natsgo.ErrNoServers)
				})
				ctx, cancel := context.WithTimeout(context.Background(), 59900*time.Millisecond)
				defer cancel()
				if _, err := s.connect(ctx, l); !errors.Is(err, natsgo.ErrNoServers) {
					t.Fatalf("connect: %v", err)
				}
				if attempts != tc.want {
					t.Fatalf("%d attempts in 59.9 s, want %d", attempts, tc.want)
				}
			})
		})
	}

	t.Run("publisher kept while its source is retried", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			s := &Service{cfg: &config.Config{Retry: config.Retry{Max: config.Duration(time.Second)}}, log: zap.NewNop()}
			setups, sourceTries, closed := 0, 0, 0
			l := newLateSink("nats", func(_ context.Context, b *built) error {
				setups++
				b.closers = append(b.closers, func() error { closed++; return nil })
				b.addSources = func(context.Context, *built) error {
					if sourceTries++; sourceTries < 4 {
						return fmt.Errorf("nats source: look up stream: %w", context.DeadlineExceeded)
					}
					return nil
				}
				return nil
			})
			b, err := s.connect(context.Background(), l)
			if err != nil {
				t.Fatal(err)
			}
			if setups != 1 || sourceTries != 4 || closed != 0 || l.real.Load() != b || l.pub.Load() != b {
				t.Fatalf("setups %d, source tries %d, closed %d; want the publisher built once and kept, the source tried 4 times", setups, sourceTries, closed)
			}
			select {
			case <-l.tried:
			default:
				t.Fatal("deliveries still wait")
			}
		})
	})
}
