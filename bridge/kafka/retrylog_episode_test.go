package kafka

import (
	"errors"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/internal/logthrottle"
)

// TestRetryLogOutageAcrossRebalance (review R200): an outage whose
// failing partitions were revoked (a rebalance, another member's rolling
// restart) ended there without its end line; the next generation's
// failures, held back by the throttle, began an outage with no line
// logged, so its end was not logged either: the log said "fetch failed"
// and never "partitions read again". A failure just after the end line
// is held back with its end (review R210: restarting the throttle there
// let a flapping partition log two lines a turn).
func TestRetryLogOutageAcrossRebalance(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	r, log, logs := fakeRetryLog("partitions read again", &now)
	errFetch := errors.New("[6] Not Leader For Partition: fetch at offset 41")
	fail := func(p part) {
		r.failed(log, zapcore.WarnLevel, p, "fetch failed; retrying", errFetch)
	}
	starts := func() int { return logs.FilterMessage("fetch failed; retrying").Len() }
	ends := func() int { return logs.FilterMessage("partitions read again").Len() }

	p0, p1 := part{"delay", 0}, part{"delay", 1}
	fail(p0)
	fail(p1)
	if starts() != 1 {
		t.Fatalf("%d start lines, want 1", starts())
	}
	// A rebalance revokes both; the next generation's worker fails again
	// (held back: within 30 s of the line) and then reads.
	r.ok(log, p0, false)
	r.ok(log, p1, false)
	now = now.Add(5 * time.Second)
	fail(p0)
	now = now.Add(5 * time.Second)
	r.ok(log, p0, true)
	if starts() != 1 || ends() != 1 {
		t.Fatalf("an outage across a rebalance: %d start and %d end lines, want 1 and 1", starts(), ends())
	}
	end := logs.FilterMessage("partitions read again").All()[0].ContextMap()
	if end["failed_tries"] != int64(3) || end["partitions_failed"] != int64(2) || end["failing_for"] != 10*time.Second {
		t.Fatalf("end line %v, want 3 tries of 2 partitions over 10s", end)
	}
	// A failure 2 s after the end line is a new outage, held back by the
	// throttle (the end line does not restart it, review R210: a flapping
	// partition logged two lines a turn); its end is held back too, no
	// failure line having been logged since the last end line.
	now = now.Add(2 * time.Second)
	fail(p1)
	r.ok(log, p1, true)
	if starts() != 1 || ends() != 1 {
		t.Fatalf("an outage just after the end line: %d start and %d end lines, want 1 and 1 (both held back)", starts(), ends())
	}
	// Another topic's failure is logged at once, so its end is too,
	// within the interval of the last end line.
	now = now.Add(time.Second)
	r.failed(log, zapcore.WarnLevel, part{"other", 0}, "fetch failed; retrying", errFetch)
	r.ok(log, part{"other", 0}, true)
	if starts() != 2 || ends() != 2 {
		t.Fatalf("another topic's outage: %d start and %d end lines, want 2 and 2", starts(), ends())
	}
	if h := logs.FilterMessage("partitions read again").All()[1].ContextMap()["held_back"]; h != int64(1) {
		t.Fatalf("the second end line: held_back %v, want 1 (the held outage's end)", h)
	}
	// An interval after the first line, the topic's failure is logged again.
	now = now.Add(logthrottle.DefaultEvery)
	fail(p1)
	r.ok(log, p1, true)
	if starts() != 3 || ends() != 3 {
		t.Fatalf("an interval later: %d start and %d end lines, want 3 and 3", starts(), ends())
	}
	if s := logs.FilterMessage("fetch failed; retrying").All()[2].ContextMap()["held_back"]; s != int64(3) {
		t.Fatalf("the topic's line an interval later: held_back %v, want 3 (p1 at first, p0 after the rebalance, p1 after the end)", s)
	}
}

// TestRetryLogPerTopic (review R200): the retry lines were throttled by
// message and error shape across all the source's topics, so a second
// topic failing the same way (its read ACL removed, its leader offline)
// was held back behind the first topic's line for up to 30 s, its
// partitions counted in that line's held-back count; and Shape folds
// topic names that differ only in digits. Each topic is throttled on its
// own; its partitions share its line.
func TestRetryLogPerTopic(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	r, log, logs := fakeRetryLog("partitions read again", &now)
	errACL := errors.New("[29] Topic Authorization Failed: the client is not authorized to access the requested topic")
	for _, p := range []part{
		{"tenant1-delay", 0},
		{"tenant1-delay", 1}, // held: the topic's line is out
		{"tenant2-delay", 0},
		{"tenant2-delay", 3}, // held
	} {
		now = now.Add(time.Second)
		r.failed(log, zapcore.WarnLevel, p, "fetch failed; retrying", errACL)
	}
	if n := logs.FilterMessage("fetch failed; retrying").Len(); n != 2 {
		t.Fatalf("%d lines for two topics failing alike, want 2 (one per topic)", n)
	}
}

