package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/clock"
	"github.com/delaybridge/delaybridge/metrics"
	"github.com/delaybridge/delaybridge/shard"
)

var t0 = time.Date(2026, 11, 22, 0, 0, 0, 0, time.UTC)

const source = "delay"

// fixture is a real engine (shard.Open on a temp dir, fake clock, not
// running, so nothing fires) holding two pending tasks, behind the handler.
type fixture struct {
	e   *shard.Engine
	reg *prometheus.Registry
	srv *httptest.Server
}

// openEngine opens a 4-shard engine on a fake clock at t0, closed with the
// test, and the registry of its metrics.
func openEngine(t testing.TB) (*shard.Engine, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	e, err := shard.Open(shard.Options{
		Dir:     t.TempDir(),
		Shards:  4,
		Clock:   clock.NewFake(t0),
		Logger:  zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)),
		Metrics: metrics.New(reg),
	})
	if err != nil {
		t.Fatalf("shard.Open: %v", err)
	}
	t.Cleanup(func() {
		if err := e.Close(); err != nil {
			t.Errorf("engine close: %v", err)
		}
	})
	return e, reg
}

func newFixture(t *testing.T, token string, ready func() error) *fixture {
	t.Helper()
	e, reg := openEngine(t)
	tasks := []codec.Task{task("order-1", 1, time.Hour), task("tenant/42", 2, 2*time.Hour)}
	if err := e.Ingest(context.Background(), tasks, nil); err != nil {
		t.Fatalf("Ingest: %v", err)
	}
	h := NewHandler(Options{Engine: e, Ready: ready, Gatherer: reg, Token: token,
		Logger: zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel))})
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return &fixture{e: e, reg: reg, srv: srv}
}

func task(id string, off int64, in time.Duration) codec.Task {
	return codec.Task{
		Kind: codec.KindSchedule, ID: id, Source: source, Origin: "kafka:delay/0@" + string(rune('0'+off)),
		Stamp: t0.UnixMilli(), Partition: 0, Offset: off, Due: t0.Add(in).UnixMilli(),
		Transport: codec.TransportKafka, Target: "orders", Value: []byte("v"),
		DLQTransport: codec.TransportKafka, DLQ: "delay.dlq",
	}
}

type resp struct {
	code int
	hdr  http.Header
	body string
}

func do(t *testing.T, method, url, token string) resp {
	t.Helper()
	req, err := http.NewRequest(method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", token)
	}
	return send(t, req)
}

// send sends req and reads the whole answer.
func send(t *testing.T, req *http.Request) resp {
	t.Helper()
	r, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Body.Close()
	b, err := io.ReadAll(r.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp{r.StatusCode, r.Header, string(b)}
}

// jsonError decodes {"error": "..."} and fails if the body is not that.
func jsonError(t *testing.T, r resp) string {
	t.Helper()
	if ct := r.hdr.Get("Content-Type"); ct != "application/json" {
		t.Fatalf("error Content-Type %q, body %q", ct, r.body)
	}
	var e struct {
		Error string `json:"error"`
	}
	if err := json.Unmarshal([]byte(r.body), &e); err != nil || e.Error == "" {
		t.Fatalf("body %q is not a JSON error: %v", r.body, err)
	}
	return e.Error
}

func TestAuth(t *testing.T) {
	const token = "s3cret"
	f := newFixture(t, token, nil)
	tests := []struct {
		name, method, path, auth string
		want                     int
		challenge                bool
	}{
		{"healthz open", "GET", "/healthz", "", 200, false},
		{"readyz open", "GET", "/readyz", "", 200, false},
		{"metrics missing", "GET", "/metrics", "", 401, true},
		{"stats missing", "GET", "/v1/stats", "", 401, true},
		{"task missing", "GET", "/v1/tasks/delay/order-1", "", 401, true},
		{"cancel missing", "DELETE", "/v1/tasks/delay/order-1", "", 401, true},
		{"stats wrong", "GET", "/v1/stats", "Bearer nope", 401, true},
		{"stats prefix of token", "GET", "/v1/stats", "Bearer s3cre", 401, true},
		{"stats basic scheme", "GET", "/v1/stats", "Basic " + token, 401, true},
		{"stats no scheme", "GET", "/v1/stats", token, 401, true},
		{"wrong method still needs auth", "POST", "/v1/stats", "", 401, true},
		{"metrics right", "GET", "/metrics", "Bearer " + token, 200, false},
		{"stats right", "GET", "/v1/stats", "Bearer " + token, 200, false},
		{"scheme case-insensitive", "GET", "/v1/stats", "bearer " + token, 200, false},
		{"task right", "GET", "/v1/tasks/delay/order-1", "Bearer " + token, 200, false},
		{"stuck missing", "GET", "/v1/stuck", "", 401, true},
		{"drop stuck missing", "DELETE", "/v1/stuck/0/1", "", 401, true},
		{"drop stuck wrong", "DELETE", "/v1/stuck/0/1", "Bearer nope", 401, true},
		{"stuck right", "GET", "/v1/stuck", "Bearer " + token, 200, false},
		{"drop stuck right, nothing listed", "DELETE", "/v1/stuck/0/1", "Bearer " + token, 404, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := do(t, tt.method, f.srv.URL+tt.path, tt.auth)
			if r.code != tt.want {
				t.Fatalf("%s %s = %d %q, want %d", tt.method, tt.path, r.code, r.body, tt.want)
			}
			if got := r.hdr.Get("WWW-Authenticate"); tt.challenge != strings.HasPrefix(got, "Bearer ") {
				t.Fatalf("WWW-Authenticate %q", got)
			}
			if r.code == 401 {
				jsonError(t, r)
			}
		})
	}
	// Without a token everything is open.
	open := newFixture(t, "", nil)
	if r := do(t, "GET", open.srv.URL+"/v1/stats", ""); r.code != 200 {
		t.Fatalf("no token configured: %d %q", r.code, r.body)
	}
}

