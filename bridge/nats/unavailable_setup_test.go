package nats

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// TestAnsweredUnavailableBounds (review R194), with every answer a 503
// "JetStream system temporarily unavailable": a slower request's later
// answer still wins over the 503s of the requests sent after it; the
// requests are sent once per resendEvery, no more; and none is left
// running once answered returns.
func TestAnsweredUnavailableBounds(t *testing.T) {
	unavail := &jetstream.APIError{Code: 503, ErrorCode: jsErrClusterNotAvail, Description: "JetStream system temporarily unavailable"}
	t.Run("a late answer wins", func(t *testing.T) {
		s := &Source{cfg: Config{ConnectTimeout: 20 * time.Millisecond}}
		var calls atomic.Int32
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		v, err := answered(ctx, s, func(ctx context.Context) (int, error) {
			if calls.Add(1) == 1 {
				// Answered after two requests sent again were answered 503.
				for calls.Load() < 3 {
					time.Sleep(time.Millisecond)
				}
				return 1, nil
			}
			return 0, unavail
		})
		if err != nil || v != 1 {
			t.Fatalf("answered: %d, %v; want the first request's answer", v, err)
		}
	})
	t.Run("rate and leaks", func(t *testing.T) {
		s := &Source{cfg: Config{ConnectTimeout: 20 * time.Millisecond}}
		var calls atomic.Int32
		budget := 300 * time.Millisecond
		ctx, cancel := context.WithTimeout(context.Background(), budget)
		defer cancel()
		var running int // answered's goroutines seen while it runs
		_, err := answered(ctx, s, func(ctx context.Context) (int, error) {
			if calls.Add(1) == 1 {
				running = answeredGoroutines()
			}
			return 0, unavail
		})
		if running == 0 {
			t.Fatal("no goroutine of answered seen while it runs: answeredGoroutines counts nothing")
		}
		if !errors.Is(err, unavail) {
			t.Fatalf("answered: %v; want the 503", err)
		}
		// A ticker drops the ticks it cannot deliver: at most one request
		// per resendEvery, and the first.
		if n, most := calls.Load(), int32(budget/s.resendEvery())+1; n > most {
			t.Fatalf("%d requests in %v, want at most %d (one per %v)", n, budget, most, s.resendEvery())
		}
		eventually(t, "the requests' goroutines gone", func() bool { return answeredGoroutines() == 0 })
	})
}

// answeredGoroutines counts the goroutines running a request of answered.
func answeredGoroutines() int {
	buf := make([]byte, 1<<22)
	buf = buf[:runtime.Stack(buf, true)]
	n := 0
	for g := range strings.SplitSeq(string(buf), "\n\n") {
		if strings.Contains(g, "/bridge/nats.answered[") {
			n++
		}
	}
	return n
}
