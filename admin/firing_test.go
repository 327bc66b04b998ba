package admin

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/delaybridge/delaybridge/shard"
)

// doBody is do with a request body.
func doBody(t *testing.T, method, url, token, body string) resp {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", token)
	}
	return send(t, req)
}

// firingBody decodes a shard.FiringState answer as a client would.
type firingBody struct {
	Paused     bool `json:"paused"`
	CatchingUp bool `json:"catching_up"`
	Operator   *struct {
		Since  string `json:"since"`
		Reason string `json:"reason"`
	} `json:"operator"`
	InFlight *int `json:"in_flight"`
}

func decodeFiring(t *testing.T, r resp) firingBody {
	t.Helper()
	if r.code != http.StatusOK || r.hdr.Get("Content-Type") != "application/json" {
		t.Fatalf("answer %d %q (%s), want 200 JSON", r.code, r.body, r.hdr.Get("Content-Type"))
	}
	var b firingBody
	dec := json.NewDecoder(strings.NewReader(r.body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&b); err != nil {
		t.Fatalf("decode %q: %v", r.body, err)
	}
	if b.InFlight == nil || *b.InFlight != 0 { // the engine is not running
		t.Fatalf("in_flight in %q, want 0", r.body)
	}
	return b
}

// TestFiringPauseResume: GET /v1/firing, POST /v1/firing/pause with and
// without a reason, POST /v1/firing/resume, on a real engine, with the
// token; the engine's own state agrees with each answer.
func TestFiringPauseResume(t *testing.T) {
	f := newFixture(t, "adm", nil)
	const tok = "Bearer adm"
	if b := decodeFiring(t, do(t, "GET", f.srv.URL+"/v1/firing", tok)); b.Paused || b.CatchingUp || b.Operator != nil {
		t.Fatalf("GET /v1/firing before a pause = %+v", b)
	}
	if r := doBody(t, "POST", f.srv.URL+"/v1/firing/pause", "", `{"reason":"x"}`); r.code != http.StatusUnauthorized || f.e.FiringPaused() {
		t.Fatalf("pause without the token = %d %q, paused %v; want 401, not paused", r.code, r.body, f.e.FiringPaused())
	}

	b := decodeFiring(t, doBody(t, "POST", f.srv.URL+"/v1/firing/pause", tok, `{"reason": "orders-svc deploy"}`))
	if !b.Paused || b.CatchingUp || b.Operator == nil || b.Operator.Since != "2026-11-22T00:00:00.000Z" || b.Operator.Reason != "orders-svc deploy" {
		t.Fatalf("POST /v1/firing/pause = %+v", b)
	}
	if st := f.e.Firing(); st.Operator == nil || st.Operator.Reason != "orders-svc deploy" {
		t.Fatalf("engine after the pause: %+v", st)
	}
	if got := decodeFiring(t, do(t, "GET", f.srv.URL+"/v1/firing", tok)); got.Operator == nil || *got.Operator != *b.Operator {
		t.Fatalf("GET /v1/firing = %+v, want %+v", got, b)
	}
	// No body, or one without a reason, keeps the pause as it is.
	for _, body := range []string{"", "  \n", "{}", `{"reason": null}`} {
		got := decodeFiring(t, doBody(t, "POST", f.srv.URL+"/v1/firing/pause", tok, body))
		if got.Operator == nil || *got.Operator != *b.Operator {
			t.Fatalf("POST /v1/firing/pause with body %q = %+v, want %+v", body, got, b)
		}
	}

	b = decodeFiring(t, doBody(t, "POST", f.srv.URL+"/v1/firing/resume", tok, ""))
	if b.Paused || b.Operator != nil || f.e.FiringPaused() {
		t.Fatalf("POST /v1/firing/resume = %+v (engine paused %v)", b, f.e.FiringPaused())
	}
	if b := decodeFiring(t, doBody(t, "POST", f.srv.URL+"/v1/firing/resume", tok, "")); b.Paused {
		t.Fatalf("a second resume = %+v", b)
	}
	// The catch-up pause shows, and an operator's resume does not end it.
	f.e.PauseFiring()
	if b := decodeFiring(t, doBody(t, "POST", f.srv.URL+"/v1/firing/resume", tok, "")); !b.Paused || !b.CatchingUp || b.Operator != nil {
		t.Fatalf("resume while catching up = %+v, want still paused, catching up", b)
	}
	f.e.ResumeFiring()
}

// TestFiringPauseBadRequests: bodies and methods the pause refuses, with
// a JSON error, leaving firing as it was.
func TestFiringPauseBadRequests(t *testing.T) {
	f := newFixture(t, "", nil)
	for _, tc := range []struct {
		name, body string
		code       int
		says       string
	}{
		{"not JSON", "pause please", 400, "body"},
		{"array", `["x"]`, 400, "body"},
		{"reason not a string", `{"reason": 5}`, 400, "body"},
		{"unknown field", `{"why": "x"}`, 400, "why"},
		{"two objects", `{"reason": "a"} {"reason": "b"}`, 400, "after the object"},
		{"reason too long", `{"reason": "` + strings.Repeat("x", shard.MaxPauseReason+1) + `"}`, 400, "at most 1024 bytes"},
		{"control character", `{"reason": "two\nlines"}`, 400, "without control"},
		{"not UTF-8", "{\"reason\": \"\xff\"}", 400, "UTF-8"},
		{"body too large", `{"reason": "` + strings.Repeat(" ", maxPauseBody) + `"}`, 413, "body over"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := doBody(t, "POST", f.srv.URL+"/v1/firing/pause", "", tc.body)
			if r.code != tc.code {
				t.Fatalf("POST /v1/firing/pause %q = %d %q, want %d", tc.body, r.code, r.body, tc.code)
			}
			if msg := jsonError(t, r); !strings.Contains(msg, tc.says) {
				t.Fatalf("error %q does not say %q", msg, tc.says)
			}
			if f.e.FiringPaused() {
				t.Fatal("paused by a refused request")
			}
		})
	}
	// The longest reason, every byte escaped, fits the body's bound.
	long := `{"reason": "` + strings.Repeat(`\u00e9`, shard.MaxPauseReason/2) + `"}`
	if b := decodeFiring(t, doBody(t, "POST", f.srv.URL+"/v1/firing/pause", "", long)); b.Operator == nil || len(b.Operator.Reason) != shard.MaxPauseReason {
		t.Fatalf("the longest reason escaped: %+v", b)
	}
	for _, c := range [][2]string{{"GET", "/v1/firing/pause"}, {"GET", "/v1/firing/resume"}, {"DELETE", "/v1/firing"}, {"POST", "/v1/firing"}} {
		r := do(t, c[0], f.srv.URL+c[1], "")
		if r.code != http.StatusMethodNotAllowed || r.hdr.Get("Allow") == "" {
			t.Fatalf("%s %s = %d (Allow %q), want 405 with Allow", c[0], c[1], r.code, r.hdr.Get("Allow"))
		}
	}
}