func TestReadyTransitions(t *testing.T) {
	var mu sync.Mutex
	state := errors.New("recovering store")
	f := newFixture(t, "tok", func() error {
		mu.Lock()
		defer mu.Unlock()
		return state
	})
	set := func(err error) {
		mu.Lock()
		state = err
		mu.Unlock()
	}
	steps := []struct {
		state    error
		code     int
		contains string
	}{
		{errors.New("recovering store"), 503, "not ready: recovering store"},
		{nil, 200, "ok"},
		{errors.New("kafka: dlq delay.dlq unwritable"), 503, "not ready: kafka: dlq delay.dlq unwritable"},
		{nil, 200, "ok"},
		// A reason that says it already is not prefixed twice.
		{fmt.Errorf("%w: connecting to brokers", errors.New("not ready")), 503, "\nnot ready: connecting to brokers"},
	}
	for i, s := range steps {
		set(s.state)
		// With the token the reason; without it (kubelet) the status and
		// no names of brokers, topics or paths.
		r := do(t, "GET", f.srv.URL+"/readyz", "Bearer tok")
		if r.code != s.code || !strings.Contains("\n"+r.body, s.contains) || strings.Contains(r.body, "not ready: not ready") {
			t.Fatalf("step %d: %d %q, want %d %q", i, r.code, r.body, s.code, s.contains)
		}
		open := do(t, "GET", f.srv.URL+"/readyz", "")
		wantOpen := "ok"
		if s.code != 200 {
			wantOpen = "not ready (the reason with the admin token, and in the log)"
		}
		if open.code != s.code || strings.TrimSpace(open.body) != wantOpen {
			t.Fatalf("step %d without the token: %d %q, want %d %q", i, open.code, open.body, s.code, wantOpen)
		}
		if bad := do(t, "GET", f.srv.URL+"/readyz", "Bearer wrong"); bad.code != s.code || strings.Contains(bad.body, "dlq") || strings.Contains(bad.body, "brokers") {
			t.Fatalf("step %d with a wrong token: %d %q", i, bad.code, bad.body)
		}
		// Liveness does not follow readiness.
		if h := do(t, "GET", f.srv.URL+"/healthz", ""); h.code != 200 || h.body != "ok" {
			t.Fatalf("step %d: healthz %d %q", i, h.code, h.body)
		}
	}
}

func TestLookup(t *testing.T) {
	f := newFixture(t, "", nil)
	tests := []struct {
		name, path string
		code       int
		id         string
	}{
		{"plain id", "/v1/tasks/delay/order-1", 200, "order-1"},
		{"escaped slash", "/v1/tasks/delay/tenant%2F42", 200, "tenant/42"},
		{"raw slash", "/v1/tasks/delay/tenant/42", 200, "tenant/42"},
		{"unknown id", "/v1/tasks/delay/nope", 404, ""},
		{"other source", "/v1/tasks/other/order-1", 404, ""},
		{"empty id", "/v1/tasks/delay/", 400, ""},
		// A raw empty or dot segment would be redirected to another id.
		{"raw double slash", "/v1/tasks/delay/tenant//42", 400, ""},
		{"raw dot dot", "/v1/tasks/delay/x/../order-1", 400, ""},
		{"raw dot", "/v1/tasks/delay/./order-1", 400, ""},
		{"escaped double slash", "/v1/tasks/delay/tenant%2F%2F42", 404, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := do(t, "GET", f.srv.URL+tt.path, "")
			if r.code != tt.code {
				t.Fatalf("GET %s = %d %q, want %d", tt.path, r.code, r.body, tt.code)
			}
			if r.code != 200 {
				jsonError(t, r)
				return
			}
			var info shard.TaskInfo
			if err := json.Unmarshal([]byte(r.body), &info); err != nil {
				t.Fatal(err)
			}
			if info.ID != tt.id || info.Source != source || info.Target != "kafka:orders" || info.Attempts != 0 {
				t.Fatalf("info %+v", info)
			}
			want, err := f.e.Lookup(source, tt.id)
			if err != nil {
				t.Fatal(err)
			}
			if !info.Due.Equal(want.Due.Time) || info.Origin != want.Origin || info.Shard != want.Shard {
				t.Fatalf("HTTP %+v, engine %+v", info, want)
			}
		})
	}
	// The CONTRACT §7 fields, by their JSON names.
	r := do(t, "GET", f.srv.URL+"/v1/tasks/delay/order-1", "")
	var m map[string]any
	if err := json.Unmarshal([]byte(r.body), &m); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"id", "due", "target", "origin", "attempts"} {
		if _, ok := m[k]; !ok {
			t.Errorf("task JSON lacks %q: %s", k, r.body)
		}
	}
	if m["due"] != "2026-11-22T01:00:00.000Z" {
		t.Errorf("due %v", m["due"])
	}
}

