package metrics

import (
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
