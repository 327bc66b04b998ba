package admin

import (
	"net/http/httptest"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestRefusedRequestsLogged (hunt H204): requests refused for their token
// were not logged at all (1.18 million bad requests in 45 s, no line), so
// a scraper sending a stale token or a client guessing tokens left no
// trace. Each kind of refusal is logged at Warn once, then once per 30 s
// with the count held back, naming the remote address and the path.
func TestRefusedRequestsLogged(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	h := NewHandler(Options{Token: "tok", MetricsToken: "scrape", Logger: zap.New(core)})
	srv := httptest.NewServer(h)
	defer srv.Close()
	for range 50 {
		do(t, "GET", srv.URL+"/v1/stats", "Bearer wrong")
		do(t, "DELETE", srv.URL+"/v1/tasks/delay/x", "")
		do(t, "GET", srv.URL+"/v1/stats", "Bearer scrape")
		do(t, "GET", srv.URL+"/readyz", "") // open: nothing to log
	}
	lines := logs.FilterLevelExact(zapcore.WarnLevel).All()
	if len(lines) != 3 {
		var got []string
		for _, l := range lines {
			got = append(got, l.Message)
		}
		t.Fatalf("%d Warn lines for 150 refused requests of three kinds, want 3 (each kind once, then once per 30 s): %q", len(lines), got)
	}
	for _, l := range lines {
		m := l.ContextMap()
		for _, k := range []string{"reason", "remote", "path", "suppressed"} {
			if _, ok := m[k]; !ok {
				t.Errorf("%q without %s: %v", l.Message, k, m)
			}
		}
	}
}