func TestCancel(t *testing.T) {
	f := newFixture(t, "", nil)
	// "tenant//42" is not "tenant/42": refused, and nothing is cancelled
	// (the mux's redirect to the cleaned path, followed, cancelled it).
	for _, p := range []string{"/v1/tasks/delay/tenant//42", "/v1//tasks/delay/tenant//42", "/v1/./tasks/delay/tenant//42", "//v1/tasks/delay/tenant//42"} {
		if r := do(t, "DELETE", f.srv.URL+p, ""); r.code != 400 {
			t.Fatalf("DELETE %s = %d %q, want 400", p, r.code, r.body)
		}
	}
	if r := do(t, "GET", f.srv.URL+"/v1/tasks/delay/tenant%2F42", ""); r.code != 200 {
		t.Fatalf("tenant/42 after a refused DELETE of tenant//42: %d %q", r.code, r.body)
	}
	for _, path := range []string{"/v1/tasks/delay/order-1", "/v1/tasks/delay/tenant%2F42"} {
		if r := do(t, "DELETE", f.srv.URL+path, ""); r.code != 204 || r.body != "" {
			t.Fatalf("DELETE %s = %d %q, want 204", path, r.code, r.body)
		}
		if r := do(t, "GET", f.srv.URL+path, ""); r.code != 404 {
			t.Fatalf("GET after cancel %s = %d %q", path, r.code, r.body)
		}
		r := do(t, "DELETE", f.srv.URL+path, "")
		if r.code != 404 {
			t.Fatalf("second DELETE %s = %d %q", path, r.code, r.body)
		}
		if msg := jsonError(t, r); !strings.Contains(msg, "no pending task") {
			t.Fatalf("error %q", msg)
		}
	}
	if st := f.e.Stats(); st.Pending != 0 {
		t.Fatalf("pending %d after cancelling both", st.Pending)
	}
}

// TestCancelLogCutsLongID: the trace of an admin cancel names the id cut
// to 128 bytes, as the engine's lines do; an id may be as long as a
// message allows (a 64 KiB id was logged whole, hunt H204).
func TestCancelLogCutsLongID(t *testing.T) {
	e, _ := openEngine(t)
	long := strings.Repeat("x", 64<<10)
	if err := e.Ingest(context.Background(), []codec.Task{task(long, 1, time.Hour)}, nil); err != nil {
		t.Fatalf("Ingest: %v", err)
	}
	core, logs := observer.New(zap.InfoLevel)
	srv := httptest.NewServer(NewHandler(Options{Engine: e, Logger: zap.New(core)}))
	defer srv.Close()
	if r := do(t, "DELETE", srv.URL+"/v1/tasks/delay/"+long, ""); r.code != 204 {
		t.Fatalf("DELETE = %d %q, want 204", r.code, r.body)
	}
	lines := logs.FilterMessage("admin: task cancelled").All()
	if len(lines) != 1 {
		t.Fatalf("%d cancel lines, want 1", len(lines))
	}
	if id := lines[0].ContextMap()["id"].(string); len(id) > 131 || !strings.HasPrefix(id, "xxx") {
		t.Fatalf("cancel line's id is %d bytes, want at most 128 and \"...\"", len(id))
	}
}

func TestStats(t *testing.T) {
	f := newFixture(t, "", nil)
	r := do(t, "GET", f.srv.URL+"/v1/stats", "")
	if r.code != 200 || r.hdr.Get("Content-Type") != "application/json" {
		t.Fatalf("%d %q %q", r.code, r.hdr.Get("Content-Type"), r.body)
	}
	var m map[string]any
	if err := json.Unmarshal([]byte(r.body), &m); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"shards", "pending", "next_due", "horizon"} {
		if _, ok := m[k]; !ok {
			t.Errorf("stats JSON lacks %q: %s", k, r.body)
		}
	}
	if _, ok := m["oldest_overdue"]; ok {
		t.Errorf("oldest_overdue present with nothing overdue: %s", r.body)
	}
	var st shard.Stats
	if err := json.Unmarshal([]byte(r.body), &st); err != nil {
		t.Fatal(err)
	}
	if st.Pending != 2 || len(st.Shards) != 4 || !st.NextDue.Equal(t0.Add(time.Hour)) {
		t.Fatalf("stats %+v", st)
	}
	var sum int64
	for _, s := range st.Shards {
		sum += s.Pending
	}
	if sum != 2 {
		t.Fatalf("per-shard pending sums to %d", sum)
	}
	shards := m["shards"].([]any)
	for _, k := range []string{"shard", "pending", "in_wheel"} {
		if _, ok := shards[0].(map[string]any)[k]; !ok {
			t.Errorf("shard JSON lacks %q: %s", k, r.body)
		}
	}
}

