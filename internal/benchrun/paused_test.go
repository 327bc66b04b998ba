package benchrun

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestFiringPaused(t *testing.T) {
	for _, tc := range []struct {
		name   string
		status int
		body   string
		want   bool
	}{
		{"resumed", 200, "# HELP delaybridge_firing_paused x\n# TYPE delaybridge_firing_paused gauge\ndelaybridge_firing_paused 0\n", false},
		{"paused", 200, "delaybridge_firing_paused 1\n", true},
		{"missing", 200, "delaybridge_ready 1\n", true},
		{"refused", 401, "delaybridge_firing_paused 0\n", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path != "/metrics" || r.URL.Query().Get("name[]") != "delaybridge_firing_paused" {
					http.NotFound(w, r)
					return
				}
				w.WriteHeader(tc.status)
				_, _ = w.Write([]byte(tc.body))
			}))
			defer srv.Close()
			cb := &childBridge{admin: strings.TrimPrefix(srv.URL, "http://")}
			if got := cb.firingPaused(); got != tc.want {
				t.Fatalf("firingPaused = %v, want %v", got, tc.want)
			}
		})
	}
	if !(&childBridge{admin: "127.0.0.1:1"}).firingPaused() {
		t.Fatal("firingPaused = false for a bridge that does not answer")
	}
}
