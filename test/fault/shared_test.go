package fault

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
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
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 11))
	for round := range rounds {
		p := other.start()
		p.waitLog(90*time.Second, "delaybridge running")
		wait := time.Duration(1000+rng.IntN(3000)) * time.Millisecond
		time.Sleep(wait) // real load runs meanwhile; the kill moment is random
		p.kill()
		t.Logf("round %d: killed the second bridge %v after ready", round+1, wait)
	}
	p := other.start()
	p.waitLog(90*time.Second, "delaybridge running")
	time.Sleep(time.Second)
	sent := l.finish()
	var tl tally
	drainStart := time.Now()
	ok := waitFor(drainWait, func() bool {
		tl = count(sent, col.byValue(isTarget))
		return tl.lost == 0
	})
	drained := time.Since(drainStart)
	for _, q := range []*proc{p, s} {
		if err := q.term(); err != nil {
			t.Errorf("bridge: %v", err)
		}
	}
	t.Logf("%d kills of one of two bridges: drained %v after the load stopped; sent %d (publisher errors %d), delivered %d unique, %d duplicates, %d lost",
		rounds, drained.Round(time.Millisecond), tl.sent, l.fails.Load(), tl.delivered, tl.duplicates, tl.lost)
	if !ok || tl.lost > 0 {
		lostBy := map[string]int{}
		for v := range sent {
			if len(col.byValue(isTarget)[v]) == 0 {
				lostBy[v[:1]]++
			}
		}
		t.Fatalf("%d acknowledged messages not delivered within %v of the load stopping; by source (k = Kafka, n = NATS): %v", tl.lost, drainWait, lostBy)
	}
	if limit := rounds * shards * fireBatch; tl.duplicates > limit {
		t.Errorf("%d duplicates, more than the %d that can be in flight at %d kills (%d shards x fire_batch %d)",
			tl.duplicates, limit, rounds, shards, fireBatch)
	}
	if dl := col.byValue(isDLQ); len(dl) > 0 {
		t.Errorf("%d good messages dead-lettered", len(dl))
		for v, ds := range dl {
			t.Logf("dead letter %s: %s %s", v, ds[0].headers[codec.HeaderError], ds[0].headers[codec.HeaderErrorDetail])
			break
		}
	}
}
