package kafka

import (
	"testing"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.uber.org/zap/zapcore"
)

// TestFetchRetryLogThrottled (hunt H204): the partitions of a delay topic
// whose fetches fail (a leader offline, a read ACL removed) while the
// group goes on fail at every retry of every partition. Each worker
// logged each retry: 28 Warn lines a minute with 3 partitions (about 600
// with 100), and nothing when they read again. Now each message is
// logged once per 30 s across the partitions, and the end of the outage
// once.
func TestFetchRetryLogThrottled(t *testing.T) {
	const parts = 8
	c := newCluster(t, kfake.SeedTopics(parts, "delay"))
	pr := producer(t, c)
	produceN(t, pr, "delay", parts, 0, 2*parts)
	s, logs := observedSource(t, c, "delay")
	h := newMemHandler()
	stop := runSource(t, s, h)
	defer func() { _ = stop() }()
	waitFor(t, "the first records", func() bool { return h.count() == 2*parts })

	f := c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Fetch}, Topic: "delay", Err: kerr.NotLeaderForPartition, Count: -1})
	waitFor(t, "every partition's fetches failing, retried", func() bool { return f.Hits() >= 10*parts })
	warns := logs.FilterLevelExact(zapcore.WarnLevel).All()
	var failing []string
	for _, l := range warns {
		failing = append(failing, l.Message)
	}
	if len(failing) == 0 || len(failing) > 2 {
		t.Fatalf("%d Warn lines over %d failed fetches of %d partitions, want 1 or 2 (the fetch and the log check, each once per 30 s): %q",
			len(failing), f.Hits(), parts, failing)
	}
	for _, l := range warns {
		if _, ok := l.ContextMap()["held_back"]; !ok {
			t.Fatalf("line without the count held back: %s %v", l.Message, l.ContextMap())
		}
	}

	f.Remove()
	produceN(t, pr, "delay", parts, 2*parts, parts)
	waitFor(t, "the records after the outage", func() bool { return h.count() == 3*parts })
	waitFor(t, "the end of the outage logged", func() bool {
		return logs.FilterMessageSnippet("partitions read again").Len() > 0
	})
	if n := logs.FilterMessageSnippet("partitions read again").Len(); n != 1 {
		t.Fatalf("the end of the outage logged %d times, want once", n)
	}
	end := logs.FilterMessageSnippet("partitions read again").All()[0].ContextMap()
	if end["partitions_failed"] != int64(parts) {
		t.Fatalf("end of the outage: %v, want partitions_failed %d", end, parts)
	}
}
