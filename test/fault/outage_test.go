package fault

import (
	"net/http"
	"testing"
	"time"
)

// TestBrokerOutage stops each broker under load and starts it again as the
// same broker (same port, same data): Kafka by closing the kfake cluster
// and reopening it from its data dir, NATS by shutting the server down and
// starting a new one on the same port and store dir. During the outage
// /readyz must answer 503 and the bridge must keep running (no crash loop);
// after it, /readyz answers 200 again and the backlog drains with nothing
// lost.
func TestBrokerOutage(t *testing.T) {
	t.Parallel()
	outage := 3 * time.Second
	if long() {
		outage = 30 * time.Second
	}
	b := newBrokers(t, 0)
	col := b.collect(t)
	r := newRunner(t, b, bridgeConfig{})
	p := r.start()
	p.waitReady(90 * time.Second)
	l := startLoad(t, b, 5*time.Millisecond)
	time.Sleep(time.Second)

	for _, br := range []struct {
		name        string
		stop, start func()
	}{
		{"kafka", b.stopKafka, b.startKafka},
		{"nats", b.stopNATS, b.startNATS},
	} {
		br.stop()
		began := time.Now()
		// Hold the outage for its length, and until /readyz has said 503
		// (with a cap, so a bridge that never notices fails the test).
		notReadyAfter := time.Duration(-1)
		for time.Since(began) < outage || (notReadyAfter < 0 && time.Since(began) < 60*time.Second) {
			if notReadyAfter < 0 && p.readyz() == http.StatusServiceUnavailable {
				notReadyAfter = time.Since(began)
			}
			if !p.running() {
				t.Fatalf("%s outage: bridge exited after %v: %v", br.name, time.Since(began), p.err)
			}
			time.Sleep(50 * time.Millisecond)
		}
		held := time.Since(began)
		br.start()
		restarted := time.Now()
		p.waitReady(2 * time.Minute)
		t.Logf("%s outage of %v: /readyz 503 after %v; 200 again %v after the broker came back",
			br.name, held.Round(time.Millisecond), notReadyAfter.Round(time.Millisecond), time.Since(restarted).Round(time.Millisecond))
		if notReadyAfter < 0 {
			t.Errorf("%s outage: /readyz never answered 503 in %v", br.name, held)
		}
		time.Sleep(time.Second) // load through the recovered broker
	}

	sent := l.finish()
	var tl tally
	ok := waitFor(drainWait, func() bool {
		tl = count(sent, col.byValue(isTarget))
		return tl.lost == 0
	})
	t.Logf("sent %d (publisher errors during outages %d), delivered %d unique, %d duplicates, %d lost, %d delivered whose publish reported an error",
		tl.sent, l.fails.Load(), tl.delivered, tl.duplicates, tl.lost, tl.unsent)
	if !p.running() {
		t.Errorf("bridge exited: %v", p.err)
	}
	if !ok || tl.lost > 0 {
		t.Errorf("%d acknowledged messages lost", tl.lost)
	}
	if dl := col.byValue(isDLQ); len(dl) > 0 {
		t.Errorf("%d good messages dead-lettered during the outages", len(dl))
	}
	if err := p.term(); err != nil {
		t.Errorf("bridge stop: %v", err)
	}
}
