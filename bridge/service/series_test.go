package service

import (
	"io"
	"net/http/httptest"
	"strings"
	"testing"
)

// TestDashboardSeriesAtStart: README "Admin API and metrics": "the
// series of the configured sources and transports exist at 0 from the
// start, so an alert on a rate sees the first event". The dashboard
// queries delaybridge_dropped_total (by why), delaybridge_held_tasks (by
// transport) and delaybridge_best_effort_deliveries_total (by transport):
// each must be there at 0 before its first event.
func TestDashboardSeriesAtStart(t *testing.T) {
	e := newEnv(t, "")
	svc, _ := e.start()
	eventually(t, "ready", func() bool { return svc.Ready() == nil })
	srv := httptest.NewServer(svc.AdminHandler())
	defer srv.Close()
	resp, err := srv.Client().Get(srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`delaybridge_dropped_total{source="delay",why="older"} 0`,
		`delaybridge_dropped_total{source="delay",why="cancelled"} 0`,
		`delaybridge_held_tasks{shard="0",transport="kafka"} 0`,
		`delaybridge_best_effort_deliveries_total{transport="nats"} 0`,
	} {
		if !strings.Contains(string(body), want) {
			t.Errorf("/metrics of a started bridge has no %s", want)
		}
	}
}
