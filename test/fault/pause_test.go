package fault

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/delaybridge/delaybridge/codec"
)

// TestPauseSurvivesKill9: an operator's pause of the binary (POST
// /v1/firing/pause) holds through SIGKILL. The bridge is killed right
// after the pause answered, then again once it held tasks already due on
// both transports (taken in while paused); after each restart it is still
// paused and nothing reached a target. POST /v1/firing/resume then
// delivers every task exactly once.
func TestPauseSurvivesKill9(t *testing.T) {
	t.Parallel()
	n := 100
	if long() {
		n = 2000
	}
	b := newBrokers(t, 0)
	col := b.collect(t)
	r := newRunner(t, b, bridgeConfig{})
	ac := &adminClient{t: t, base: "http://" + r.admin, c: &http.Client{Timeout: 5 * time.Second}}

	p := r.start()
	p.waitReady(90 * time.Second)
	if code, body := ac.post("/v1/firing/pause", `{"reason": "fault test"}`); code != http.StatusOK {
		t.Fatalf("POST /v1/firing/pause: %d %s", code, body)
	}
	p.kill() // at once: the pause is durable when it answers

	restart := func(what string) {
		t.Helper()
		p = r.start()
		p.waitLog(90*time.Second, "store recovered")
		ac.waitUp(p)
		// The catch-up at start first (the Kafka group join, a fetch).
		if !waitFor(60*time.Second, func() bool { return !ac.firing().CatchingUp }) {
			t.Fatalf("%s: still catching up after 60 s", what)
		}
		st := ac.firing()
		if !st.Paused || st.Operator == nil || st.Operator.Reason != "fault test" {
			t.Fatalf("%s: GET /v1/firing = %+v, want the operator's pause", what, st)
		}
	}
	restart("after a kill right after the pause")

	// Tasks due already (delay-after 0), half crossing transports.
	kcl := b.kafkaClient()
	defer kcl.Close()
	js, err := jetstream.New(b.natsConn())
	if err != nil {
		t.Fatal(err)
	}
	var vals []string
	for i := range n {
		kv, nv := "pause-k"+strconv.Itoa(i), "pause-n"+strconv.Itoa(i)
		kt, nt := kafkaTarget, "orders.paused"
		if i%2 == 1 {
			kt, nt = "nats:orders.paused", "kafka:"+kafkaTarget
		}
		if err := kcl.ProduceSync(context.Background(), kafkaRecord(int32(i%3), []byte(kv), []byte(kv), hdr(
			codec.HeaderAfter, "0", codec.HeaderTarget, kt))).FirstErr(); err != nil {
			t.Fatal(err)
		}
		if _, err := js.PublishMsg(context.Background(), natsMsg("delay.paused", []byte(nv), hdr(
			codec.HeaderAfter, "0", codec.HeaderTarget, nt, codec.HeaderNatsMsgID, nv))); err != nil {
			t.Fatal(err)
		}
		vals = append(vals, kv, nv)
	}
	ac.waitSetAside(int64(len(vals)))
	if got := delivered(col, vals); len(got) > 0 {
		t.Fatalf("delivered while paused: %d tasks (e.g. %v)", len(got), got[:min(5, len(got))])
	}

	p.kill()
	restart("after a kill holding due tasks")
	ac.waitSetAside(int64(len(vals)))
	if got := delivered(col, vals); len(got) > 0 {
		t.Fatalf("delivered after a restart while paused: %d tasks (e.g. %v)", len(got), got[:min(5, len(got))])
	}

	if code, body := ac.post("/v1/firing/resume", ""); code != http.StatusOK || !strings.Contains(string(body), `"paused":false`) {
		t.Fatalf("POST /v1/firing/resume: %d %s", code, body)
	}
	if !waitFor(60*time.Second, func() bool { lost, _ := lostAndDups(col, vals); return len(lost) == 0 }) {
		lost, _ := lostAndDups(col, vals)
		t.Fatalf("%d of %d tasks not delivered after the resume (e.g. %v)", len(lost), len(vals), lost[:min(5, len(lost))])
	}
	if !waitFor(30*time.Second, func() bool { return ac.stats().Pending == 0 }) {
		t.Fatalf("%d pending after every task was delivered", ac.stats().Pending)
	}
	if _, dups := lostAndDups(col, vals); dups != 0 {
		t.Fatalf("%d duplicates: nothing was in flight at the kills", dups)
	}
}

// delivered lists the values of vals that reached a target.
func delivered(col *collector, vals []string) []string {
	got := col.byValue(isTarget)
	var out []string
	for _, v := range vals {
		if len(got[v]) > 0 {
			out = append(out, v)
		}
	}
	return out
}

type firingState struct {
	Paused     bool `json:"paused"`
	CatchingUp bool `json:"catching_up"`
	Operator   *struct {
		Reason string `json:"reason"`
	} `json:"operator"`
	InFlight int `json:"in_flight"`
}

func (a *adminClient) firing() firingState {
	a.t.Helper()
	code, body := a.get("/v1/firing")
	var st firingState
	if err := json.Unmarshal(body, &st); code != http.StatusOK || err != nil {
		a.t.Fatalf("GET /v1/firing: %d %s (%v)", code, body, err)
	}
	return st
}

func (a *adminClient) post(path, body string) (int, []byte) {
	a.t.Helper()
	resp, err := a.c.Post(a.base+path, "application/json", strings.NewReader(body))
	if err != nil {
		a.t.Fatalf("POST %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		a.t.Fatalf("POST %s: %v", path, err)
	}
	return resp.StatusCode, b
}

// waitSetAside waits until the bridge holds pending tasks and its fire
// loops have taken every due one out of their wheels while paused (set
// aside: not in_wheel) with nothing in flight. A loop that fired them
// instead would take them out of the wheel too; the deliveries checked
// after it show that.
func (a *adminClient) waitSetAside(pending int64) {
	a.t.Helper()
	var last []byte
	if !waitFor(60*time.Second, func() bool {
		code, body := a.get("/v1/stats")
		last = body
		var st struct {
			Pending int64 `json:"pending"`
			Shards  []struct {
				InWheel int64 `json:"in_wheel"`
			} `json:"shards"`
		}
		if code != http.StatusOK || json.Unmarshal(body, &st) != nil || st.Pending != pending {
			return false
		}
		for _, s := range st.Shards {
			if s.InWheel != 0 {
				return false
			}
		}
		return a.firing().InFlight == 0
	}) {
		a.t.Fatalf("the due tasks were not set aside with %d pending: GET /v1/stats %s", pending, last)
	}
}
