package bridge

import (
	"context"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/internal/clock"
	"github.com/delaybridge/delaybridge/shard"
)

// The incarnation a source takes when the store has read the other
// transport's source of its name: the other's, top bit flipped, so the
// two never compare offsets (and each counting on from its own never
// reaches the other's); none when the store has not.
func TestCrossIncarnation(t *testing.T) {
	p := NewPipeline(openEngine(t, clock.NewFake(time.Now())), nil)
	if _, ok, err := StreamCrossIncarnation(p, "delay"); ok || err != nil {
		t.Fatalf("no stream read: ok %v, err %v", ok, err)
	}
	if _, ok, err := TopicCrossIncarnation(p, "delay"); ok || err != nil {
		t.Fatalf("no topic read: ok %v, err %v", ok, err)
	}
	if err := p.Handle(context.Background(), &Batch{Checkpoints: []shard.Checkpoint{
		{Key: NATSIncarnationKey("delay"), Offset: 2, Fingerprint: 12345},
		{Key: KafkaCheckpointKey("jobs", 0), Offset: 41, Fingerprint: 0xfeed, Incarnation: 3},
		{Key: KafkaCheckpointKey("other", 1), Offset: 41, Fingerprint: 0xfeed},
	}}); err != nil {
		t.Fatal(err)
	}
	if inc, ok, err := StreamCrossIncarnation(p, "delay"); !ok || err != nil || inc != 2|CrossIncarnation {
		t.Errorf("topic named like a stream read at incarnation 2: %d, %v, %v; want %d", inc, ok, err, 2|CrossIncarnation)
	}
	if inc, ok, err := TopicCrossIncarnation(p, "jobs"); !ok || err != nil || inc != 3|CrossIncarnation {
		t.Errorf("stream named like a topic read at incarnation 3: %d, %v, %v; want %d", inc, ok, err, 3|CrossIncarnation)
	}
	// Only partition 0 shares the stream's "partition" (0).
	if _, ok, err := TopicCrossIncarnation(p, "other"); ok || err != nil {
		t.Errorf("topic read at partition 1 only: ok %v, err %v", ok, err)
	}
	// A stream whose incarnation was flipped from a topic's flips back.
	if err := p.Handle(context.Background(), &Batch{Checkpoints: []shard.Checkpoint{
		{Key: NATSIncarnationKey("jobs"), Offset: int64(3 | CrossIncarnation), Fingerprint: 1},
	}}); err != nil {
		t.Fatal(err)
	}
	if inc, ok, err := StreamCrossIncarnation(p, "jobs"); !ok || err != nil || inc != 3 {
		t.Errorf("topic named like a stream whose incarnation was flipped: %d, %v, %v; want 3", inc, ok, err)
	}
}