func TestMetrics(t *testing.T) {
	f := newFixture(t, "tok", nil)
	if r := do(t, "DELETE", f.srv.URL+"/v1/tasks/delay/order-1", "Bearer tok"); r.code != 204 {
		t.Fatalf("cancel %d", r.code)
	}
	r := do(t, "GET", f.srv.URL+"/metrics", "Bearer tok")
	if r.code != 200 || !strings.HasPrefix(r.hdr.Get("Content-Type"), "text/plain") {
		t.Fatalf("%d %q", r.code, r.hdr.Get("Content-Type"))
	}
	for _, want := range []string{
		`delaybridge_ingested_total{source="delay"} 2`,
		`delaybridge_cancelled_total{source="delay"} 1`,
		"delaybridge_pending_tasks{shard=",
		"delaybridge_store_commit_seconds_bucket",
	} {
		if !strings.Contains(r.body, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
}

func TestMethodsAndPaths(t *testing.T) {
	f := newFixture(t, "", nil)
	tests := []struct {
		method, path string
		code         int
		allow        string
	}{
		{"POST", "/v1/stats", 405, "GET, HEAD"},
		{"POST", "/v1/stuck", 405, "GET, HEAD"},
		{"DELETE", "/v1/stuck", 405, "GET, HEAD"},
		{"GET", "/v1/stuck/0/1", 405, "DELETE"},
		{"PUT", "/v1/stuck/0/1", 405, "DELETE"},
		{"PUT", "/v1/tasks/delay/order-1", 405, "DELETE, GET, HEAD"},
		{"POST", "/v1/tasks/delay", 405, "GET, HEAD"},
		{"DELETE", "/v1/tasks/delay", 405, "GET, HEAD"},
		{"POST", "/healthz", 405, "GET, HEAD"},
		{"DELETE", "/readyz", 405, "GET, HEAD"},
		{"POST", "/metrics", 405, "GET, HEAD"},
		{"GET", "/v2/stats", 404, ""},
		{"GET", "/", 404, ""},
		{"HEAD", "/healthz", 200, ""},
	}
	for _, tt := range tests {
		r := do(t, tt.method, f.srv.URL+tt.path, "")
		if r.code != tt.code {
			t.Errorf("%s %s = %d, want %d", tt.method, tt.path, r.code, tt.code)
			continue
		}
		if got := r.hdr.Get("Allow"); got != tt.allow {
			t.Errorf("%s %s Allow %q, want %q", tt.method, tt.path, got, tt.allow)
		}
		if tt.code >= 400 {
			jsonError(t, r)
		}
	}
}

// errEngine fails every call with err, for the error mapping.
type errEngine struct{ err error }

func (e errEngine) Lookup(string, string) (shard.TaskInfo, error) { return shard.TaskInfo{}, e.err }
func (e errEngine) Cancel(string, string) error                   { return e.err }
func (e errEngine) ListTasks(string, shard.ListQuery) (shard.TaskList, error) {
	return shard.TaskList{}, e.err
}
func (e errEngine) Stats() shard.Stats { return shard.Stats{} }
func (e errEngine) StuckEntries(int) (shard.StuckList, error) {
	return shard.StuckList{}, e.err
}
func (e errEngine) DropStuck(int, uint64) error { return e.err }
func (e errEngine) Firing() shard.FiringState   { return shard.FiringState{} }
func (e errEngine) PauseFiringByOperator(string) (shard.FiringState, error) {
	return shard.FiringState{}, e.err
}
func (e errEngine) ResumeFiringByOperator() (shard.FiringState, *shard.OperatorPause, error) {
	return shard.FiringState{}, nil, e.err
}

func TestEngineErrors(t *testing.T) {
	tests := []struct {
		name   string
		engine Engine
		code   int
	}{
		{"not found wrapped", errEngine{fmtErr(shard.ErrNotFound)}, 404},
		{"closed", errEngine{shard.ErrClosed}, 503},
		{"store failed", errEngine{fmtErr(shard.ErrStoreFailed)}, 503},
		{"other", errEngine{errors.New("disk on fire")}, 500},
		{"no engine", nil, 503},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := httptest.NewServer(NewHandler(Options{Engine: tt.engine, Gatherer: prometheus.NewRegistry()}))
			defer srv.Close()
			for _, c := range [][2]string{{"GET", "/v1/tasks/delay/x"}, {"DELETE", "/v1/tasks/delay/x"},
				{"DELETE", "/v1/stuck/0/1"}} {
				r := do(t, c[0], srv.URL+c[1], "")
				if r.code != tt.code {
					t.Fatalf("%s %s = %d %q, want %d", c[0], c[1], r.code, r.body, tt.code)
				}
				jsonError(t, r)
			}
			if tt.code != 404 { // listing has nothing to find, nor has a pause
				for _, c := range [][2]string{{"GET", "/v1/stuck"}, {"POST", "/v1/firing/pause"}, {"POST", "/v1/firing/resume"}} {
					if r := do(t, c[0], srv.URL+c[1], ""); r.code != tt.code {
						t.Fatalf("%s %s = %d %q, want %d", c[0], c[1], r.code, r.body, tt.code)
					}
				}
			}
		})
	}
}

