package nats

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/delaybridge/delaybridge/internal/natstest"
)

// TestRetryPause: after a failure answered 503 10008 (Leaderless) the
// running source tries again within leaderlessRetry however far its
// backoff has grown, and such answers grow it to leaderlessRetry at
// most; after any other failure, its backoff. The long form of this, on
// a cluster, is TestRunningSourceQuorumLoss.
func TestRetryPause(t *testing.T) {
	leaderless := fmt.Errorf("nats source: look up stream %q: %w", "DELAY", &jetstream.APIError{
		Code: http.StatusServiceUnavailable, ErrorCode: jsErrClusterNotAvail, Description: "JetStream system temporarily unavailable"})
	resources := fmt.Errorf("nats source: create consumer: %w", &jetstream.APIError{
		Code: http.StatusServiceUnavailable, ErrorCode: jsErrInsufficientResources, Description: "insufficient resources"})
	grown := func() *backoff {
		bo := &backoff{min: 100 * time.Millisecond, max: 10 * time.Second}
		for range 10 {
			bo.next()
		}
		return bo
	}
	if d := retryPause(grown(), leaderless); d > leaderlessRetry {
		t.Errorf("after a Leaderless answer, with the backoff at its 10 s: %v, want at most %v", d, leaderlessRetry)
	}
	if d := retryPause(grown(), resources); d < 8*time.Second {
		t.Errorf("after another 503, with the backoff at its 10 s: %v, want the backoff (8-12 s)", d)
	}
	if d := retryPause(grown(), context.DeadlineExceeded); d < 8*time.Second {
		t.Errorf("after an unanswered request, with the backoff at its 10 s: %v, want the backoff (8-12 s)", d)
	}
	bo := &backoff{min: 100 * time.Millisecond, max: 10 * time.Second}
	if d := retryPause(bo, leaderless); d > 120*time.Millisecond {
		t.Errorf("first retry after a Leaderless answer: %v, want the backoff's first (80-120 ms)", d)
	}
	// A whole outage of Leaderless answers does not grow the backoff
	// past leaderlessRetry: another failure right after the quorum's
	// return (a request sent before a leader was elected) waits its
	// next step from there, not the 10 s it grew to.
	for i := range 20 {
		if d := retryPause(bo, leaderless); d > leaderlessRetry {
			t.Fatalf("Leaderless answer %d: %v, want at most %v", i+2, d, leaderlessRetry)
		}
	}
	if d := retryPause(bo, context.DeadlineExceeded); d > 2*leaderlessRetry*12/10 {
		t.Errorf("another failure after 21 Leaderless answers: %v, want at most %v (the backoff grown to %v only)", d, 2*leaderlessRetry*12/10, leaderlessRetry)
	}
	// One grown past it by other failures is kept, the wait capped.
	g := grown()
	retryPause(g, leaderless)
	if d := retryPause(g, context.DeadlineExceeded); d < 8*time.Second {
		t.Errorf("another failure after a grown backoff and a Leaderless answer: %v, want the backoff (8-12 s)", d)
	}
}

// TestRunningSourceQuorumLoss: a source whose cluster loses its quorum
// is answered 503 10008 (Leaderless) at every try for as long as the
// outage lasts, and its backoff grows to 10 s meanwhile. Capped at
// leaderlessRetry (2 s), its tries stay about 2 s apart, so that it tries
// again within about 2 s of the quorum's return, not up to its backoff's
// 12 s after its last try; and it takes new messages after it.
//
// Which request is answered 503 depends on the servers left (nats-server
// 2.15, jsStreamInfoRequest, jsConsumerInfoRequest), and they say it only
// once their JetStream has run 10 s (the servers' lost-quorum interval:
// hence the cluster's age below):
//   - "re-set-up" and "first read": 5 servers, the R3 stream's and
//     consumer's 3 peers stopped, the meta leader among them. The 2 left
//     are no replicas: they answer the stream's lookup 503 (no meta
//     leader), so Run's re-set-up after consuming stopped (reconcile),
//     or with the outage begun between NewSource and Run, Run's first
//     read of the stream, fails at every try.
//   - "consuming": 3 servers, 2 stopped. The one left is a replica: it
//     answers the stream's lookup from its own state, with no leader,
//     which the re-set-up refuses (ErrNoStreamLeader, Leaderless: its
//     state may be behind, see TestStaleReplicaNotTakenForRestore) at
//     every try. (Before, the re-set-up took it, and the consumer's info
//     was answered 503, its group without a leader.)
//
// The cap is asserted by the time between two tries once the backoff is
// at its 10 s: under 6 s (leaderlessRetry and the answer's 500 ms at
// most), where the backoff is at least 8 s. The time from the quorum's
// return to the next message taken is only logged, the message required
// within 30 s: the return itself (elections) took 3-8 s here, while the
// source waited from its last try before it, so a source waiting its
// backoff took it within 1.3-7.5 s of the return too; and a consumer
// info sent just before the consumer's leader is elected is not sent
// again (consume), so a source with the cap took it 4.8-5 s after the
// return in 2 runs of 8.
func TestRunningSourceQuorumLoss(t *testing.T) {
	if os.Getenv("DELAYBRIDGE_LONG") != "1" {
		t.Skip("clusters aged 11 s and outages of 20 s; set DELAYBRIDGE_LONG=1 (TestRetryPause is the short form)")
	}
	t.Run("consuming", func(t *testing.T) { sourceQuorumLoss(t, 3, true) })
	t.Run("re-set-up", func(t *testing.T) { sourceQuorumLoss(t, 5, true) })
	t.Run("first read", func(t *testing.T) { sourceQuorumLoss(t, 5, false) })
}

