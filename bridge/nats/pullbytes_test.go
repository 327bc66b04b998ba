package nats

import (
	"encoding/json"
	"fmt"
	"sync"
	"testing"

	natsgo "github.com/nats-io/nats.go"
)

// pullWatch records the pull requests of the source's consumer, seen on a
// connection of its own.
type pullWatch struct {
	mu   sync.Mutex
	reqs []pullReq
}

type pullReq struct {
	Batch    int `json:"batch"`
	MaxBytes int `json:"max_bytes"`
}

func watchPulls(t *testing.T, url, stream, consumer string) *pullWatch {
	t.Helper()
	nc, err := natsgo.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	w := &pullWatch{}
	if _, err := nc.Subscribe("$JS.API.CONSUMER.MSG.NEXT."+stream+"."+consumer, func(m *natsgo.Msg) {
		var r pullReq
		_ = json.Unmarshal(m.Data, &r)
		w.mu.Lock()
		w.reqs = append(w.reqs, r)
		w.mu.Unlock()
	}); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	return w
}

func (w *pullWatch) all() []pullReq {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]pullReq(nil), w.reqs...)
}

// TestSourcePullsBoundedBytes (hunt H134): the source's pulls ask for few
// enough messages that max_payload-sized ones stay within PullBytes (63
// at the default 1 MiB max_payload and 64 MiB), not 2 x BatchSize = 512 of
// any size: a backlog of 1 MiB messages was prefetched 512 MiB at a time.
// With a max_payload of 64 KiB the pulls still ask for 512. And no byte
// limit in the request (PullMaxMessagesWithBytesLimit drops messages, see
// consume).
func TestSourcePullsBoundedBytes(t *testing.T) {
	for _, tc := range []struct {
		maxPayload int32
		want       int
	}{
		{0, 63}, // the server's default, 1 MiB
		{64 << 10, 512},
	} {
		t.Run(fmt.Sprint(tc.maxPayload), func(t *testing.T) { testPullsBoundedBytes(t, tc.maxPayload, tc.want) })
	}
}

func testPullsBoundedBytes(t *testing.T, maxPayload int32, want int) {
	opts := jsOptions(t)
	opts.MaxPayload = maxPayload
	cfg, _, js, src := createdSourceOn(t, opts, nil)
	w := watchPulls(t, cfg.URL, cfg.Stream, cfg.Consumer)
	rec := newRecorder()
	stop := runSource(t, src, rec)
	defer stop()
	publish(t, js, "delay.a", "m", delayHeader())
	eventually(t, "the message taken in", func() bool { return rec.itemCount() == 1 })
	reqs := w.all()
	if len(reqs) == 0 {
		t.Fatal("no pull request seen")
	}
	if reqs[0].MaxBytes != 0 || reqs[0].Batch != want {
		t.Fatalf("first pull request %+v: want %d messages and no byte limit", reqs[0], want)
	}
	for _, r := range reqs {
		if r.MaxBytes != 0 || r.Batch > want {
			t.Fatalf("pull requests %+v: want no byte limit and at most %d messages", reqs, want)
		}
	}
}

func TestPullMessages(t *testing.T) {
	for _, tc := range []struct {
		want, pullBytes int
		maxPayload      int64
		n               int
	}{
		{512, 64 << 20, 1 << 20, 63},
		{512, 64 << 20, 64 << 10, 512},
		{512, 64 << 20, 124 << 10, 512},
		{512, 64 << 20, 64 << 20, 2},
		{512, 64 << 20, 0, 512},
		{512, 64 << 20, -1, 512},
		{512, 64 << 20, 1 << 62, 2},
		{100, 1 << 30, 1 << 20, 100},
	} {
		if got := pullMessages(tc.want, tc.pullBytes, tc.maxPayload); got != tc.n {
			t.Errorf("pullMessages(%d, %d, %d) = %d, want %d", tc.want, tc.pullBytes, tc.maxPayload, got, tc.n)
		}
	}
}
