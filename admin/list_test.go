package admin

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/shard"
)

// listBody decodes a GET /v1/tasks/{source} answer.
type listBody struct {
	Tasks []struct {
		shard.TaskInfo
		IDEscaped string `json:"id_escaped"`
	} `json:"tasks"`
	Next        string `json:"next"`
	NextEscaped string `json:"next_escaped"`
}

// ids are the ids of the page, from id_escaped when there is one.
func (b listBody) ids(t *testing.T) []string {
	t.Helper()
	ids := make([]string, len(b.Tasks))
	for i, ti := range b.Tasks {
		ids[i] = ti.ID
		if ti.IDEscaped != "" {
			id, err := url.PathUnescape(ti.IDEscaped)
			if err != nil {
				t.Fatalf("id_escaped %q: %v", ti.IDEscaped, err)
			}
			ids[i] = id
		}
	}
	return ids
}

func getList(t *testing.T, f *fixture, path, token string) (resp, listBody) {
	t.Helper()
	r := do(t, "GET", f.srv.URL+path, token)
	var b listBody
	if r.code == 200 {
		if ct := r.hdr.Get("Content-Type"); ct != "application/json" {
			t.Fatalf("Content-Type %q", ct)
		}
		if err := json.Unmarshal([]byte(r.body), &b); err != nil {
			t.Fatalf("body %q: %v", r.body, err)
		}
	}
	return r, b
}

// listFixture is newFixture's engine (order-1, tenant/42) with more tasks:
// ids that sort around them, one that is not UTF-8 and holds a NUL and a
// "/", one with a space and a "+", one with a "%"; a remembered cancel
// ("order-3") and a task of another source.
func listFixture(t *testing.T, token string) *fixture {
	t.Helper()
	f := newFixture(t, token, nil)
	var tasks []codec.Task
	for i, id := range []string{"order-2", "order-10", "bin\xff\x00/x", "a b+c", "%41"} {
		tasks = append(tasks, task(id, int64(10+i), time.Hour))
	}
	other := task("order-1", 20, time.Hour)
	other.Source = "delay2"
	cancel := task("order-3", 21, 0)
	cancel.Kind = codec.KindCancel
	tasks = append(tasks, other, cancel)
	if err := f.e.Ingest(context.Background(), tasks, nil); err != nil {
		t.Fatal(err)
	}
	return f
}

