package admin

import (
	"net/http"
	"net/http/httptest"
	"testing"
)

// TestPprofWrongMethod: README "Admin API and metrics" (and this package's
// doc) says "a method a route does not serve is 405 with Allow". The
// /debug/pprof/ routes (admin.pprof: true) are registered as "GET ..."
// patterns outside route(), so another method falls through to the "/"
// catch-all: 404 "no such endpoint: /debug/pprof/", which reads as if
// profiling were off.
func TestPprofWrongMethod(t *testing.T) {
	e, reg := openEngine(t)
	srv := httptest.NewServer(NewHandler(Options{Engine: e, Gatherer: reg, Pprof: true, Token: "tok"}))
	t.Cleanup(srv.Close)
	for _, p := range []string{"/debug/pprof/", "/debug/pprof/cmdline", "/debug/pprof/heap"} {
		if r := do(t, http.MethodGet, srv.URL+p, "Bearer tok"); r.code != http.StatusOK {
			t.Fatalf("GET %s = %d, want 200", p, r.code)
		}
		r := do(t, http.MethodPost, srv.URL+p, "Bearer tok")
		if r.code != http.StatusMethodNotAllowed || r.hdr.Get("Allow") == "" {
			t.Errorf("POST %s = %d (Allow %q) %q, want 405 with Allow", p, r.code, r.hdr.Get("Allow"), r.body)
		}
	}
}
