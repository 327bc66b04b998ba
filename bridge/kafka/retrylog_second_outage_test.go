package kafka

import (
	"errors"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestRetryLogSecondOutageShown (review R212): since the end line no
// longer restarts the throttle (logthrottle.Episode, R210), a second short
// outage within 30 s of a logged one showed nowhere at Info or above: its
// failures were held back behind the first one's line and its end behind
// the first one's end, and their counts waited for a next line of the
// same kind that might never come. The partition's next good read after
// the interval says it (Episode.Owed): the outages shown, each end line
// and the ends it holds back, are the two there were.
func TestRetryLogSecondOutageShown(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	log := zap.New(core)
	now := time.Unix(1_000_000, 0)
	r := &retryLog{end: "partitions read again", now: func() time.Time { return now }}
	errLeader := errors.New("[6] Not Leader For Partition")
	p := part{"delay", 0}
	for range 2 { // two outages of 1 s, 10 s apart
		r.failed(log, zapcore.WarnLevel, p, "fetch failed; retrying", errLeader)
		now = now.Add(time.Second)
		r.ok(log, p, true)
		now = now.Add(10 * time.Second)
	}
	r.ok(log, p, true) // a good read within the interval: nothing yet
	if n := logs.FilterMessage("partitions read again").Len(); n != 1 {
		t.Fatalf("%d end lines within the interval, want 1", n)
	}
	now = now.Add(time.Hour) // healthy since
	r.ok(log, p, true)
	r.ok(log, p, true)
	shown := 0
	for _, e := range logs.FilterMessage("partitions read again").All() {
		held, _ := e.ContextMap()["held_back"].(int64)
		shown += 1 + int(held)
	}
	if shown != 2 {
		t.Fatalf("2 outages shown as %d ends in %d lines", shown, logs.Len())
	}
}
