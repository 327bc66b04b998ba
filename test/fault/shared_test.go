package fault

import (
	"testing"
	"time"
)

// TestKill9OneOfTwo runs two bridges on the same brokers, each with its own
// store: they share the Kafka consumer group and the NATS durable consumer,
// so each sees gaps in the delivery sequences (deliveries to the other) and
// redeliveries of what a dead one held. One of them is SIGKILLed at random
// moments under load and restarted; the other keeps running. Every
// acknowledged message must reach its target: none lost, duplicates only
// from deliveries in flight at a kill.
func TestKill9OneOfTwo(t *testing.T) {
	t.Parallel()
	rounds := 1
	if long() {
		rounds = 8
	}
	const fireBatch, shards = 64, 4
	b := newBrokers(t, 0)
	col := b.collect(t)
	stay := newRunner(t, b, bridgeConfig{fireBatch: fireBatch})
	other := newRunner(t, b, bridgeConfig{fireBatch: fireBatch})
	l := startLoad(t, b, 4*time.Millisecond)
	s := stay.start()
	s.waitLog(90*time.Second, "delaybridge running")
	p := killRounds(t, other, rounds, time.Second, 3*time.Second)
	checkDrained(t, b, l, col, rounds*shards*fireBatch*inFlightBatches, p, s)
}
