package kafka

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/delaybridge/delaybridge/codec"
)

// TestSinkTopicCreatedSinceMetadataTwoLanes: two fire loops (shards)
// publish tasks for a topic created since the sink's transport read the
// metadata at the same time. The one whose recheck is under way must not
// make the other fail its task as missing: with retry.max_attempts 1 that
// is a publish-failed dead letter of a task whose topic exists.
func TestSinkTopicCreatedSinceMetadataTwoLanes(t *testing.T) {
	c, s := warmSink(t, "tenant")
	ctx := context.Background()
	createTopic(t, c, "tenant")

	// Hold the first shard's lookup of "tenant" on the brokers while the
	// second shard publishes.
	asked, release := make(chan struct{}), make(chan struct{})
	c.ControlKey(int16(kmsg.Metadata), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		req := kreq.(*kmsg.MetadataRequest)
		// The recheck asks about "tenant" alone; the transport's pools
		// read "old" with it.
		if len(req.Topics) != 1 || !slices.ContainsFunc(req.Topics, func(rt kmsg.MetadataRequestTopic) bool { return rt.Topic != nil && *rt.Topic == "tenant" }) {
			c.KeepControl()
			return nil, nil, false
		}
		close(asked)
		c.SleepControl(func() { <-release })
		return nil, nil, false
	})
	first := make(chan []error, 1)
	go func() { first <- s.Deliver(ctx, []*codec.Task{task("tenant", "k", "shard0")}) }()
	select {
	case <-asked:
	case <-time.After(20 * time.Second):
		t.Fatal("the first publish never asked the brokers")
	}
	// The lookup answers a moment later whatever the second publish does
	// meanwhile (it may wait for that answer, or fail at once): the
	// outcome does not depend on when.
	time.AfterFunc(100*time.Millisecond, func() { close(release) })
	second := s.Deliver(ctx, []*codec.Task{task("tenant", "k", "shard1")})
	if errs := <-first; errs != nil {
		t.Fatalf("first shard: %v", errors.Join(errs...))
	}
	if second != nil {
		t.Fatalf("second shard, while the first one's recheck was under way: %v", errors.Join(second...))
	}
}

// TestSinkRecheckAfterAnotherLaneReloaded: a publish that failed a new
// topic before another lane's lookup found it and reloaded the metadata,
// and rechecks after that reload (the cache knows the topic by then), is
// sent again rather than failed as missing.
func TestSinkRecheckAfterAnotherLaneReloaded(t *testing.T) {
	c, s := warmSink(t, "tenant")
	ctx := context.Background()
	createTopic(t, c, "tenant")
	began := time.Now() // the second lane's write, failed on the stale cache
	if errs := s.Deliver(ctx, []*codec.Task{task("tenant", "k", "shard0")}); errs != nil {
		t.Fatalf("first lane: %v", errors.Join(errs...))
	}
	if !s.recheckUnknown(ctx, []string{"tenant"}, began) {
		t.Fatal("a write that failed before another lane found the topic is not sent again")
	}
	if s.recheckUnknown(ctx, []string{"tenant"}, time.Now()) {
		t.Fatal("a write that began after the reload is sent again (unbounded recursion)")
	}
}
