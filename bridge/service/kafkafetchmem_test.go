package service

import (
	"testing"

	"github.com/delaybridge/delaybridge/bridge/kafka"
	"github.com/delaybridge/delaybridge/config"
)

// kafka.fetch_memory_mb reaches the Kafka source as its fetch memory budget.
func TestKafkaFetchMemoryReachesTheSource(t *testing.T) {
	e := newEnv(t, "")
	e.mutate = func(c *config.Config) { c.Kafka.FetchMemoryMB = 8 }
	got := make(chan int64, 1)
	_, cancel, done := e.runWith(Options{Kafka: func(c *kafka.Config) {
		fastKafka(c)
		got <- c.FetchMemory
	}})
	if n := <-got; n != 8<<20 {
		t.Errorf("kafka.Config.FetchMemory = %d, want %d", n, 8<<20)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// The config package documents the budget's default; the adapter applies
// its own when it is zero. They must be the same number.
func TestKafkaFetchMemoryDefaultsAgree(t *testing.T) {
	if got, want := int64(config.DefaultKafkaFetchMemoryMB)<<20, int64(kafka.DefaultFetchMemory); got != want {
		t.Errorf("config kafka.fetch_memory_mb default %d B, adapter default %d B", got, want)
	}
}
