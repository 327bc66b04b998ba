package metrics

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/delaybridge/delaybridge/codec"
)

// TestDeadLetterReasonsExist: each dead-letter reason is exported at 0
// before its first dead letter, so alerts on its rate see the first one.
func TestDeadLetterReasonsExist(t *testing.T) {
	r := prometheus.NewRegistry()
	New(r)
	mfs, err := r.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "delaybridge_dead_lettered_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "reason" {
					got[l.GetValue()] = m.GetCounter().GetValue()
				}
			}
		}
	}
	if len(got) != len(codec.Codes) {
		t.Fatalf("%d reasons exported, want %d: %v", len(got), len(codec.Codes), got)
	}
	for _, c := range codec.Codes {
		if v, ok := got[string(c)]; !ok || v != 0 {
			t.Errorf("reason %q: %v, %v; want 0", c, v, ok)
		}
	}
}

// TestInitSeries: the §7 series of the given sources and transports are
// exported at 0 before their first event, and none of another source or
// transport is made up.
func TestInitSeries(t *testing.T) {
	for _, tc := range []struct {
		name       string
		sources    []string
		transports []string
		want       []string // name{labels} of every series at 0
	}{
		{name: "none", want: nil},
		{name: "kafka", sources: []string{"delay", "delay.slow"}, transports: []string{"kafka"}, want: []string{
			"delaybridge_ingested_total{source=delay}", "delaybridge_ingested_total{source=delay.slow}",
			"delaybridge_cancelled_total{source=delay}", "delaybridge_cancelled_total{source=delay.slow}",
			"delaybridge_replaced_total{source=delay}", "delaybridge_replaced_total{source=delay.slow}",
			"delaybridge_source_errors_total{source=delay}", "delaybridge_source_errors_total{source=delay.slow}",
			"delaybridge_fired_total{kind=task,transport=kafka}", "delaybridge_fired_total{kind=dlq,transport=kafka}",
			"delaybridge_fire_lateness_seconds{transport=kafka}", "delaybridge_publish_retries_total{transport=kafka}",
			"delaybridge_dropped_total{source=delay,why=older}", "delaybridge_dropped_total{source=delay,why=cancelled}",
			"delaybridge_dropped_total{source=delay.slow,why=older}", "delaybridge_dropped_total{source=delay.slow,why=cancelled}",
			"delaybridge_publish_seconds{transport=kafka}", "delaybridge_best_effort_deliveries_total{transport=kafka}",
		}},
		{name: "both", sources: []string{"delay", "DELAY"}, transports: []string{"kafka", "nats"}, want: []string{
			"delaybridge_ingested_total{source=delay}", "delaybridge_ingested_total{source=DELAY}",
			"delaybridge_cancelled_total{source=delay}", "delaybridge_cancelled_total{source=DELAY}",
			"delaybridge_replaced_total{source=delay}", "delaybridge_replaced_total{source=DELAY}",
			"delaybridge_source_errors_total{source=delay}", "delaybridge_source_errors_total{source=DELAY}",
			"delaybridge_fired_total{kind=task,transport=kafka}", "delaybridge_fired_total{kind=dlq,transport=kafka}",
			"delaybridge_fired_total{kind=task,transport=nats}", "delaybridge_fired_total{kind=dlq,transport=nats}",
			"delaybridge_fire_lateness_seconds{transport=kafka}", "delaybridge_fire_lateness_seconds{transport=nats}",
			"delaybridge_publish_retries_total{transport=kafka}", "delaybridge_publish_retries_total{transport=nats}",
			"delaybridge_dropped_total{source=delay,why=older}", "delaybridge_dropped_total{source=delay,why=cancelled}",
			"delaybridge_dropped_total{source=DELAY,why=older}", "delaybridge_dropped_total{source=DELAY,why=cancelled}",
			"delaybridge_publish_seconds{transport=kafka}", "delaybridge_publish_seconds{transport=nats}",
			"delaybridge_best_effort_deliveries_total{transport=kafka}", "delaybridge_best_effort_deliveries_total{transport=nats}",
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := prometheus.NewRegistry()
			New(r).InitSeries(tc.sources, tc.transports)
			mfs, err := r.Gather()
			if err != nil {
				t.Fatal(err)
			}
			counted := map[string]bool{
				"delaybridge_ingested_total": true, "delaybridge_cancelled_total": true, "delaybridge_replaced_total": true,
				"delaybridge_source_errors_total": true, "delaybridge_fired_total": true,
				"delaybridge_fire_lateness_seconds": true, "delaybridge_publish_retries_total": true,
				"delaybridge_dropped_total": true, "delaybridge_publish_seconds": true, "delaybridge_best_effort_deliveries_total": true,
			}
			got := map[string]bool{}
			for _, mf := range mfs {
				if !counted[mf.GetName()] {
					continue
				}
				for _, m := range mf.GetMetric() {
					var labels []string
					for _, l := range m.GetLabel() {
						labels = append(labels, l.GetName()+"="+l.GetValue())
					}
					v := m.GetCounter().GetValue() + float64(m.GetHistogram().GetSampleCount())
					if v != 0 {
						t.Errorf("%s %v = %v, want 0", mf.GetName(), labels, v)
					}
					got[mf.GetName()+"{"+strings.Join(labels, ",")+"}"] = true
				}
			}
			for _, w := range tc.want {
				if !got[w] {
					t.Errorf("no series %s", w)
				}
				delete(got, w)
			}
			for g := range got {
				t.Errorf("unexpected series %s", g)
			}
		})
	}
}
