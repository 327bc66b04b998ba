package nats

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/delaybridge/delaybridge/internal/natstest"
)

// TestSetupDuringQuorumLoss: a set-up of the source (NewSource) begun
// while the 3-node cluster has lost its quorum sends requests that no
// server may answer, not even once the quorum is back. With one request
// for the whole set-up budget (2 x ConnectTimeout) it waited that budget
// out and failed, and the retry came a backoff later: 14-19 s after the
// quorum was back here (ConnectTimeout 10s). The request is sent again
// while unanswered, so a set-up begun in the outage succeeds within about
// resendEvery (2s) of the quorum's return, and none waits its budget out.
//
// What the server left running answers in the outage depends on its age
// and the election timers, not on the bridge (nats-server 2.15,
// jsStreamInfoRequest): a replica that still follows the lost leader
// answers nothing; one whose group has been leaderless a while (it
// campaigned: its election timeout, or the leadership handed to it by a
// server shutting down) answers from its own state, with no leader, once
// its JetStream has run 10 s; a server whose meta group is leaderless
// answers requests that need the meta leader (the consumer's create) with
// 503 "JetStream system temporarily unavailable" after 500 ms, once its
// meta group is 10 s old. A young cluster (this test, alone) sees the
// silence; an older one (a loaded CI run, where the set-up above took
// over 10 s, or production) sees the answers, and a set-up attempt fails
// at once and is tried again after the backoff. Both are the outage; the
// test asserts what holds for both.
//
// The retries mimic the service's connector (bridge/service: a failed
// set-up is tried again after its backoff, 2 s at retry.max 2s). The
// "aged" form (DELAYBRIDGE_LONG=1) waits 11 s before the stop, so that
// the server kept answers rather than stays silent: an attempt answered
// 503 ends at once and the next comes 2 s later, as the service's
// connector does for such an answer (Leaderless).
func TestSetupDuringQuorumLoss(t *testing.T) {
	t.Run("young", func(t *testing.T) { setupDuringQuorumLoss(t, 0) })
	t.Run("aged", func(t *testing.T) {
		if os.Getenv("DELAYBRIDGE_LONG") != "1" {
			t.Skip("an 11 s wait for the cluster to age; set DELAYBRIDGE_LONG=1")
		}
		setupDuringQuorumLoss(t, 11*time.Second)
	})
}

