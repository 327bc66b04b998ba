package fault

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// sessionExpiry plays the part of the Kafka group coordinator's session
// timeout where kfake has none.
//
// kfake arms a classic-group member's session timer when it delivers a
// response to that member. A member killed while its JoinGroup waits for the
// rebalance never receives the response, so it gets no timer; it is still
// put in the next generation and assigned partitions, and the pending-sync
// timer that would remove it is cleared by the leader's SyncGroup. It then
// holds its partitions until something else rebalances the group. Kafka
// schedules every member's heartbeat expiry when the join phase completes
// (GroupCoordinator.onCompleteJoin), whether or not the response reached
// it, so there the dead member is gone one session timeout later.
//
// The harness removes (LeaveGroup) the members of killed processes once
// the bridge's session timeout (30 s, its default) and a margin have passed
// since the kill: by then Kafka would have expired them too, and kfake
// already has unless it hit the gap above. Each process has its own client
// id, so a member's owner is known from DescribeGroups.
type sessionExpiry struct {
	t     *testing.T
	group string
	after time.Duration

	mu   sync.Mutex
	dead map[string]time.Time // client id -> when its process was killed
}

// sessionTimeout is the bridge's default kafka.session_timeout.
const sessionTimeout = 30 * time.Second

// watch starts the expiry loop; it stops at the end of the test.
func (e *sessionExpiry) watch(cl *kgo.Client) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	e.t.Cleanup(func() {
		cancel()
		<-done
	})
	go func() {
		defer close(done)
		tick := time.NewTicker(2 * time.Second)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
				e.sweep(ctx, cl)
			}
		}
	}()
}

// killed records that the process with this client id is gone.
func (e *sessionExpiry) killed(clientID string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.dead == nil {
		e.dead = map[string]time.Time{}
	}
	e.dead[clientID] = time.Now()
}

// expired reports whether clientID belongs to a process killed long enough
// ago that the broker should have expired its session.
func (e *sessionExpiry) expired(clientID string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	at, ok := e.dead[clientID]
	return ok && time.Since(at) > e.after
}

// sweep removes the group's members whose process died more than a
// session ago. Errors (the broker may be down in an outage test) wait for
// the next sweep.
func (e *sessionExpiry) sweep(ctx context.Context, cl *kgo.Client) {
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	dreq := kmsg.NewPtrDescribeGroupsRequest()
	dreq.Groups = []string{e.group}
	dresp, err := dreq.RequestWith(rctx, cl)
	if err != nil {
		return
	}
	lreq := kmsg.NewPtrLeaveGroupRequest()
	lreq.Group = e.group
	for _, g := range dresp.Groups {
		for _, m := range g.Members {
			if e.expired(m.ClientID) {
				lm := kmsg.NewLeaveGroupRequestMember()
				lm.MemberID = m.MemberID
				lreq.Members = append(lreq.Members, lm)
			}
		}
	}
	if len(lreq.Members) == 0 {
		return
	}
	lresp, err := lreq.RequestWith(rctx, cl)
	if err != nil {
		return
	}
	for _, m := range lresp.Members {
		e.t.Logf("harness expired group member %s of a process killed over %v ago (kfake kept it; error code %d)",
			m.MemberID, e.after, m.ErrorCode)
	}
}