// TestRetryLogFlappingThrottled (review R210): when the end line reset
// the throttle (d8d0aa4), a partition that fails and goes on by turns (a
// store hovering at its free-space reserve, where each fire frees room
// for one batch; a leader flapping) logged its failure and its end at
// every turn: no throttle at all.
// A run of outages within one interval should cost a few lines, not two
// a turn.
func TestRetryLogFlappingThrottled(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	r, log, logs := fakeRetryLog("batches stored again", &now)
	errFull := errors.New("store: volume low on space: 90 MiB free, reserve 100 MiB")
	const turns = 100 // one every 100 ms: 10 s, within one interval
	for range turns {
		r.failed(log, zapcore.WarnLevel, part{"delay", 0}, "handle failed; retrying the same batch", errFull)
		now = now.Add(50 * time.Millisecond)
		r.ok(log, part{"delay", 0}, true)
		now = now.Add(50 * time.Millisecond)
	}
	fails := logs.FilterMessage("handle failed; retrying the same batch").Len()
	ends := logs.FilterMessage("batches stored again").Len()
	if fails > 2 || ends > 2 {
		t.Fatalf("%d turns of fail and store again in %v: %d failure and %d end lines, want at most 2 of each", turns, turns*100*time.Millisecond, fails, ends)
	}
	// Each failure line has an end line after it: the partition is fine.
	open := false
	for _, l := range logs.All() {
		switch l.Message {
		case "handle failed; retrying the same batch":
			open = true
		case "batches stored again":
			open = false
		}
	}
	if open {
		t.Fatal("the last failure line has no end line after it, the partition storing again")
	}
}

// TestHandleFailOneLineAcrossTopics (review R210): ed6f5ac keyed the
// retry lines per topic, the handler's too, but a handler that fails is
// the store (a failed fsync, the volume's reserve), one cause for every
// topic: a source of 10 delay topics logged 10 "handle failed" lines per
// 30 s where one says it all.
// Per topic suits what a topic can have on its own (a read ACL, a leader).
func TestHandleFailOneLineAcrossTopics(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	log := zap.New(core)
	now := time.Unix(1_000_000, 0)
	// The source's own handleFails, as NewSource sets it up.
	s, err := NewSource(testConfig(t, []string{"127.0.0.1:1"}, "g", "delay"))
	if err != nil {
		t.Fatal(err)
	}
	r := &s.handleFails
	r.now = func() time.Time { return now }
	errFull := errors.New("store: volume low on space: 90 MiB free, reserve 100 MiB")
	for i := range 10 {
		now = now.Add(100 * time.Millisecond)
		r.failed(log, zapcore.WarnLevel, part{"tenant" + string(rune('a'+i)) + "-delay", 0}, "handle failed; retrying the same batch", errFull)
	}
	if n := logs.FilterMessage("handle failed; retrying the same batch").Len(); n != 1 {
		t.Fatalf("the store refusing the batches of 10 topics: %d lines, want 1 (then one per 30 s)", n)
	}
	// Fetch failures stay per topic (a read ACL, a leader of one topic).
	for i := range 2 {
		s.retries.now = r.now
		s.retries.failed(log, zapcore.WarnLevel, part{"tenant" + string(rune('a'+i)) + "-delay", 0}, "fetch failed; retrying", errFull)
	}
	if n := logs.FilterMessage("fetch failed; retrying").Len(); n != 2 {
		t.Fatalf("two topics failing to fetch: %d lines, want 2 (one per topic)", n)
	}
}

// TestRetryLogSecondOutageShown (review R212): since the end line no
// longer restarts the throttle (logthrottle.Episode, R210), a second short
// outage within 30 s of a logged one showed nowhere at Info or above: its
// failures were held back behind the first one's line and its end behind
// the first one's end, and their counts waited for a next line of the
// same kind that might never come. The partition's next good read after
// the interval says it (Episode.Owed): the outages shown, each end line
// and the ends it holds back, are the two there were.
func TestRetryLogSecondOutageShown(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	r, log, logs := fakeRetryLog("partitions read again", &now)
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

// fakeRetryLog is a retryLog with end line end whose clock reads *now,
// and the logger its lines go to, observed at Info.
func fakeRetryLog(end string, now *time.Time) (*retryLog, *zap.Logger, *observer.ObservedLogs) {
	core, logs := observer.New(zap.InfoLevel)
	return &retryLog{end: end, now: func() time.Time { return *now }}, zap.New(core), logs
}