func setupDuringQuorumLoss(t *testing.T, age time.Duration) {
	c := natstest.StartCluster(t, 3)
	cfg := testConfig(t, c.URLs())
	cfg.Create, cfg.Replicas = true, 3
	// A set-up budget (20 s) that the quorum's return, a few seconds
	// after the restart below, is well inside of.
	cfg.ConnectTimeout = 10 * time.Second
	var err error
	// A new cluster may still be placing its first assets.
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if _, err = NewSource(connect(t, cfg), cfg); err == nil || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	// The server left running is not the stream's leader, nor the
	// consumer's. Both known first: right after the set-up one may not be
	// elected yet (-1), and the server kept could then be the leader.
	eventually(t, "DELAY's stream and consumer leaders", func() bool {
		return c.StreamLeader("DELAY") >= 0 && c.ConsumerLeader("DELAY", cfg.Consumer) >= 0
	})
	leader := c.StreamLeader("DELAY")
	stopped := map[int]bool{leader: true, c.ConsumerLeader("DELAY", cfg.Consumer): true}
	keep := -1
	for i := range 3 {
		if !stopped[i] {
			keep = i
		}
	}
	// The stream's leader is stopped last. A server shutting down hands
	// its leaderships to a healthy peer (Server.Shutdown steps its raft
	// nodes down): stopped first, its stream could go to the server kept,
	// elected with the vote of the one not yet stopped, which then answers
	// lookups as a leader without a quorum for some 20 s (a CI run's
	// precondition timed out so). Stopped last, it hands it to the server
	// kept, which finds no peer to vote for it.
	var down []int
	for i := range 3 {
		if i != keep && i != leader {
			down = append(down, i)
		}
	}
	down = append(down, leader)
	t.Logf("keeping server %d; stream leader %d, consumer leader %d, meta leader %d; stopping %v",
		keep, leader, c.ConsumerLeader("DELAY", cfg.Consumer), c.MetaLeader(), down)
	cfg.URL = c.URL(keep)
	nc := connect(t, cfg)
	js := newJS(t, nc)
	time.Sleep(age) // the cluster's JetStream ages: see above
	for _, i := range down {
		c.Stop(i)
	}
	stop := time.Now()
	// The outage, as the server kept shows it: a stream lookup unanswered,
	// answered 503 (no meta leader), or answered by a replica that knows
	// its stream has no leader. A lookup answered by a leader means the
	// server kept leads the stream yet (it won a hand-over): it steps down
	// once it notices it has lost its quorum.
	for deadline := stop.Add(60 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		st, err := js.Stream(ctx, "DELAY")
		cancel()
		var apiErr *jetstream.APIError
		var seen string
		switch {
		case errors.Is(err, context.DeadlineExceeded):
			seen = "unanswered"
		case errors.As(err, &apiErr) && apiErr.ErrorCode == jsErrClusterNotAvail:
			seen = err.Error()
		case err == nil && st.CachedInfo().Cluster != nil && st.CachedInfo().Cluster.Leader == "":
			seen = "answered by a replica without a leader"
		}
		if seen != "" {
			t.Logf("in the outage %v after the stop: stream lookup %s; stream leader %d, meta leader %d",
				time.Since(stop), seen, c.StreamLeader("DELAY"), c.MetaLeader())
			break
		}
		if time.Now().After(deadline) {
			what := fmt.Sprint(err)
			if err == nil {
				what = fmt.Sprintf("answered, leader %q", st.CachedInfo().Cluster.Leader)
			}
			t.Fatalf("no sign of the outage in stream lookups 60 s after the stop (last: %s; stream leader %d, meta leader %d)",
				what, c.StreamLeader("DELAY"), c.MetaLeader())
		}
	}

	type outcome struct {
		attempts int
		resent   int64
		errs     []error       // of the failed attempts
		took     time.Duration // of the longest failed attempt
		err      error
		at       time.Time
	}
	done := make(chan outcome, 1)
	go func() {
		var errs []error
		var took time.Duration
		deadline := time.Now().Add(2 * time.Minute)
		for n := 1; ; n++ {
			began := time.Now()
			src, err := NewSource(nc, cfg)
			if err == nil || time.Now().After(deadline) {
				o := outcome{attempts: n, errs: errs, took: took, err: err, at: time.Now()}
				if src != nil {
					o.resent = src.resent.Load()
				}
				done <- o
				return
			}
			errs = append(errs, err)
			took = max(took, time.Since(began))
			time.Sleep(2 * time.Second) // the connector's backoff
		}
	}()
	// The first set-up attempt has sent its stream lookup (into the
	// outage) by now; this is not what the test asserts on.
	time.Sleep(time.Second)
	restart := time.Now()
	for _, i := range down {
		c.Start(i)
	}
	// Back: every group the set-up asks is led again. The stream's leader
	// and the meta leader are not enough: the set-up then looks up the
	// consumer, which only its leader answers, and the consumer's group
	// elects its own: under CPU load up to 4.2 s after the stream's, and
	// a set-up done 6.5 s after the stream's return failed the bound
	// below. The elections are the cluster's; the deadline only turns one
	// that never ends into a failure.
	for deadline := time.Now().Add(60 * time.Second); c.StreamLeader("DELAY") < 0 || c.ConsumerLeader("DELAY", cfg.Consumer) < 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("DELAY's stream leader %d, consumer leader %d 60 s after the restart", c.StreamLeader("DELAY"), c.ConsumerLeader("DELAY", cfg.Consumer))
		}
	}
	c.WaitMeta()
	back := time.Now()
	t.Logf("stream, consumer and meta leaders back %v after the restart", back.Sub(restart))

	var o outcome
	select {
	case o = <-done:
	case <-time.After(2 * time.Minute):
		t.Fatal("set-up not done 2 min after the quorum was back")
	}
	for i, err := range o.errs {
		t.Logf("set-up attempt %d: %v", i+1, err)
	}
	if o.err != nil {
		t.Fatalf("set-up failed %d times: %v", o.attempts, o.err)
	}
	took := o.at.Sub(back)
	t.Logf("set-up done %v after the quorum was back, attempt %d, %d requests sent again", took, o.attempts, o.resent)
	// No attempt begun in the outage waited for requests no server
	// answered until its budget ran out: they are sent again, and the
	// attempt noticed the return. (One answered 503 ends at once, and the
	// service tries again within 2 s: Leaderless.)
	for i, err := range o.errs {
		if errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("set-up attempt %d waited its budget out (longest failed attempt %v) for requests no server answered: %v", i+1, o.took, err)
		}
	}
	if took > 5*time.Second {
		t.Errorf("set-up done %v after the quorum was back, want within about %v", took, min(cfg.ConnectTimeout, 2*time.Second))
	}
}

