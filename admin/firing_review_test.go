package admin

import (
	"net/http"
	"strings"
	"testing"
)

// browserPost sends the request a web page makes with
// fetch(url, {method: "POST", mode: "no-cors", body: "..."}): a "simple"
// request, sent without a CORS preflight, with the headers browsers add.
func browserPost(t *testing.T, url, origin, site string) resp {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(`{"reason":"x"}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "text/plain;charset=UTF-8")
	req.Header.Set("Origin", origin)
	req.Header.Set("Sec-Fetch-Site", site)
	req.Header.Set("Sec-Fetch-Mode", "no-cors")
	return send(t, req)
}

// TestFiringCrossSiteRefused (review R224): POST /v1/firing/pause and
// /resume are the admin API's first state-changing routes a browser sends
// without a preflight (DELETE needs one). Without a token, the default
// (admin.listen 127.0.0.1:8080, and the dev sandbox), any web page the
// operator opens could pause every delivery, durably, or end a planned
// pause. A cross-site browser request must be refused (403); curl, which
// sends no Origin nor Sec-Fetch-Site, and a same-origin page still work.
func TestFiringCrossSiteRefused(t *testing.T) {
	f := newFixture(t, "", nil)
	r := browserPost(t, f.srv.URL+"/v1/firing/pause", "https://evil.example", "cross-site")
	if r.code != http.StatusForbidden || f.e.FiringPaused() {
		t.Fatalf("cross-site POST /v1/firing/pause = %d %q, paused %v; want 403, not paused", r.code, r.body, f.e.FiringPaused())
	}
	if r.hdr.Get("Content-Type") != "application/json" {
		t.Fatalf("refusal Content-Type %q, want JSON like every other error", r.hdr.Get("Content-Type"))
	}
	if r := browserPost(t, f.srv.URL+"/v1/firing/pause", f.srv.URL, "same-origin"); r.code != http.StatusOK || !f.e.FiringPaused() {
		t.Fatalf("same-origin POST /v1/firing/pause = %d %q; want 200, paused", r.code, r.body)
	}
	if r := browserPost(t, f.srv.URL+"/v1/firing/resume", "https://evil.example", "cross-site"); r.code != http.StatusForbidden || !f.e.FiringPaused() {
		t.Fatalf("cross-site POST /v1/firing/resume = %d %q, paused %v; want 403, still paused", r.code, r.body, f.e.FiringPaused())
	}
	if r := doBody(t, "POST", f.srv.URL+"/v1/firing/resume", "", ""); r.code != http.StatusOK || f.e.FiringPaused() {
		t.Fatalf("POST /v1/firing/resume as curl sends it = %d %q; want 200, resumed", r.code, r.body)
	}
}
