package kafka

import (
	"errors"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestRetryLogSecondOutageShown (review R212, failing, skipped: a design
// choice to make): since the end line no longer restarts the throttle
// (logthrottle.Episode, R210), a second short outage within 30 s of a
// logged one shows nowhere at Info or above: its failures are held back
// behind the first one's line and its end behind the first one's end, and
// their counts wait for a next line of the same kind that may never
// come. F211 fixed the same for NATS drops with a timer at the
// interval's end (dropLog.flush); retryLog, the NATS handle and stop
// lines and the offset commit lines have none.
func TestRetryLogSecondOutageShown(t *testing.T) {
	t.Skip("R212 finding, not fixed: a second outage within the interval of a logged one is never shown")
	core, logs := observer.New(zap.InfoLevel)
	log := zap.New(core)
	now := time.Unix(1_000_000, 0)
	r := &retryLog{end: "partitions read again", now: func() time.Time { return now }}
	errLeader := errors.New("[6] Not Leader For Partition")
	for range 2 { // two outages of 1 s, 10 s apart
		r.failed(log, zapcore.WarnLevel, part{"delay", 0}, "fetch failed; retrying", errLeader)
		now = now.Add(time.Second)
		r.ok(log, part{"delay", 0}, true)
		now = now.Add(10 * time.Second)
	}
	now = now.Add(time.Hour) // healthy since
	shown := 0
	for _, e := range logs.All() {
		held, _ := e.ContextMap()["held_back"].(int64)
		if e.Message == "fetch failed; retrying" {
			shown += 1 + int(held)
		}
	}
	if shown != 2 {
		t.Fatalf("2 outages shown as %d failures in %d lines", shown, logs.Len())
	}
}