// TestAnsweredSlowAnswer: a request answered later than resendEvery, as
// a healthy but slow cluster does, still counts: sending it again does
// not cut the first one short, so the set-up does not loop on requests
// that each time out.
func TestAnsweredSlowAnswer(t *testing.T) {
	s := &Source{cfg: Config{ConnectTimeout: 20 * time.Millisecond}}
	var calls atomic.Int32
	first := make(chan struct{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	v, err := answered(ctx, s, func(ctx context.Context) (int, error) {
		n := calls.Add(1)
		if n == 1 {
			// Answered only after the request was sent again twice.
			for calls.Load() < 3 {
				time.Sleep(time.Millisecond)
			}
			close(first)
			return 1, nil
		}
		<-ctx.Done() // never answered
		return 0, ctx.Err()
	})
	if err != nil || v != 1 {
		t.Fatalf("answered: %d, %v; want the first request's answer", v, err)
	}
	<-first
	if n := s.resent.Load(); n < 2 {
		t.Fatalf("%d requests sent again, want at least 2", n)
	}
}

// TestAnsweredUnavailable: an answer counts at once, whatever it is: a
// 503 "JetStream system temporarily unavailable" (a quorum loss; the
// service tries again within 2 s, Leaderless), JetStream not enabled,
// the other 503s (review R194: "insufficient resources" may be
// max_ha_assets reached) and the errors ensure branches on. Only a
// request nobody answers is sent again (TestAnsweredSlowAnswer).
func TestAnsweredUnavailable(t *testing.T) {
	unavail := &jetstream.APIError{Code: http.StatusServiceUnavailable, ErrorCode: jsErrClusterNotAvail, Description: "JetStream system temporarily unavailable"}
	notEnabled := &jetstream.APIError{Code: http.StatusServiceUnavailable, ErrorCode: jetstream.JSErrCodeJetStreamNotEnabled, Description: "jetstream not enabled"}
	overlap := &jetstream.APIError{Code: http.StatusBadRequest, ErrorCode: jsStreamSubjectOverlap, Description: "subjects overlap with an existing stream"}
	ackExcess := &jetstream.APIError{Code: http.StatusBadRequest, ErrorCode: jsErrConsumerMaxAckPendingExcess, Description: "consumer max ack pending exceeds system limit of 1000"}
	wqTaken := &jetstream.APIError{Code: http.StatusBadRequest, ErrorCode: jsErrConsumerWQNotUnique, Description: "filtered consumer not unique on workqueue stream"}
	resources := &jetstream.APIError{Code: http.StatusServiceUnavailable, ErrorCode: jsErrInsufficientResources, Description: "insufficient resources"}
	storeFailed := &jetstream.APIError{Code: http.StatusServiceUnavailable, ErrorCode: jsErrStreamStoreFailed, Description: "mkdir: no space left on device"}
	tests := []struct {
		name      string
		answers   []error // of the calls in turn; past the end, the last
		budget    time.Duration
		wantV     int
		wantErr   error // errors.Is; nil: success
		wantCalls int32 // at least
	}{
		{"503 at once", []error{unavail, nil}, 10 * time.Second, 0, unavail, 1},
		{"an answer at once", []error{nil}, 10 * time.Second, 1, nil, 1},
		{"not enabled at once", []error{notEnabled}, 10 * time.Second, 0, notEnabled, 1},
		{"another error at once", []error{jetstream.ErrStreamNotFound}, 10 * time.Second, 0, jetstream.ErrStreamNotFound, 1},
		// What ensure branches on, and the 503s that are not the quorum's
		// (review R194: max_ha_assets reached, a store failing).
		{"consumer not found at once", []error{jetstream.ErrConsumerNotFound}, 10 * time.Second, 0, jetstream.ErrConsumerNotFound, 1},
		{"subject overlap at once", []error{overlap}, 10 * time.Second, 0, overlap, 1},
		{"max ack pending excess at once", []error{ackExcess}, 10 * time.Second, 0, ackExcess, 1},
		{"work queue not unique at once", []error{wqTaken}, 10 * time.Second, 0, wqTaken, 1},
		{"insufficient resources at once", []error{resources}, 10 * time.Second, 0, resources, 1},
		{"store failed at once", []error{storeFailed}, 10 * time.Second, 0, storeFailed, 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := &Source{cfg: Config{ConnectTimeout: 20 * time.Millisecond}}
			var calls atomic.Int32
			ctx, cancel := context.WithTimeout(context.Background(), tc.budget)
			defer cancel()
			v, err := answered(ctx, s, func(ctx context.Context) (int, error) {
				n := int(calls.Add(1))
				err := tc.answers[min(n, len(tc.answers))-1]
				if err != nil {
					return 0, err
				}
				return n, nil
			})
			if tc.wantErr == nil {
				if err != nil || v != tc.wantV {
					t.Fatalf("answered: %d, %v; want %d, no error", v, err, tc.wantV)
				}
			} else if !errors.Is(err, tc.wantErr) {
				t.Fatalf("answered: %d, %v; want %v", v, err, tc.wantErr)
			}
			if n := calls.Load(); n < tc.wantCalls {
				t.Fatalf("%d calls, want at least %d", n, tc.wantCalls)
			}
			if tc.wantCalls == 1 {
				if n := calls.Load(); n != 1 {
					t.Fatalf("%d calls, want 1: the answer counts at once", n)
				}
			}
		})
	}
}