func fmtErr(err error) error { return errors.Join(errors.New("context"), err) }

// A closed engine makes the real API answer 503, not 500.
func TestClosedEngine(t *testing.T) {
	f := newFixture(t, "", nil)
	if err := f.e.Close(); err != nil {
		t.Fatal(err)
	}
	if r := do(t, "GET", f.srv.URL+"/v1/tasks/delay/order-1", ""); r.code != 503 {
		t.Fatalf("%d %q", r.code, r.body)
	}
}

func TestServe(t *testing.T) {
	ln, h, cancel, done := serveLoopback(t)
	if r := do(t, "GET", "http://"+ln.Addr().String()+"/healthz", ""); r.code != 200 {
		t.Fatalf("healthz %d", r.code)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("ServeListener: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no shutdown")
	}
	if _, err := http.Get("http://" + ln.Addr().String() + "/healthz"); err == nil {
		t.Fatal("still serving after shutdown")
	}

	// Listen errors are returned, naming the address.
	err := Serve(context.Background(), "127.0.0.1:notaport", h, nil)
	if err == nil || !strings.Contains(err.Error(), "127.0.0.1:notaport") {
		t.Fatalf("Serve on a bad address: %v", err)
	}
}

func TestCheckListen(t *testing.T) {
	if err := CheckListen("127.0.0.1:8080", "", false); err != nil {
		t.Fatal(err)
	}
	if err := CheckListen(":8080", "", false); err == nil {
		t.Fatal("open listen without token accepted")
	}
	if err := CheckListen(":8080", "t", false); err != nil {
		t.Fatal(err)
	}
	if err := CheckListen("0.0.0.0:8080", "", true); err != nil {
		t.Fatal(err)
	}
}

func TestLiveness(t *testing.T) {
	var live error
	h := NewHandler(Options{Live: func() error { return live }})
	srv := httptest.NewServer(h)
	defer srv.Close()
	tests := []struct {
		live     error
		code     int
		contains string
	}{
		{nil, 200, "ok"},
		{errors.New("shard: store failed: ingest: no space left on device"), 503, "unhealthy: shard: store failed"},
	}
	for _, tc := range tests {
		live = tc.live
		r := do(t, "GET", srv.URL+"/healthz", "")
		if r.code != tc.code || !strings.Contains(r.body, tc.contains) {
			t.Errorf("live %v: %d %q, want %d %q", tc.live, r.code, r.body, tc.code, tc.contains)
		}
	}
}

func TestPprof(t *testing.T) {
	const token = "s3cret"
	handler := func(pprof bool) *httptest.Server {
		srv := httptest.NewServer(NewHandler(Options{Gatherer: prometheus.NewRegistry(), Token: token, Pprof: pprof}))
		t.Cleanup(srv.Close)
		return srv
	}
	on, off := handler(true), handler(false)
	tests := []struct {
		name string
		srv  *httptest.Server
		path string
		auth string
		want int
		body string
	}{
		{"index with token", on, "/debug/pprof/", "Bearer " + token, 200, "goroutine"},
		{"named profile with token", on, "/debug/pprof/goroutine?debug=1", "Bearer " + token, 200, "goroutine profile:"},
		{"cmdline with token", on, "/debug/pprof/cmdline", "Bearer " + token, 200, ""},
		{"index without token", on, "/debug/pprof/", "", 401, ""},
		{"profile without token", on, "/debug/pprof/profile?seconds=1", "", 401, ""},
		{"disabled", off, "/debug/pprof/", "Bearer " + token, 404, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := do(t, "GET", tt.srv.URL+tt.path, tt.auth)
			if r.code != tt.want {
				t.Fatalf("GET %s = %d %q, want %d", tt.path, r.code, r.body, tt.want)
			}
			if !strings.Contains(r.body, tt.body) {
				t.Fatalf("GET %s body %q lacks %q", tt.path, r.body, tt.body)
			}
		})
	}
}

// TestServePortInUse: an admin port another process holds is an error
// naming the key to change (admin.listen).
func TestServePortInUse(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	err = Serve(context.Background(), ln.Addr().String(), http.NotFoundHandler(), zap.NewNop())
	if err == nil || !strings.Contains(err.Error(), "admin.listen") || !strings.Contains(err.Error(), ln.Addr().String()) {
		t.Fatalf("Serve on a port in use = %v, want an error naming admin.listen and the address", err)
	}
}

