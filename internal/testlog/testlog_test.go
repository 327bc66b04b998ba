package testlog

import (
	"sync"
	"testing"

	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
)

// TestLogAfterEnd: goroutines that log after their subtest ended (as a
// broker client's handlers do) neither fail the test under -race nor
// panic; with zaptest's logger, the race detector fails the run.
func TestLogAfterEnd(t *testing.T) {
	var wg sync.WaitGroup
	for range 50 {
		t.Run("sub", func(t *testing.T) {
			log := New(t, zaptest.Level(zapcore.InfoLevel)).With()
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range 100 {
					log.Info("after the end, maybe")
				}
			}()
		})
	}
	wg.Wait()
}

// TestLevel: options reach zaptest (a level filters).
func TestLevel(t *testing.T) {
	log := New(t, zaptest.Level(zapcore.WarnLevel))
	if log.Core().Enabled(zapcore.InfoLevel) {
		t.Fatal("info enabled at warn level")
	}
	if !log.Core().Enabled(zapcore.WarnLevel) {
		t.Fatal("warn not enabled")
	}
}
