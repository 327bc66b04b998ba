package admin

import (
	"net/http"
	"strings"
	"testing"
)

// hostPost is a POST to url as a browser sends it with Host host (the
// name in the page's address), Origin origin and Sec-Fetch-Site site;
// origin and site empty: as curl sends it.
func hostPost(t *testing.T, url, host, origin, site string) resp {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(`{"reason":"x"}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Host = host
	if origin != "" {
		req.Header.Set("Content-Type", "text/plain;charset=UTF-8")
		req.Header.Set("Origin", origin)
		req.Header.Set("Sec-Fetch-Mode", "no-cors")
	}
	if site != "" {
		req.Header.Set("Sec-Fetch-Site", site)
	}
	return send(t, req)
}

// TestR226FiringDNSRebindingRefused (review R226): the cross-origin
// protection of c11afde compares Origin with Host, and a page of another
// site that rebinds its own name to 127.0.0.1 (DNS rebinding) sends its
// own name as both: to the browser it is the same origin
// (Sec-Fetch-Site: same-origin). So without a token (the default on
// 127.0.0.1, the dev sandbox, a kubectl port-forward to a bridge without
// one) any page could still pause every delivery, durably: 200 and
// paused without the fix. A browser's state-changing request is taken
// only for a Host that is an IP address or localhost when no token is
// configured (with one, the page cannot send it). Clients without browser
// headers (curl, with any Host: a service name behind
// allow_insecure_listen) and a same-origin page on 127.0.0.1 or localhost
// still work.
func TestR226FiringDNSRebindingRefused(t *testing.T) {
	f := newFixture(t, "", nil)
	port := f.srv.URL[strings.LastIndex(f.srv.URL, ":")+1:]
	for _, host := range []string{"rebind.example:" + port, "rebind.example.:" + port} {
		r := hostPost(t, f.srv.URL+"/v1/firing/pause", host, "http://"+host, "same-origin")
		if r.code != http.StatusForbidden || f.e.FiringPaused() {
			t.Fatalf("DNS-rebound same-origin POST /v1/firing/pause (Host %s) = %d %q, paused %v; want 403, not paused", host, r.code, r.body, f.e.FiringPaused())
		}
		if r.hdr.Get("Content-Type") != "application/json" {
			t.Fatalf("refusal Content-Type %q, want JSON like every other error", r.hdr.Get("Content-Type"))
		}
	}
	// Origin without Sec-Fetch-Site (an older browser).
	if r := hostPost(t, f.srv.URL+"/v1/firing/pause", "rebind.example:"+port, "http://rebind.example:"+port, ""); r.code != http.StatusForbidden || f.e.FiringPaused() {
		t.Fatalf("DNS-rebound POST with Origin only = %d %q, paused %v; want 403, not paused", r.code, r.body, f.e.FiringPaused())
	}
	for _, tc := range []struct{ host, origin, site string }{
		{"127.0.0.1:" + port, "http://127.0.0.1:" + port, "same-origin"},
		{"localhost:" + port, "http://localhost:" + port, "same-origin"},
		{"[::1]:" + port, "http://[::1]:" + port, "same-origin"},
		{"bridge:8080", "", ""}, // curl to a service name
		{"localhost:" + port, "", "none"},
	} {
		for _, path := range []string{"/v1/firing/pause", "/v1/firing/resume"} {
			if r := hostPost(t, f.srv.URL+path, tc.host, tc.origin, tc.site); r.code != http.StatusOK {
				t.Fatalf("POST %s with Host %s, Origin %q, Sec-Fetch-Site %q = %d %q; want 200", path, tc.host, tc.origin, tc.site, r.code, r.body)
			}
		}
	}
	// With a token the page cannot authenticate: a browser's request
	// with its token is taken whatever the Host.
	ft := newFixture(t, "tok", nil)
	req, err := http.NewRequest(http.MethodPost, ft.srv.URL+"/v1/firing/pause", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Host = "bridge.example:8080"
	req.Header.Set("Origin", "http://bridge.example:8080")
	req.Header.Set("Sec-Fetch-Site", "same-origin")
	req.Header.Set("Authorization", "Bearer tok")
	r, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	r.Body.Close()
	if r.StatusCode != http.StatusOK || !ft.e.FiringPaused() {
		t.Fatalf("same-origin POST with the token on Host bridge.example = %d; want 200, paused", r.StatusCode)
	}
}