// TestProbeReasonLogged: the open probes do not give their reason
// without the token, so it is logged, once per change of reason and once
// when the probe passes again, not once per poll.
func TestProbeReasonLogged(t *testing.T) {
	var mu sync.Mutex
	var state error
	core, logs := observer.New(zap.InfoLevel)
	h := NewHandler(Options{Token: "tok", Logger: zap.New(core), Ready: func() error {
		mu.Lock()
		defer mu.Unlock()
		return state
	}})
	srv := httptest.NewServer(h)
	defer srv.Close()
	steps := []struct {
		state  error
		polls  int
		logged []string
	}{
		{nil, 2, nil},
		{errors.New("not ready: kafka: dlq delay.dlq unwritable"), 3, []string{"probe fails: kafka: dlq delay.dlq unwritable"}},
		{errors.New("not ready: nats: connecting"), 2, []string{"probe fails: nats: connecting"}},
		// Only a number changes (a stall's age): the same reason.
		{errors.New("not ready: store: writes held for 12s"), 1, []string{"probe fails: store: writes held for 12s"}},
		{errors.New("not ready: store: writes held for 13s"), 2, nil},
		{nil, 2, []string{"probe passes again: "}},
	}
	for i, st := range steps {
		mu.Lock()
		state = st.state
		mu.Unlock()
		for range st.polls {
			do(t, "GET", srv.URL+"/readyz", "")
		}
		var got []string
		for _, e := range logs.TakeAll() {
			reason, _ := e.ContextMap()["reason"].(string)
			got = append(got, e.Message+": "+reason)
		}
		if !slices.Equal(got, st.logged) {
			t.Errorf("step %d: logged %q, want %q", i, got, st.logged)
		}
	}
}

// TestMetricsToken: with a metrics token beside the admin token, the
// metrics token reads /metrics and nothing else (403 elsewhere, no
// cancel); the admin token reads everything; without an admin token the
// metrics token is not used.
func TestMetricsToken(t *testing.T) {
	e, reg := openEngine(t)
	if err := e.Ingest(context.Background(), []codec.Task{task("order-1", 1, time.Hour)}, nil); err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(NewHandler(Options{Engine: e, Gatherer: reg, Token: "adm", MetricsToken: "scrape",
		Logger: zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel))}))
	defer srv.Close()
	tests := []struct {
		method, path, auth string
		want               int
	}{
		{"GET", "/metrics", "Bearer scrape", 200},
		{"GET", "/metrics", "Bearer adm", 200},
		{"GET", "/metrics", "", 401},
		{"GET", "/metrics", "Bearer nope", 401},
		{"POST", "/metrics", "Bearer scrape", 405},
		{"GET", "/v1/stats", "Bearer scrape", 403},
		{"GET", "/v1/tasks/delay/order-1", "Bearer scrape", 403},
		{"DELETE", "/v1/tasks/delay/order-1", "Bearer scrape", 403},
		{"GET", "/v1/stuck", "Bearer scrape", 403},
		{"GET", "/v1/stats", "Bearer adm", 200},
		{"GET", "/readyz", "", 200},
	}
	for _, tt := range tests {
		if r := do(t, tt.method, srv.URL+tt.path, tt.auth); r.code != tt.want {
			t.Errorf("%s %s (%q) = %d %q, want %d", tt.method, tt.path, tt.auth, r.code, r.body, tt.want)
		}
	}
	if _, err := e.Lookup(source, "order-1"); err != nil {
		t.Fatalf("the metrics token cancelled a task: %v", err)
	}
	// Not set without an admin token (config refuses that; the handler
	// then serves everything openly, as without any token).
	noAdmin := httptest.NewServer(NewHandler(Options{Engine: e, Gatherer: reg, MetricsToken: "scrape"}))
	defer noAdmin.Close()
	if r := do(t, "GET", noAdmin.URL+"/v1/stats", ""); r.code != 200 {
		t.Errorf("metrics token without an admin token: /v1/stats %d", r.code)
	}
}

