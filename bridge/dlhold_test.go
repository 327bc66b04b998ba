package bridge

import (
	"context"
	"errors"
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
