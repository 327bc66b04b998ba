package admin

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/shard"
)

// FuzzHandler sends any method, path, query and Authorization header to
// the handler of a real engine holding two tasks, with an admin token and
// a metrics token set. It never panics and answers with a known status;
// without the admin token nothing but the probes and, with the metrics
// token, /metrics answers 2xx; and a task leaves only by a DELETE under
// /v1/tasks/ with the admin token.
func FuzzHandler(f *testing.F) {
	for _, s := range []struct {
		method              uint8
		path, query, header string
	}{
		{0, "/v1/tasks/delay/order-1", "", "Bearer tok"},
		{1, "/v1/tasks/delay/tenant%2F42", "", "bearer  tok "},
		{1, "/v1/tasks/delay/order-1", "", "Bearer tok2"},
		{0, "/v1/stuck", "limit=5", "Bearer tok"},
		{1, "/v1/stuck/1/18446744073709551615", "", "Bearer tok"},
		{0, "/healthz", "", ""},
		{0, "/v1//tasks/a/../b", "", "Bearer tok"},
		{2, "/metrics", "", "Basic dG9r"},
		{0, "/metrics", "", "Bearer scrape"},
		{1, "/v1/tasks/delay/order-1", "", "Bearer scrape"},
		{0, "/v1/stats", "x=%zz", "Bearer tok"},
		{0, "/v1/tasks/delay", "prefix=order&after=order-0&limit=1", "Bearer tok"},
		{2, "/v1/tasks/delay", "limit=x", "Bearer tok"},
	} {
		f.Add(s.method, s.path, s.query, s.header)
	}
	methods := []string{http.MethodGet, http.MethodDelete, http.MethodPost, http.MethodHead, http.MethodPut, "PATCH", "OPTIONS"}
	e, reg := openEngine(f)
	offset := int64(10)
	// restore schedules both tasks again after a DELETE took one: newer
	// (a later broker time) than the cancel marker the DELETE left.
	restore := func(t *testing.T) {
		offset += 2
		tasks := []codec.Task{task("order-1", offset, time.Hour), task("tenant/42", offset+1, time.Hour)}
		for i := range tasks {
			tasks[i].Stamp += offset
		}
		if err := e.Ingest(context.Background(), tasks, nil); err != nil {
			t.Fatal(err)
		}
		if n := e.Stats().Pending; n != 2 {
			t.Fatalf("%d pending after restoring, want 2", n)
		}
	}
	h := NewHandler(Options{Engine: e, Ready: func() error { return nil }, Gatherer: reg, Token: "tok", MetricsToken: "scrape",
		Logger: zaptest.NewLogger(f, zaptest.Level(zap.ErrorLevel))})
	known := map[int]bool{200: true, 204: true, 400: true, 401: true, 403: true, 404: true, 405: true, 500: true, 503: true}
	f.Fuzz(func(t *testing.T, m uint8, path, query, header string) {
		if e.Stats().Pending != 2 {
			restore(t)
		}
		u, err := url.Parse("http://bridge" + path)
		if err != nil || u.Host != "bridge" || !strings.HasPrefix(path, "/") {
			t.Skip("not a request path")
		}
		u.RawQuery = query
		method := methods[int(m)%len(methods)]
		req := httptest.NewRequestWithContext(context.Background(), method, "/", nil)
		req.URL = u
		req.RequestURI = u.RequestURI()
		if header != "" {
			req.Header.Set("Authorization", header)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		code := rec.Code
		if !known[code] {
			t.Fatalf("%s %s: status %d", method, u, code)
		}
		scheme, tok, _ := strings.Cut(header, " ")
		authorized := strings.EqualFold(scheme, "Bearer") && strings.TrimSpace(tok) == "tok"
		probe := u.Path == "/healthz" || u.Path == "/readyz"
		scraper := strings.EqualFold(scheme, "Bearer") && strings.TrimSpace(tok) == "scrape" && u.Path == "/metrics"
		if !authorized && !probe && !scraper && code/100 == 2 {
			t.Fatalf("%s %s without the token (Authorization %q): status %d", method, u, header, code)
		}
		if e.Stats().Pending < 2 && !(authorized && method == http.MethodDelete && strings.HasPrefix(u.Path, "/v1/tasks/") && code == http.StatusNoContent) {
			t.Fatalf("%s %s (Authorization %q, status %d) removed a task", method, u, header, code)
		}
	})
}

// FuzzListQuery: parseListQuery never panics; a query it takes has a
// limit from 1 to shard.MaxListLimit and, written again with every value
// percent-encoded, reads back the same; one it refuses is refused with a
// message naming the parameter.
func FuzzListQuery(f *testing.F) {
	for _, s := range []string{"", "prefix=order-&limit=2", "after=a%2Fb&limit=1000", "limit=0", "limit=1001",
		"after=%zz", "prefix=a+b", "x=1", "limit=1&limit=1", "a;b=c", "&&prefix=&", "after=%FF%00", "limit=%2B1", "=", "prefix"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, raw string) {
		q, err := parseListQuery(raw)
		if err != nil {
			msg := err.Error()
			if !strings.Contains(msg, "prefix") && !strings.Contains(msg, "after") && !strings.Contains(msg, "limit") &&
				!strings.Contains(msg, "parameter") {
				t.Fatalf("%q: error %q names no parameter", raw, msg)
			}
			return
		}
		if q.Limit < 1 || q.Limit > shard.MaxListLimit {
			t.Fatalf("%q: limit %d", raw, q.Limit)
		}
		again := "prefix=" + escapeAll(q.Prefix) + "&after=" + escapeAll(q.After) + "&limit=" + strconv.Itoa(q.Limit)
		q2, err := parseListQuery(again)
		if err != nil || q2 != q {
			t.Fatalf("%q read as %+v; written again %q reads %+v, %v", raw, q, again, q2, err)
		}
	})
}