// TestTokenRotation: with TokenFunc and MetricsTokenFunc (the service's
// *_file tokens, read again when the file changes) each request is checked
// against the tokens of the moment: after a rotation the old ones are
// refused and the new ones taken, with no restart. The funcs do not turn
// authentication on by themselves, and a func that gives "" refuses every
// token rather than taking an empty one.
func TestTokenRotation(t *testing.T) {
	e, reg := openEngine(t)
	var mu sync.Mutex
	adminTok, metricsTok := "adm-1", "scrape-1"
	get := func(p *string) func() string {
		return func() string { mu.Lock(); defer mu.Unlock(); return *p }
	}
	core, logs := observer.New(zap.InfoLevel)
	srv := httptest.NewServer(NewHandler(Options{Engine: e, Gatherer: reg, Token: "adm-1", MetricsToken: "scrape-1",
		TokenFunc: get(&adminTok), MetricsTokenFunc: get(&metricsTok), Logger: zap.New(core)}))
	defer srv.Close()
	type probe struct {
		path, auth string
		want       int
	}
	check := func(step string, tests []probe) {
		t.Helper()
		for _, tt := range tests {
			if r := do(t, "GET", srv.URL+tt.path, tt.auth); r.code != tt.want {
				t.Errorf("%s: GET %s (%q) = %d %q, want %d", step, tt.path, tt.auth, r.code, r.body, tt.want)
			}
		}
	}
	check("before", []probe{
		{"/v1/stats", "Bearer adm-1", 200},
		{"/metrics", "Bearer scrape-1", 200},
		{"/v1/stats", "Bearer adm-2", 401},
	})
	mu.Lock()
	adminTok, metricsTok = "adm-2", "scrape-2"
	mu.Unlock()
	check("rotated", []probe{
		{"/v1/stats", "Bearer adm-1", 401},
		{"/metrics", "Bearer scrape-1", 401},
		{"/v1/stats", "Bearer adm-2", 200},
		{"/metrics", "Bearer scrape-2", 200},
		{"/v1/stats", "Bearer scrape-2", 403},
	})
	// Rotated to the same value, which the start refuses: logged (the
	// scraper's token now opens everything), once, and once when fixed.
	mu.Lock()
	metricsTok = "adm-2"
	mu.Unlock()
	check("equal", []probe{
		{"/metrics", "Bearer adm-2", 200},
		{"/metrics", "Bearer adm-2", 200},
	})
	mu.Lock()
	metricsTok = "scrape-3"
	mu.Unlock()
	check("differ again", []probe{
		{"/v1/stats", "Bearer scrape-3", 403},
	})
	if n := logs.FilterMessageSnippet("metrics_token is now equal to admin.token").Len(); n != 1 {
		t.Errorf("tokens made equal: logged %d times, want once", n)
	}
	if n := logs.FilterMessageSnippet("differs from admin.token again").Len(); n != 1 {
		t.Errorf("tokens made different again: logged %d times, want once", n)
	}

	mu.Lock()
	adminTok = ""
	mu.Unlock()
	check("empty", []probe{
		{"/v1/stats", "Bearer adm-2", 401},
	})
	// An empty bearer token, which no HTTP server passes on (it trims the
	// header), straight to the handler.
	req := httptest.NewRequest("GET", "/v1/stats", nil)
	req.Header.Set("Authorization", "Bearer ")
	rec := httptest.NewRecorder()
	srv.Config.Handler.ServeHTTP(rec, req)
	if rec.Code != 401 {
		t.Errorf("empty token func, empty bearer token: /v1/stats = %d, want 401", rec.Code)
	}

	// Without Token the funcs do not turn authentication on.
	open := httptest.NewServer(NewHandler(Options{Engine: e, Gatherer: reg, TokenFunc: func() string { return "" }}))
	defer open.Close()
	if r := do(t, "GET", open.URL+"/v1/stats", ""); r.code != 200 {
		t.Errorf("no Token, a TokenFunc: /v1/stats = %d, want 200 (open)", r.code)
	}
}

// TestLongIDThroughServe: through the real server, GET and DELETE reach a
// task whose id fills most of the 64 KiB header limit when escaped (20 000
// bytes that all need escaping, 60 000 in the path); an id past the limit
// gets 431 Request Header Fields Too Large, as README says, and the task
// stays (cancelled by a delay-cancel message instead).
func TestLongIDThroughServe(t *testing.T) {
	e, reg := openEngine(t)
	h := NewHandler(Options{Engine: e, Gatherer: reg, Logger: zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel))})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ServeListener(ctx, ln, h, zap.NewNop()) }()
	t.Cleanup(func() { cancel(); <-done })
	for _, tc := range []struct {
		id    string
		codes []int // GET, DELETE, GET
	}{
		{strings.Repeat("é", 10_000), []int{http.StatusOK, http.StatusNoContent, http.StatusNotFound}},                                                               // 20 000 bytes, 60 000 escaped
		{strings.Repeat("é", 15_000), []int{http.StatusRequestHeaderFieldsTooLarge, http.StatusRequestHeaderFieldsTooLarge, http.StatusRequestHeaderFieldsTooLarge}}, // 90 000 escaped: past the limit and net/http's slack of a few KiB
	} {
		tk := task("x", 1, time.Hour)
		tk.ID = tc.id
		if err := e.Ingest(context.Background(), []codec.Task{tk}, nil); err != nil {
			t.Fatalf("Ingest: %v", err)
		}
		u := "http://" + ln.Addr().String() + "/v1/tasks/" + source + "/" + url.PathEscape(tc.id)
		for i, m := range []string{http.MethodGet, http.MethodDelete, http.MethodGet} {
			if r := do(t, m, u, ""); r.code != tc.codes[i] {
				t.Errorf("%s /v1/tasks/%s/<%d-byte id>: %d, want %d", m, source, len(tc.id), r.code, tc.codes[i])
			}
		}
		if _, err := e.Lookup(source, tc.id); (err == nil) != (tc.codes[1] != http.StatusNoContent) {
			t.Errorf("<%d-byte id> after the DELETE: lookup %v", len(tc.id), err)
		}
	}
}