// sourceQuorumLoss runs the source on a cluster of n servers (3 or 5, see
// TestRunningSourceQuorumLoss) before the quorum's loss if running, else
// after it.
func sourceQuorumLoss(t *testing.T, n int, running bool) {
	c := natstest.StartCluster(t, n)
	aged := time.Now().Add(11 * time.Second) // see above: the lost-quorum interval
	cfg := testConfig(t, c.URLs())
	cfg.Create, cfg.Replicas = true, 3
	cfg.PullExpiry = 2 * time.Second // a stopped consume is noticed within 2 s
	admin := newJS(t, connect(t, cfg))
	var down, keep []int
	if n == 3 {
		down, keep = threeNodeOutage(t, c, cfg)
	} else {
		var bounced time.Time
		down, keep, bounced = quorumPeers(t, c, cfg, admin)
		if a := bounced.Add(11 * time.Second); a.After(aged) {
			aged = a
		}
	}
	urls := make([]string, len(keep))
	for i, k := range keep {
		urls[i] = c.URL(k)
	}
	cfg.URL = strings.Join(urls, ",")
	src := clusterSource(t, cfg)
	rec := newRecorder()
	errs := cfg.Metrics.SourceErrors.WithLabelValues(cfg.Stream)
	if running {
		runSource(t, src, rec)
		publishRetry(t, admin, "delay.a", "before")
		eventually(t, "the message published before the outage", func() bool { return taken(rec, "before") })
	}
	time.Sleep(time.Until(aged))
	t.Logf("stopping %v (the last leads), keeping %v", down, keep)
	for _, i := range down {
		c.Stop(i)
	}
	stop := time.Now()
	before := testutil.ToFloat64(errs)
	if !running {
		runSource(t, src, rec)
	}
	// nextTry waits for the next failed try, each counted.
	nextTry := func() time.Time {
		t.Helper()
		n := testutil.ToFloat64(errs)
		for deadline := time.Now().Add(30 * time.Second); testutil.ToFloat64(errs) == n; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("no try for 30 s in the outage (health %v)", src.Health())
			}
		}
		return time.Now()
	}
	// Eight failed tries: the backoff (100 ms doubled, at most 10 s) is
	// at its 10 s.
	for deadline := stop.Add(90 * time.Second); testutil.ToFloat64(errs) < before+8 || !Leaderless(src.Health()); {
		if time.Now().After(deadline) {
			t.Fatalf("%v failed tries and health %v 90 s into the outage, want 8 tries, the last answered 503 10008",
				testutil.ToFloat64(errs)-before, src.Health())
		}
		nextTry()
	}
	prev := nextTry()
	failed := nextTry()
	if err := src.Health(); !Leaderless(err) {
		t.Fatalf("try in the outage: %v, want 503 10008", err)
	}
	gap := failed.Sub(prev)
	t.Logf("%v failed tries in %v of outage; the last two %v apart", testutil.ToFloat64(errs)-before, failed.Sub(stop), gap)
	if gap > 6*time.Second {
		t.Errorf("tries answered 503 10008 %v apart with the backoff at its 10 s, want about %v (leaderlessRetry)", gap, leaderlessRetry)
	}
	restart := time.Now()
	for _, i := range down {
		c.Start(i)
	}
	eventually(t, "the stream's and consumer's leaders", func() bool {
		return c.StreamLeader(cfg.Stream) >= 0 && c.ConsumerLeader(cfg.Stream, cfg.Consumer) >= 0
	})
	c.WaitMeta()
	back := time.Now()
	publishRetry(t, admin, "delay.a", "after")
	for deadline := back.Add(30 * time.Second); !taken(rec, "after"); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the message published after the quorum's return not taken 30 s later (health %v)", src.Health())
		}
	}
	t.Logf("quorum back %v after the restart (%v after the last failed try); message taken %v after it",
		back.Sub(restart), back.Sub(failed), time.Since(back))
	want := 1 // "after"
	if running {
		want++ // "before"
	}
	handedOnce(t, rec, want)
}

