package service

import (
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestKafkaDownAtRestartDoesNotHoldNATS: a NATS->NATS task stored
// before a restart, and a NATS message published after it, must not wait
// for the Kafka cluster when the bridge restarts during a Kafka outage.
// The README promises that a target broker that cannot be reached delays
// only the tasks of its own transport, and that tasks are delivered at most
// retry.max late after an outage of their own broker. Each transport
// connects on its own; before, the bridge started neither the engine nor
// any source until every transport was reached.
func TestKafkaDownAtRestartDoesNotHoldNATS(t *testing.T) {
	e := newEnv(t, "")
	svc, stop := e.start()
	e.publishNATS("delay.h93", []byte("stored-before"), "delay-after", "5s", "delay-target", "orders.h93")
	waitIngested(t, svc, 1)
	stop()

	// Kafka goes away (nothing listens on the configured address); NATS stays.
	e.kafkaAddr = "127.0.0.1:" + strconv.Itoa(freePort(t))
	svc2, _ := e.start()
	eventually(t, "not ready, naming the Kafka connect", func() bool {
		err := svc2.Ready()
		return err != nil && strings.Contains(err.Error(), "connecting to brokers: kafka")
	})
	e.publishNATS("delay.h93", []byte("published-after"), "delay-after", "0", "delay-target", "orders.h93")
	e.clk.Advance(6 * time.Second)
	// advanceUntil: a task that came due before its transport was
	// connected waits as in an outage, for its retry time.
	e.advanceUntil("both NATS deliveries while only Kafka is down", func(ds []delivery) bool {
		m := byValue(ds, "orders.h93")
		return len(m["stored-before"]) > 0 && len(m["published-after"]) > 0
	})
}