// TestNotFoundNamesSources: a 404 for a source the running config does not
// read says so and lists the sources (a NATS task is looked up by its
// stream; a newcomer gives the subject), while a task of a source taken out
// of the config is still found, and an unknown id of a configured source
// gets the plain 404.
func TestNotFoundNamesSources(t *testing.T) {
	e, reg := openEngine(t)
	if err := e.Ingest(context.Background(), []codec.Task{task("order-1", 1, time.Hour)}, nil); err != nil {
		t.Fatalf("Ingest: %v", err)
	}
	srv := httptest.NewServer(NewHandler(Options{Engine: e, Gatherer: reg, Sources: []string{"other", "DELAY"},
		Logger: zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel))}))
	t.Cleanup(srv.Close)
	const hint = `is not a delay source of the running config ("other", "DELAY"): {source} is the Kafka delay topic or the NATS stream, not a subject`
	for _, method := range []string{"GET", "DELETE"} {
		r := do(t, method, srv.URL+"/v1/tasks/delay.orders/order-7", "")
		if r.code != 404 {
			t.Fatalf("%s of a subject = %d %q, want 404", method, r.code, r.body)
		}
		if msg := jsonError(t, r); !strings.Contains(msg, `"delay.orders" `+hint) {
			t.Errorf("%s of a subject: error %q does not say %q", method, msg, hint)
		}
		r = do(t, method, srv.URL+"/v1/tasks/DELAY/order-7", "")
		if msg := jsonError(t, r); r.code != 404 || strings.Contains(msg, "not a delay source") {
			t.Errorf("%s of an unknown id of a configured source = %d %q, want a plain 404", method, r.code, msg)
		}
	}
	// "delay" left the config; its pending task is still there to see.
	if r := do(t, "GET", srv.URL+"/v1/tasks/delay/order-1", ""); r.code != 200 {
		t.Fatalf("task of a source no longer configured = %d %q, want 200", r.code, r.body)
	}
	// The list, likewise: a subject is a 404 that says so, not an empty
	// list that reads as nothing pending; an empty list of a configured
	// source, and the tasks of one taken out of the config, are a 200.
	r := do(t, "GET", srv.URL+"/v1/tasks/delay.orders", "")
	if msg := jsonError(t, r); r.code != 404 || !strings.Contains(msg, `"delay.orders" `+hint) {
		t.Errorf("list of a subject = %d %q, want a 404 that says %q", r.code, msg, hint)
	}
	if r := do(t, "GET", srv.URL+"/v1/tasks/DELAY", ""); r.code != 200 || !strings.Contains(r.body, `"tasks":[]`) {
		t.Errorf("list of a configured source with nothing pending = %d %q, want 200 and no task", r.code, r.body)
	}
	if r := do(t, "GET", srv.URL+"/v1/tasks/delay", ""); r.code != 200 || !strings.Contains(r.body, `"order-1"`) {
		t.Errorf("list of a source no longer configured = %d %q, want 200 with order-1", r.code, r.body)
	}
}

// TestServeShutdownClosesFreshConns: a client that connected and sent
// part of a request line (or nothing) has no request to finish, yet
// net/http's Shutdown waited for it up to 5 s, out of the budget the
// service keeps to close the store with its flush (hunt H208: 5.0 s every
// cycle with slow clients connected). Such connections are closed when
// the shutdown begins; a request in flight still finishes.
func TestServeShutdownClosesFreshConns(t *testing.T) {
	ln, _, cancel, done := serveLoopback(t)
	var slow []net.Conn
	for i := range 3 {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		if i > 0 {
			if _, err := c.Write([]byte("GET /heal")); err != nil { // a request line begun, never ended
				t.Fatal(err)
			}
		}
		slow = append(slow, c)
	}
	// The server has taken them all (a whole request on another
	// connection is answered after they were accepted).
	if r := do(t, "GET", "http://"+ln.Addr().String()+"/healthz", ""); r.code != 200 {
		t.Fatalf("healthz %d", r.code)
	}
	cancel()
	// net/http holds a new connection up to 5 s at a shutdown: well
	// before that, the server is stopped and each slow client sees its
	// connection closed.
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("ServeListener: %v", err)
		}
	case <-time.After(4 * time.Second):
		t.Fatal("the shutdown waited for clients that sent no whole request")
	}
	for i, c := range slow {
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if n, err := c.Read(make([]byte, 1)); err == nil {
			t.Fatalf("slow client %d: read %d bytes after the shutdown, want its connection closed", i, n)
		}
	}
}

// serveLoopback serves a handler with an empty registry on a loopback
// port through ServeListener until cancel; done has its result.
func serveLoopback(t *testing.T) (ln net.Listener, h http.Handler, cancel context.CancelFunc, done <-chan error) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	errc := make(chan error, 1)
	h = NewHandler(Options{Gatherer: prometheus.NewRegistry()})
	go func() { errc <- ServeListener(ctx, ln, h, zaptest.NewLogger(t)) }()
	return ln, h, cancel, errc
}

// A source with a NUL byte is refused for a lookup or a cancel: the store
// keys a task by source, 0, id, so source "a\x00b" with id "c" named
// source "a"'s task "b\x00c" (review A219), and a DELETE cancelled it.
func TestTaskSourceWithNULRefused(t *testing.T) {
	f := newFixture(t, "", nil)
	other := task("b\x00c", 30, time.Hour)
	other.Source = "a"
	if err := f.e.Ingest(context.Background(), []codec.Task{other}, nil); err != nil {
		t.Fatal(err)
	}
	for _, method := range []string{"GET", "DELETE"} {
		r := do(t, method, f.srv.URL+"/v1/tasks/a%00b/c", "")
		if msg := jsonError(t, r); r.code != 400 || !strings.Contains(msg, "NUL") {
			t.Fatalf("%s of source a\\x00b, id c = %d %q, want 400 naming NUL", method, r.code, msg)
		}
	}
	if r := do(t, "GET", f.srv.URL+"/v1/tasks/a/b%00c", ""); r.code != 200 {
		t.Fatalf("the task of source a, id b\\x00c = %d %q, want 200 (still pending)", r.code, r.body)
	}
}