// threeNodeOutage is the 3-node cluster's outage of
// TestRunningSourceQuorumLoss: the servers to stop, the stream's leader
// last (one shutting down hands its leaderships to a peer: stopped first,
// it could hand the stream to the one kept, see TestSetupDuringQuorumLoss),
// and the one to keep, which leads neither the stream nor the consumer.
func threeNodeOutage(t *testing.T, c *natstest.Cluster, cfg Config) (down, keep []int) {
	t.Helper()
	clusterSource(t, cfg)
	eventually(t, "the stream's and consumer's leaders", func() bool {
		return c.StreamLeader(cfg.Stream) >= 0 && c.ConsumerLeader(cfg.Stream, cfg.Consumer) >= 0
	})
	leader := c.StreamLeader(cfg.Stream)
	busy := map[int]bool{leader: true, c.ConsumerLeader(cfg.Stream, cfg.Consumer): true}
	for i := range 3 {
		switch {
		case !busy[i] && len(keep) == 0:
			keep = append(keep, i)
		case i != leader:
			down = append(down, i)
		}
	}
	return append(down, leader), keep
}

// taken reports whether rec was handed a message with this value.
func taken(rec *recorder, value string) bool {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for _, it := range rec.items {
		if string(it.Msg.Value) == value {
			return true
		}
	}
	return false
}

// quorumPeers is the 5-node cluster's outage of
// TestRunningSourceQuorumLoss: it creates cfg's R3 stream and consumer
// and returns their 3 peers (the servers to stop, the JetStream meta
// leader last, so that no server kept is handed the meta leadership) and
// the 2 servers that are none of them (to keep). A meta leader that is
// none of them is stopped and started again until one of them leads; the
// time of the last start is returned (the servers' lost-quorum interval
// counts from it).
func quorumPeers(t *testing.T, c *natstest.Cluster, cfg Config, js jetstream.JetStream) (down, keep []int, bounced time.Time) {
	t.Helper()
	index := map[string]int{}
	for i := range 5 {
		index[c.Name(i)] = i
	}
	clusterSource(t, cfg)
	var sp, cp []string
	eventually(t, "the stream's and consumer's peers", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		st, err := js.Stream(ctx, cfg.Stream)
		if err != nil {
			return false
		}
		cons, err := st.Consumer(ctx, cfg.Consumer)
		if err != nil {
			return false
		}
		sp, cp = peerNames(st.CachedInfo().Cluster), peerNames(cons.CachedInfo().Cluster)
		return len(sp) == 3 && len(cp) == 3
	})
	in := map[int]bool{}
	for _, n := range sp {
		in[index[n]] = true
	}
	for _, n := range cp {
		if !in[index[n]] {
			t.Fatalf("consumer peers %v, stream peers %v: want the same", cp, sp)
		}
	}
	meta := -1
	for try := 0; ; try++ {
		c.WaitMeta()
		if meta = c.MetaLeader(); meta >= 0 && in[meta] {
			break
		}
		if try == 10 {
			t.Fatalf("the meta leadership not on a peer of the stream (%v) after 10 restarts of its leader", sp)
		}
		if meta >= 0 {
			c.Stop(meta)
			eventually(t, "another meta leader", func() bool { return c.MetaLeader() >= 0 })
			c.Start(meta)
			bounced = time.Now()
		}
	}
	for i := range 5 {
		switch {
		case !in[i]:
			keep = append(keep, i)
		case i != meta:
			down = append(down, i)
		}
	}
	return append(down, meta), keep, bounced
}

// peerNames are the names of a stream's or consumer's peers, its leader
// first; nil while it has none.
func peerNames(ci *jetstream.ClusterInfo) []string {
	if ci == nil || ci.Leader == "" {
		return nil
	}
	out := []string{ci.Leader}
	for _, r := range ci.Replicas {
		out = append(out, r.Name)
	}
	return out
}
