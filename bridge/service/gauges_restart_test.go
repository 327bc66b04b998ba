package service

import (
	"fmt"
	"strconv"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
)

// scraped sums the values of a family's series in what the service's
// /metrics registry gathers, for the series whose labels include match.
func scraped(t *testing.T, svc *Service, name string, match map[string]string) (float64, bool) {
	t.Helper()
	mfs, err := svc.reg.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	var sum float64
	found := false
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			for k, v := range match {
				ok := false
				for _, lp := range m.GetLabel() {
					ok = ok || lp.GetName() == k && lp.GetValue() == v
				}
				if !ok {
					continue series
				}
			}
			found = true
			sum += value(m)
		}
	}
	return sum, found
}

func value(m *dto.Metric) float64 {
	switch {
	case m.Counter != nil:
		return m.Counter.GetValue()
	case m.Gauge != nil:
		return m.Gauge.GetValue()
	}
	return 0
}

// checkScrape fails when what /metrics says of the engine differs from
// the engine: pending, wheel entries, held per shard, firing paused, ready.
func checkScrape(t *testing.T, when string, svc *Service) {
	t.Helper()
	st := svc.Engine().Stats()
	for _, s := range st.Shards {
		sh := map[string]string{"shard": strconv.Itoa(s.Shard)}
		for _, c := range []struct {
			name string
			want float64
		}{
			{"delaybridge_pending_tasks", float64(s.Pending)},
			{"delaybridge_wheel_entries", float64(s.InWheel)},
			{"delaybridge_held_tasks", float64(s.Held)},
		} {
			if got, ok := scraped(t, svc, c.name, sh); !ok || got != c.want {
				t.Errorf("%s: %s{shard=%q} = %v (exported %v), the engine has %v", when, c.name, sh["shard"], got, ok, c.want)
			}
		}
	}
	paused := 0.0
	if svc.Engine().FiringPaused() {
		paused = 1
	}
	if got, _ := scraped(t, svc, "delaybridge_firing_paused", nil); got != paused {
		t.Errorf("%s: delaybridge_firing_paused = %v, the engine %v", when, got, paused)
	}
}

// TestScrapeAfterRestart: through real brokers, what /metrics says of the
// store (pending, wheel entries, held tasks per shard) matches the engine
// while a target is down, after a restart on the same store while it is
// still down, and once it is back; the restarted process counts only the
// messages it takes in (none read again) and the deliveries it makes
// (hunt H200).
func TestScrapeAfterRestart(t *testing.T) {
	e := newEnv(t, heldRetryCfg)
	svc, stop := e.start()
	fail := e.failProduceTo(kafkaOut)
	const kn, far, nn = 6, 2, 3
	for i := range kn {
		id := fmt.Sprintf("k%d", i)
		e.publishKafka(int32(i%3), time.Time{}, []byte(id), []byte(id), "delay-after", "2s", "delay-target", "orders")
	}
	for i := range far {
		id := fmt.Sprintf("f%d", i)
		e.publishKafka(int32(i%3), time.Time{}, []byte(id), []byte(id), "delay-after", "48h", "delay-target", "orders")
	}
	for i := range nn {
		id := fmt.Sprintf("n%d", i)
		e.publishNATS("delay.a", []byte(id), "delay-after", "2s", "delay-target", "orders.nn", "delay-id", id)
	}
	waitIngested(t, svc, kn+far+nn)
	checkScrape(t, "ingested", svc)
	fail.Store(true)
	advanceUntilCond(t, e, "kafka tasks held, nats ones delivered", func() bool {
		return svc.Engine().Stats().Held == kn && len(byValue(e.deliveries(), "orders.nn")) == nn
	})
	eventually(t, "nats deliveries deleted", func() bool { return svc.Engine().Stats().Pending == kn+far })
	checkScrape(t, "held", svc)
	if got, _ := scraped(t, svc, "delaybridge_ingested_total", nil); got != kn+far+nn {
		t.Errorf("ingested %v, want %d", got, kn+far+nn)
	}
	stop()

	svc, _ = e.start()
	checkScrape(t, "restarted", svc)
	eventually(t, "caught up", func() bool { return !svc.Engine().FiringPaused() })
	for range 3 {
		e.clk.Advance(time.Second)
		time.Sleep(30 * time.Millisecond)
	}
	checkScrape(t, "restarted, target still down", svc)
	if st := svc.Engine().Stats(); st.Held != kn || st.Pending != kn+far {
		t.Fatalf("after the restart: %+v", st)
	}
	fail.Store(false)
	e.advanceUntil("kafka tasks delivered", func(ds []delivery) bool { return len(byValue(ds, kafkaOut)) >= kn })
	eventually(t, "deliveries deleted", func() bool { return svc.Engine().Stats().Pending == far })
	checkScrape(t, "delivered", svc)
	for _, c := range []struct {
		name  string
		match map[string]string
		want  float64
	}{
		{"delaybridge_ingested_total", nil, 0}, // nothing read again
		{"delaybridge_fired_total", map[string]string{"transport": "kafka", "kind": "task"}, kn},
		{"delaybridge_fired_total", map[string]string{"transport": "nats"}, 0},
		{"delaybridge_held_tasks", nil, 0},
		{"delaybridge_pending_tasks", nil, far},
	} {
		if got, _ := scraped(t, svc, c.name, c.match); got != c.want {
			t.Errorf("after the restart: %s%v = %v, want %v", c.name, c.match, got, c.want)
		}
	}
}