// TestListTasks: GET /v1/tasks/{source} answers a page of the source's
// pending tasks as JSON, each as GET /v1/tasks/{source}/{id} gives it,
// filtered by prefix and after, cut at limit with next; a remembered
// cancel is not a task; a bad query is a 400 naming the parameter.
func TestListTasks(t *testing.T) {
	f := listFixture(t, "")
	all := []string{"%41", "a b+c", "bin\xff\x00/x", "order-1", "order-10", "order-2", "tenant/42"}
	tests := []struct {
		name, path string
		code       int
		ids        []string
		next       string
		errHas     string
	}{
		{"all", "/v1/tasks/delay", 200, all, "", ""},
		{"empty query", "/v1/tasks/delay?", 200, all, "", ""},
		{"prefix", "/v1/tasks/delay?prefix=order-", 200, []string{"order-1", "order-10", "order-2"}, "", ""},
		{"prefix and limit", "/v1/tasks/delay?prefix=order-&limit=2", 200, []string{"order-1", "order-10"}, "order-10", ""},
		{"after", "/v1/tasks/delay?prefix=order-&after=order-10", 200, []string{"order-2"}, "", ""},
		{"after alone", "/v1/tasks/delay?after=order-2", 200, []string{"tenant/42"}, "", ""},
		{"empty after", "/v1/tasks/delay?after=&prefix=t", 200, []string{"tenant/42"}, "", ""},
		{"escaped slash", "/v1/tasks/delay?prefix=tenant%2F", 200, []string{"tenant/42"}, "", ""},
		{"plus is a space", "/v1/tasks/delay?prefix=a+b%2Bc", 200, []string{"a b+c"}, "", ""},
		{"escaped percent", "/v1/tasks/delay?prefix=%2541", 200, []string{"%41"}, "", ""},
		{"bytes", "/v1/tasks/delay?prefix=bin%FF%00", 200, []string{"bin\xff\x00/x"}, "", ""},
		{"limit 1000", "/v1/tasks/delay?limit=1000", 200, all, "", ""},
		{"nothing", "/v1/tasks/delay?prefix=nope", 200, []string{}, "", ""},
		{"cancel marker left out", "/v1/tasks/delay?prefix=order-3", 200, []string{}, "", ""},
		{"other source", "/v1/tasks/delay2", 200, []string{"order-1"}, "", ""},
		{"unknown source", "/v1/tasks/nosuch", 200, []string{}, "", ""},
		{"escaped source", "/v1/tasks/dela%79", 200, all, "", ""},
		{"limit 0", "/v1/tasks/delay?limit=0", 400, nil, "", "limit"},
		{"limit over cap", "/v1/tasks/delay?limit=1001", 400, nil, "", "limit"},
		{"limit huge", "/v1/tasks/delay?limit=99999999999999999999999", 400, nil, "", "limit"},
		{"limit negative", "/v1/tasks/delay?limit=-1", 400, nil, "", "limit"},
		{"limit plus", "/v1/tasks/delay?limit=%2B5", 400, nil, "", "limit"},
		{"limit word", "/v1/tasks/delay?limit=ten", 400, nil, "", "limit"},
		{"limit empty", "/v1/tasks/delay?limit=", 400, nil, "", "limit"},
		{"limit twice", "/v1/tasks/delay?limit=1&limit=2", 400, nil, "", "limit"},
		{"after bad escape", "/v1/tasks/delay?after=%zz", 400, nil, "", "after"},
		{"after twice", "/v1/tasks/delay?after=a&after=b", 400, nil, "", "after"},
		{"prefix bad escape", "/v1/tasks/delay?prefix=or%2", 400, nil, "", "prefix"},
		{"unknown parameter", "/v1/tasks/delay?limt=5", 400, nil, "", "limt"},
		{"semicolon", "/v1/tasks/delay?limit=1;after=a", 400, nil, "", "limit"},
		{"semicolon in name", "/v1/tasks/delay?a;b=1", 400, nil, "", "a;b"},
		{"NUL in source", "/v1/tasks/de%00lay", 400, nil, "", "NUL"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, b := getList(t, f, tt.path, "")
			if r.code != tt.code {
				t.Fatalf("GET %s = %d %q, want %d", tt.path, r.code, r.body, tt.code)
			}
			if r.code != 200 {
				if msg := jsonError(t, r); !strings.Contains(msg, tt.errHas) {
					t.Fatalf("error %q does not name %q", msg, tt.errHas)
				}
				return
			}
			if got := b.ids(t); !slices.Equal(got, tt.ids) || b.Next != tt.next {
				t.Fatalf("GET %s: ids %q next %q, want %q next %q", tt.path, got, b.Next, tt.ids, tt.next)
			}
			if !strings.Contains(r.body, `"tasks":[`) {
				t.Fatalf("tasks is not a list: %s", r.body)
			}
			src := strings.TrimPrefix(strings.SplitN(tt.path, "?", 2)[0], "/v1/tasks/")
			src, _ = url.PathUnescape(src)
			for i, ti := range b.Tasks {
				want, err := f.e.Lookup(src, b.ids(t)[i])
				if err != nil {
					t.Fatalf("Lookup: %v", err)
				}
				if !ti.Due.Equal(want.Due.Time) || !ti.NextFire.Equal(want.NextFire.Time) || ti.Origin != want.Origin ||
					ti.Target != want.Target || ti.Shard != want.Shard || ti.Attempts != want.Attempts || ti.Source != src {
					t.Fatalf("listed %+v, Lookup %+v", ti.TaskInfo, want)
				}
			}
		})
	}
	// The per-task JSON is that of GET /v1/tasks/{source}/{id}, plus
	// id_escaped for an id that is not UTF-8 (and only then).
	r, _ := getList(t, f, "/v1/tasks/delay?prefix=o&limit=1", "")
	var raw struct {
		Tasks []map[string]any `json:"tasks"`
		Next  string           `json:"next"`
	}
	if err := json.Unmarshal([]byte(r.body), &raw); err != nil {
		t.Fatal(err)
	}
	one := do(t, "GET", f.srv.URL+"/v1/tasks/delay/order-1", "")
	var want map[string]any
	if err := json.Unmarshal([]byte(one.body), &want); err != nil {
		t.Fatal(err)
	}
	if len(raw.Tasks) != 1 || fmt.Sprint(raw.Tasks[0]) != fmt.Sprint(want) || raw.Next != "order-1" {
		t.Fatalf("listed %s, GET of the task %s", r.body, one.body)
	}
	r, _ = getList(t, f, "/v1/tasks/delay?prefix=bin", "")
	if !strings.Contains(r.body, `"id_escaped":"bin%FF%00%2Fx"`) {
		t.Fatalf("no id_escaped for a binary id: %s", r.body)
	}
	r, _ = getList(t, f, "/v1/tasks/delay?prefix=a&limit=1", "")
	if strings.Contains(r.body, "escaped") {
		t.Fatalf("id_escaped for a UTF-8 id: %s", r.body)
	}
}

