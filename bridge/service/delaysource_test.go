package service

import (
	"strings"
	"testing"
)

// TestTargetThatIsADelaySource: a delay-target that is one of the bridge's
// own delay sources (the Kafka delay topic, a subject within the NATS
// delay subjects) is dead-lettered target-not-allowed at once: delivered
// there without its control headers, it would only come back as a
// missing-due dead letter, under a detail that misleads the publisher.
func TestTargetThatIsADelaySource(t *testing.T) {
	e := newEnv(t, "")
	e.start()
	now := e.clk.Now()
	e.publishKafka(0, now, []byte("k1"), []byte("to-delay-topic"), "delay-after", "1s", "delay-target", "delay")
	e.publishKafka(0, now, []byte("k2"), []byte("to-delay-subject"), "delay-after", "1s", "delay-target", "nats:delay.x")
	got := e.waitFor("two dead letters", func(ds []delivery) bool {
		return countDest(ds, func(d delivery) bool { return d.dest == kafkaDLQ }) >= 2
	})
	vals := byValue(got, kafkaDLQ)
	for _, v := range []string{"to-delay-topic", "to-delay-subject"} {
		d := one(t, vals, v)
		if code, detail := d.header("delay-error"), d.header("delay-error-detail"); code != "target-not-allowed" || !strings.Contains(detail, "delay source") {
			t.Errorf("%s dead-lettered %q (%s), want target-not-allowed naming the delay source", v, code, detail)
		}
	}
}
