package service

import (
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/bridge/kafka"
	"github.com/delaybridge/delaybridge/shard"
)

// A target broker that holds a produce at the moment of SIGTERM does not
// hold the shutdown: closing the Kafka publisher waits for its in-flight
// write (kafka-go's Writer.Close, here with a 10 min WriteTimeout), so it
// is left to the process exit once shutdown_timeout is up, and the store
// is still closed with the task in it. Run must return while the produce
// is held; the broker releases it only after the test's checks.
func TestShutdownDoesNotWaitForAHeldPublish(t *testing.T) {
	e := newEnv(t, "shutdown_timeout: 3s\n")
	hold := e.holdProduceTo(kafkaOut)
	_, cancel, done := e.runWith(Options{Kafka: func(c *kafka.Config) {
		fastKafka(c)
		c.WriteTimeout = 10 * time.Minute // only the shutdown can end the held write
	}})
	e.publishKafka(0, time.Time{}, []byte("k"), []byte("v"), "delay-after", "0", "delay-target", kafkaOut)
	e.awaitHeld(hold)
	watchdog := time.After(60 * time.Second)
	cancel() // SIGTERM, with the produce held
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-watchdog:
		t.Fatal("Run waited for the held produce: shutdown_timeout not kept")
	}
	// The fire loop is still in the held publish, so the store stays open
	// until it returns (in production the process exits first). Once the
	// broker lets go, the store closes and still holds the task, whose
	// publish the broker refused.
	hold.Release(true)
	var eng *shard.Engine
	var err error
	for eng == nil {
		eng, err = shard.Open(shard.Options{Dir: e.dataDir, Shards: e.config().Shards, Logger: zap.NewNop()})
		if err != nil {
			select {
			case <-watchdog:
				t.Fatalf("reopen the store: %v", err)
			case <-time.After(20 * time.Millisecond):
			}
		}
	}
	defer eng.Close()
	if p := eng.Stats().Pending; p != 1 {
		t.Fatalf("%d tasks pending after the shutdown, want the unacknowledged one", p)
	}
}
