package admin

import (
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

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
		for _, k := range []string{"reason", "remote", "path", "held_back"} {
			if _, ok := m[k]; !ok {
				t.Errorf("%q without %s: %v", l.Message, k, m)
			}
		}
	}
}

// TestRefusedRequestsLoggedPerClient (review R200): the refusals were
// throttled per reason alone, so a second client refused for the same
// reason (a token guesser beside a scraper with a stale token) was held
// back behind the first one's line for up to 30 s, counted in its
// held-back count under the first one's address. Per reason and client
// host now (the port left out: each connection has its own); past 64 of
// those at once they share the throttle's overflow line.
func TestRefusedRequestsLoggedPerClient(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	h := NewHandler(Options{Token: "tok", Logger: zap.New(core)})
	for i, remote := range []string{"192.0.2.1:40000", "192.0.2.1:40001", "192.0.2.2:40000", "[2001:db8::1]:5000", "192.0.2.2:40002"} {
		r := httptest.NewRequest("GET", "/v1/stats", nil)
		r.RemoteAddr = remote
		r.Header.Set("Authorization", "Bearer wrong")
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		if w.Code != 401 {
			t.Fatalf("request %d: %d, want 401", i, w.Code)
		}
	}
	var remotes []string
	for _, l := range logs.FilterMessage("admin: request refused").All() {
		remotes = append(remotes, l.ContextMap()["remote"].(string))
	}
	if len(remotes) != 3 {
		t.Fatalf("refused requests of three clients logged for %q, want one line per client", remotes)
	}
}

// TestRefusedRequestLineCutsMethod (review R200): the refused request's
// line cut the path to 256 bytes but logged the method whole, up to the
// 64 KiB a request line may take (any method reaches the token check:
// the route's 405 is behind it).
func TestRefusedRequestLineCutsMethod(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	h := NewHandler(Options{Token: "tok", Logger: zap.New(core)})
	r := httptest.NewRequest(strings.Repeat("X", 60<<10), "/v1/stats", nil)
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	if w.Code != 401 {
		t.Fatalf("%d, want 401", w.Code)
	}
	lines := logs.FilterMessage("admin: request refused").All()
	if len(lines) != 1 {
		t.Fatalf("%d lines, want 1", len(lines))
	}
	if m := lines[0].ContextMap()["method"].(string); len(m) > 64 {
		t.Fatalf("method logged with %d bytes, want it cut (at most 64)", len(m))
	}
}

// TestRefusedRequestsForgottenCounted (review R210): the throttle
// remembers 64 client hosts; past them, hosts not logged within 30 s are
// forgotten, and with AllowEach their held-back refusals went with them,
// reported nowhere. The next line counts them in held_back_forgotten.
func TestRefusedRequestsForgottenCounted(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	now := time.Unix(1_000_000, 0)
	s := &server{log: zap.New(core), now: func() time.Time { return now }}
	refuse := func(remote string) {
		r := httptest.NewRequest("GET", "/v1/stats", nil)
		r.RemoteAddr = remote
		s.logRefused(r, "bad token")
	}
	for i := range 64 {
		refuse(fmt.Sprintf("192.0.2.%d:40000", i))
		refuse(fmt.Sprintf("192.0.2.%d:40001", i)) // held back
	}
	now = now.Add(31 * time.Second)
	refuse("198.51.100.1:40000") // a new host: the 64 idle ones are forgotten
	lines := logs.FilterMessage("admin: request refused").All()
	if len(lines) != 65 {
		t.Fatalf("%d lines, want 65 (one per host)", len(lines))
	}
	if got := lines[64].ContextMap()["held_back_forgotten"]; got != int64(64) {
		t.Fatalf("the new host's line: held_back_forgotten %v, want 64 (the forgotten hosts' held-back refusals)", got)
	}
}
