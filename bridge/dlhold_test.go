package bridge

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/shard"
)

// A Handle that gives up (its source stopped) leaves the batch's dead
// letters held for its checkpoint key: AwaitDeadLetters waits until the
// DLQ took them, for that key only.
func TestPipelineAwaitDeadLettersAfterStop(t *testing.T) {
	clk, eng, sink := runDLQEngine(t)
	p := NewPipeline(eng, nil)
	p.stopGrace = 0
	const key = "kafka|delay|0"
	bad := Item{Msg: codec.Message{Transport: codec.TransportKafka, Source: "delay", Offset: 7, Value: []byte("v"), Time: clk.Now(),
		Headers: []codec.Header{{Key: "delay-after", Value: []byte("soon")}, {Key: "delay-target", Value: []byte("t")}}},
		Rules: &codec.Rules{DLQ: "delay.dlq"}}
	hctx, stopSource := context.WithCancel(context.Background())
	handled := make(chan error, 1)
	go func() {
		handled <- p.Handle(hctx, &Batch{Items: []Item{bad}, Checkpoints: []shard.Checkpoint{{Key: key, Offset: 7}}})
	}()
	<-sink.tries // the DLQ failed once
	stopSource()
	if err := <-handled; !errors.Is(err, context.Canceled) {
		t.Fatalf("Handle after its source stopped = %v, want context.Canceled", err)
	}
	if n := p.AwaitedDeadLetters(key); n != 1 {
		t.Fatalf("AwaitedDeadLetters(%s) = %d after Handle gave up, want 1", key, n)
	}
	if err := p.AwaitDeadLetters(context.Background(), "kafka|delay|1"); err != nil {
		t.Fatalf("AwaitDeadLetters of another key = %v", err)
	}
	stopped, stop := context.WithCancel(context.Background())
	stop()
	if err := p.AwaitDeadLetters(stopped, key); !errors.Is(err, context.Canceled) {
		t.Fatalf("AwaitDeadLetters with a cancelled ctx = %v, want context.Canceled", err)
	}
	waited := make(chan error, 1)
	go func() { waited <- p.AwaitDeadLetters(context.Background(), key) }()
	close(sink.ok)
	for {
		select {
		case err := <-waited:
			if err != nil {
				t.Fatalf("AwaitDeadLetters after the DLQ took it = %v", err)
			}
			return
		case <-time.After(10 * time.Millisecond):
			clk.Advance(time.Second) // the retry after the failure
		}
	}
}

// plainEngine is an Engine without stored dead-letter waits.
type plainEngine struct{ Engine }

func TestPipelineAwaitDeadLettersWithoutSupport(t *testing.T) {
	p := NewPipeline(plainEngine{}, nil)
	if n := p.AwaitedDeadLetters("k"); n != 0 {
		t.Fatalf("AwaitedDeadLetters = %d, want 0", n)
	}
	if err := p.AwaitDeadLetters(context.Background(), "k"); err != nil {
		t.Fatalf("AwaitDeadLetters = %v, want nil", err)
	}
}

// Handle calls the batch's DeadLetterWait before it waits for the DLQ to
// take the batch's dead letters (the Kafka source moves the partition's
// fetched records out of its memory budget then), and not for a batch
// without dead letters.
func TestPipelineCallsDeadLetterWait(t *testing.T) {
	clk, eng, sink := runDLQEngine(t)
	p := NewPipeline(eng, nil)
	rules := &codec.Rules{DLQ: "delay.dlq"}
	good := Item{Msg: codec.Message{Transport: codec.TransportKafka, Source: "delay", Offset: 6, Value: []byte("v"), Time: clk.Now(),
		Headers: []codec.Header{{Key: "delay-after", Value: []byte("1h")}, {Key: "delay-target", Value: []byte("t")}}}, Rules: rules}
	var calls atomic.Int32
	wait := func() { calls.Add(1) }
	if err := p.Handle(context.Background(), &Batch{Items: []Item{good}, DeadLetterWait: wait,
		Checkpoints: []shard.Checkpoint{{Key: "kafka|delay|0", Offset: 6}}}); err != nil {
		t.Fatal(err)
	}
	if n := calls.Load(); n != 0 {
		t.Fatalf("DeadLetterWait called %d times for a batch without dead letters", n)
	}
	bad := good
	bad.Msg.Offset = 7
	bad.Msg.Headers = []codec.Header{{Key: "delay-after", Value: []byte("soon")}, {Key: "delay-target", Value: []byte("t")}}
	handled := make(chan error, 1)
	go func() {
		handled <- p.Handle(context.Background(), &Batch{Items: []Item{bad}, DeadLetterWait: wait,
			Checkpoints: []shard.Checkpoint{{Key: "kafka|delay|0", Offset: 7}}})
	}()
	<-sink.tries // the DLQ failed once: Handle waits (or is about to)
	for deadline := time.Now().Add(10 * time.Second); calls.Load() == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("DeadLetterWait not called while Handle waits for the DLQ")
		}
	}
	select {
	case err := <-handled:
		t.Fatalf("Handle returned %v while the DLQ fails", err)
	default:
	}
	close(sink.ok)
	for {
		select {
		case err := <-handled:
			if err != nil {
				t.Fatalf("Handle after the DLQ took the dead letter = %v", err)
			}
			if n := calls.Load(); n != 1 {
				t.Fatalf("DeadLetterWait called %d times, want 1", n)
			}
			return
		case <-time.After(10 * time.Millisecond):
			clk.Advance(time.Second) // the retry after the failure
		}
	}
}
