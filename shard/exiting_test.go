package shard

import (
	"runtime"
	"testing"

	"go.uber.org/zap"
)

// TestFatalfWhileExiting: a fatal Pebble error panics (safeCall turns it
// into the sticky store error), except once the process exits without
// waiting (Exiting): then it parks the goroutine, so a store whose
// directory the exit's cleanups removed does not crash the process with a
// panic before its own exit (TestDevForcedExit saw exit status 2).
func TestFatalfWhileExiting(t *testing.T) {
	p := pebbleLogger{zap.NewNop().Sugar()}
	if err := safeCall(func() error { p.Fatalf("boom %d", 1); return nil }); err == nil || err.Error() != "boom 1" {
		t.Fatalf("before Exiting: %v, want the fatal error back from safeCall", err)
	}

	parked := make(chan struct{})
	old := parkExiting
	parkExiting = func() { close(parked); runtime.Goexit() }
	t.Cleanup(func() { parkExiting = old; exiting.Store(false) })
	Exiting()
	// The goroutine ends one of three ways: parked (Goexit, whose
	// deferred recover sees nil), a panic, or Fatalf returning.
	panicked := make(chan any, 1)
	returned := make(chan struct{})
	go func() {
		defer func() {
			if r := recover(); r != nil {
				panicked <- r
			}
		}()
		p.Fatalf("the directory is gone")
		close(returned)
	}()
	select {
	case <-parked:
	case r := <-panicked:
		t.Fatalf("Fatalf while exiting did not park: panic %v", r)
	case <-returned:
		t.Fatal("Fatalf while exiting returned")
	}
}
