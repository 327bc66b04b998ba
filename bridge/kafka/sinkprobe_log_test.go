package kafka

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/shard"
)

// TestProbeAnswerLogThrottled (hunt H204): a broker that answers metadata
// and ApiVersions but drops every produce (a produce request over its
// socket limit, a hung disk) fails each retried publish while each probe
// finds the leaders answering. Every probe logged "kafka partition leaders
// answer again" at Info: 11 lines a minute with the default 5 s probe,
// for as long as the target takes nothing, beside the engine's single
// "target broker unreachable". Now once per 30 s per set of topics, with
// the count held back.
func TestProbeAnswerLogThrottled(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "out"))
	var fail atomic.Bool
	c.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if fail.Load() {
			return nil, errors.New("injected: produce dropped"), true
		}
		return nil, nil, false
	})
	core, logs := observer.New(zap.InfoLevel)
	cfg := testConfig(t, c.ListenAddrs(), "")
	cfg.Logger = zap.New(core)
	cfg.ProbeInterval = 15 * time.Millisecond
	s, err := NewSink(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	if errs := s.Deliver(context.Background(), []*codec.Task{task("out", "k", "before")}); errs != nil {
		t.Fatalf("Deliver: %v", errs)
	}
	fail.Store(true)
	const rounds = 5
	for i := range rounds {
		if errs := s.Deliver(context.Background(), []*codec.Task{task("out", "k", "during")}); len(errs) != 1 || !errors.Is(errs[0], shard.ErrUnavailable) {
			t.Fatalf("round %d: Deliver while produces are dropped: %v, want shard.ErrUnavailable", i, errs)
		}
		waitFor(t, "the probe finding the leader answering", func() bool { return s.Health() == nil })
	}
	const msg = "kafka partition leaders answer again"
	if n := logs.FilterMessageSnippet(msg).Len(); n != 1 {
		t.Fatalf("%d %q lines over %d failed publishes each followed by a probe that passed, want 1 (then one per 30 s)", n, msg, rounds)
	}
	if _, ok := logs.FilterMessageSnippet(msg).All()[0].ContextMap()["held_back"]; !ok {
		t.Fatal("the line does not carry the count held back")
	}
}
