package kafka

import (
	"sync/atomic"
	"testing"

	"github.com/twmb/franz-go/pkg/kmsg"
)

// TestMissingTopicLogThrottled (hunt H138): a bridge started before its
// delay topic exists retries for as long as the topic is missing; the
// reason is logged once, then once per 30 s (README, Configuration), not
// at every retry (every RetryMax, 10 s by default).
func TestMissingTopicLogThrottled(t *testing.T) {
	c := newCluster(t)
	var metadata atomic.Int64
	c.ControlKey(int16(kmsg.Metadata), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		metadata.Add(1)
		return nil, nil, false
	})
	s, logs := observedSource(t, c, "delay-missing")
	stop := runSource(t, s, newMemHandler())
	waitFor(t, "20 metadata requests (retries)", func() bool { return metadata.Load() >= 20 })
	_ = stop()
	if n := logs.FilterMessage("kafka source not ready; retrying").Len(); n != 1 {
		t.Fatalf("%d \"kafka source not ready; retrying\" lines over %d metadata requests, want 1", n, metadata.Load())
	}
}
