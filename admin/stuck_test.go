package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/shard"
)

// denySink refuses every delivery as a DLQ the bridge may not write would.
type denySink struct{}

func (denySink) Deliver(_ context.Context, batch []*codec.Task) []error {
	errs := make([]error, len(batch))
	for i := range errs {
		errs[i] = errors.New("kafka: publish to \"delay.dlq\": TOPIC_AUTHORIZATION_FAILED")
	}
	return errs
}

// newStuckFixture is a running engine (fake clock, not moved: no retry
// comes) whose one dead letter failed its first delivery, so it is listed
// as held, with a pending task beside it, behind the handler.
func newStuckFixture(t *testing.T, token string) (*fixture, shard.StuckEntry) {
	t.Helper()
	e, reg := openEngine(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx, denySink{}) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	dl := task("bad", 3, 0)
	dl = codec.DeadLetter(&dl, codec.CodeMissingDue, "no delay-at or delay-after header")
	if _, err := e.IngestAwait(context.Background(), []codec.Task{dl, task("order-1", 4, time.Hour)},
		[]shard.Checkpoint{{Key: "kafka|delay|0", Offset: 4}}); err != nil {
		t.Fatalf("IngestAwait: %v", err)
	}
	// The deadline only turns a hang into a failure.
	var l shard.StuckList
	for deadline := time.Now().Add(20 * time.Second); l.Total == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the dead letter's first delivery did not fail")
		}
		var err error
		if l, err = e.StuckEntries(0); err != nil {
			t.Fatal(err)
		}
	}
	srv := httptest.NewServer(NewHandler(Options{Engine: e, Gatherer: reg, Token: token,
		Logger: zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel))}))
	t.Cleanup(srv.Close)
	return &fixture{e: e, reg: reg, srv: srv}, l.Entries[0]
}

// The stuck routes in order against one engine: the list, malformed
// requests, an entry that is not listed, the drop, and after it.
func TestStuck(t *testing.T) {
	const token = "s3cret"
	f, ent := newStuckFixture(t, token)
	auth := "Bearer " + token
	one := fmt.Sprintf("/v1/stuck/%d/%d", ent.Shard, ent.Seq)
	// The task ingested after the dead letter, by its place in the store.
	pending, err := f.e.Lookup(source, "order-1")
	if err != nil {
		t.Fatal(err)
	}
	list := func(t *testing.T, r resp) shard.StuckList {
		t.Helper()
		var l shard.StuckList
		if err := json.Unmarshal([]byte(r.body), &l); err != nil {
			t.Fatalf("list %q: %v", r.body, err)
		}
		return l
	}
	steps := []struct {
		name, method, path, auth string
		code                     int
		check                    func(t *testing.T, r resp)
	}{
		{"list without token", "GET", "/v1/stuck", "", 401, nil},
		{"drop without token", "DELETE", one, "", 401, nil},
		{"list", "GET", "/v1/stuck", auth, 200, func(t *testing.T, r resp) {
			var raw map[string]any
			if err := json.Unmarshal([]byte(r.body), &raw); err != nil {
				t.Fatal(err)
			}
			e := raw["entries"].([]any)[0].(map[string]any)
			for _, k := range []string{"shard", "seq", "state", "next_fire", "error", "held_keys", "attempts", "code", "detail", "origin", "source", "destination"} {
				if _, ok := e[k]; !ok {
					t.Errorf("entry JSON lacks %q: %s", k, r.body)
				}
			}
			l := list(t, r)
			got := l.Entries[0]
			if l.Total != 1 || len(l.Entries) != 1 || got.State != shard.StuckHeld || got.Code != "missing-due" ||
				got.Origin != "kafka:delay/0@3" || got.Destination != "kafka:delay.dlq" || got.Attempts != 1 ||
				!slices.Equal(got.HeldKeys, []string{"kafka|delay|0"}) {
				t.Fatalf("list %+v", l)
			}
		}},
		{"list limit", "GET", "/v1/stuck?limit=1", auth, 200, nil},
		{"list limit over the max", "GET", "/v1/stuck?limit=100000", auth, 200, nil},
		{"list limit over int64", "GET", "/v1/stuck?limit=99999999999999999999", auth, 200, nil},
		{"list limit plus-signed", "GET", "/v1/stuck?limit=+5", auth, 400, nil},
		{"list limit 0", "GET", "/v1/stuck?limit=0", auth, 400, nil},
		{"list limit negative", "GET", "/v1/stuck?limit=-3", auth, 400, nil},
		{"list limit not a number", "GET", "/v1/stuck?limit=ten", auth, 400, nil},
		{"list limit badly escaped", "GET", "/v1/stuck?limit=%zz", auth, 400, nil},
		{"drop shard not a number", "DELETE", fmt.Sprintf("/v1/stuck/x/%d", ent.Seq), auth, 400, nil},
		{"drop seq not a number", "DELETE", fmt.Sprintf("/v1/stuck/%d/abc", ent.Shard), auth, 400, nil},
		{"drop seq negative", "DELETE", fmt.Sprintf("/v1/stuck/%d/-1", ent.Shard), auth, 400, nil},
		{"drop shard too large", "DELETE", fmt.Sprintf("/v1/stuck/70000/%d", ent.Seq), auth, 400, nil},
		{"drop without seq", "DELETE", fmt.Sprintf("/v1/stuck/%d/", ent.Shard), auth, 404, nil},
		{"drop unknown seq", "DELETE", fmt.Sprintf("/v1/stuck/%d/%d", ent.Shard, ent.Seq+100), auth, 404, nil},
		{"drop other shard", "DELETE", fmt.Sprintf("/v1/stuck/%d/%d", (ent.Shard+1)%4, ent.Seq), auth, 404, nil},
		{"drop pending task", "DELETE", fmt.Sprintf("/v1/stuck/%d/%d", pending.Shard, ent.Seq+1), auth, 404, nil},
		{"drop", "DELETE", one, auth, 204, func(t *testing.T, r resp) {
			if r.body != "" {
				t.Fatalf("body %q", r.body)
			}
			if n := f.e.AwaitedDeadLetters("kafka|delay|0"); n != 0 {
				t.Fatalf("the partition still awaits %d dead letters", n)
			}
			if p := f.e.Stats().Pending; p != 1 {
				t.Fatalf("%d pending, want the task", p)
			}
		}},
		{"drop again", "DELETE", one, auth, 404, nil},
		{"list after", "GET", "/v1/stuck", auth, 200, func(t *testing.T, r resp) {
			if l := list(t, r); l.Total != 0 || len(l.Entries) != 0 || r.body != "{\"entries\":[],\"total\":0}\n" {
				t.Fatalf("list after the drop %q", r.body)
			}
		}},
		{"metrics", "GET", "/metrics", auth, 200, func(t *testing.T, r resp) {
			if want := `delaybridge_stuck_dropped_total{state="held"} 1`; !slices.Contains(strings.Split(r.body, "\n"), want) {
				t.Fatalf("metrics lack %q", want)
			}
		}},
	}
	for _, st := range steps {
		r := do(t, st.method, f.srv.URL+st.path, st.auth)
		if r.code != st.code {
			t.Fatalf("%s: %s %s = %d %q, want %d", st.name, st.method, st.path, r.code, r.body, st.code)
		}
		if r.code >= 400 {
			jsonError(t, r)
		}
		if st.check != nil {
			t.Run(st.name, func(t *testing.T) { st.check(t, r) })
		}
	}
}