// TestListTasksPages: following next (next_escaped for an id that is not
// UTF-8) from page to page lists every pending task exactly once, in id
// order, with ids percent-encoded in the query as any client would.
func TestListTasksPages(t *testing.T) {
	f := listFixture(t, "")
	var tasks []codec.Task
	for i := range 23 {
		id := fmt.Sprintf("p%02d", i)
		switch i % 4 {
		case 1:
			id += "/\xff" // the next page starts after a binary id
		case 2:
			id += " +&=?#%"
		}
		tasks = append(tasks, task(id, int64(100+i), time.Hour))
	}
	if err := f.e.Ingest(context.Background(), tasks, nil); err != nil {
		t.Fatal(err)
	}
	want, err := f.e.ListTasks(source, shard.ListQuery{Limit: shard.MaxListLimit})
	if err != nil {
		t.Fatal(err)
	}
	if len(want.Tasks) != 23+7 || want.Next != "" {
		t.Fatalf("engine lists %d tasks, next %q", len(want.Tasks), want.Next)
	}
	for _, limit := range []int{1, 4, 29, 30} {
		var got []string
		path := fmt.Sprintf("/v1/tasks/delay?limit=%d", limit)
		for pages := 0; ; pages++ {
			if pages > 40 {
				t.Fatalf("limit %d: more than 40 pages", limit)
			}
			r, b := getList(t, f, path, "")
			if r.code != 200 || len(b.Tasks) > limit {
				t.Fatalf("GET %s = %d, %d tasks: %s", path, r.code, len(b.Tasks), r.body)
			}
			got = append(got, b.ids(t)...)
			if b.Next == "" {
				if b.NextEscaped != "" {
					t.Fatalf("next_escaped without next: %s", r.body)
				}
				break
			}
			after := url.QueryEscape(b.Next)
			if b.NextEscaped != "" {
				after = b.NextEscaped
			}
			path = fmt.Sprintf("/v1/tasks/delay?after=%s&limit=%d", after, limit)
		}
		wantIDs := make([]string, len(want.Tasks))
		for i, ti := range want.Tasks {
			wantIDs[i] = ti.ID
		}
		if !slices.Equal(got, wantIDs) {
			t.Fatalf("limit %d: pages listed %q, want %q", limit, got, wantIDs)
		}
	}
}

// TestListTasksAuth: the list needs the admin token like every /v1 route;
// the metrics token is refused; a wrong method is 405 (behind the token).
func TestListTasksAuth(t *testing.T) {
	f := newFixture(t, "s3cret", nil)
	h := NewHandler(Options{Engine: f.e, Gatherer: f.reg, Token: "s3cret", MetricsToken: "scrape"})
	tests := []struct {
		method, auth string
		code         int
	}{
		{"GET", "", 401},
		{"GET", "Bearer nope", 401},
		{"GET", "Bearer scrape", 403},
		{"POST", "", 401},
		{"POST", "Bearer s3cret", 405},
		{"GET", "Bearer s3cret", 200},
	}
	for _, tt := range tests {
		r := serve(t, h, tt.method, "/v1/tasks/delay?prefix=order", tt.auth)
		if r.code != tt.code {
			t.Errorf("%s with %q = %d %q, want %d", tt.method, tt.auth, r.code, r.body, tt.code)
			continue
		}
		if r.code != 200 {
			jsonError(t, r)
		} else if !strings.Contains(r.body, `"id":"order-1"`) {
			t.Errorf("body %s", r.body)
		}
	}
}

// TestListTasksEngineErrors: a closed engine is 503, as for the other
// routes; no engine is 503; the engine's ErrBadListQuery is 400.
func TestListTasksEngineErrors(t *testing.T) {
	f := newFixture(t, "", nil)
	if err := f.e.Close(); err != nil {
		t.Fatal(err)
	}
	if r := do(t, "GET", f.srv.URL+"/v1/tasks/delay", ""); r.code != 503 || !strings.Contains(jsonError(t, r), "closed") {
		t.Fatalf("closed engine: %d %q", r.code, r.body)
	}
	for _, tt := range []struct {
		engine Engine
		code   int
	}{
		{nil, 503},
		{errEngine{fmt.Errorf("%w: no", shard.ErrBadListQuery)}, 400},
		{errEngine{fmtErr(shard.ErrStoreFailed)}, 503},
	} {
		r := serve(t, NewHandler(Options{Engine: tt.engine}), "GET", "/v1/tasks/delay", "")
		if r.code != tt.code {
			t.Errorf("%v: %d %q, want %d", tt.engine, r.code, r.body, tt.code)
		}
		jsonError(t, r)
	}
}

// serve sends one request to h through a recorder.
func serve(t *testing.T, h http.Handler, method, target, auth string) resp {
	t.Helper()
	req := httptest.NewRequestWithContext(context.Background(), method, target, nil)
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return resp{rec.Code, rec.Header(), rec.Body.String()}
}
