package kafka

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.uber.org/zap"
)

// TestRejoinAfterOutageNotHeldBySession: a broker outage shorter than the
// session timeout ends the bridge's generation, and kafka-go, failing to
// leave the group meanwhile, drops its member id and joins again as a new
// member. The coordinator then waits for the old member, the bridge's own,
// until its session (or the rebalance timeout) runs out: nothing new was
// taken in for that long after every blip (hunt H163 measured 19 s after
// the broker was back, with the default 30 s). The source removes its old
// membership itself once the broker answers, so intake resumes at once.
// The timeouts here are 90 s and the wait 30 s: without the removal the
// message after the outage is not taken in within the wait.
func TestRejoinAfterOutageNotHeldBySession(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	var down atomic.Bool
	var leaves atomic.Int32
	c.Control(func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if down.Load() {
			return nil, errors.New("broker down"), true
		}
		if _, ok := req.(*kmsg.LeaveGroupRequest); ok {
			leaves.Add(1)
		}
		return nil, nil, false
	})
	cfg := testConfig(t, c.ListenAddrs(), "g-stale", "delay")
	cfg.SessionTimeout, cfg.RebalanceTimeout = 90*time.Second, 90*time.Second
	s, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h := newMemHandler()
	runSource(t, s, h)
	cl := producer(t, c)
	produce(t, cl, &kgo.Record{Topic: "delay", Partition: 0, Value: []byte("before")})
	waitFor(t, "the message before the outage", func() bool { return h.count() == 1 })

	down.Store(true)
	waitFor(t, "the join failing while the broker is down", func() bool {
		err := s.Health()
		return err != nil && strings.Contains(err.Error(), "join group")
	})
	down.Store(false)
	produce(t, cl, &kgo.Record{Topic: "delay", Partition: 0, Value: []byte("after")})
	waitFor(t, "the message after the outage", func() bool { return h.count() == 2 })
	if leaves.Load() == 0 {
		t.Fatal("no LeaveGroup after the outage")
	}
}

// TestRestartAfterCrashNotHeldBySession: a process that stopped without
// leaving the group (kill -9, an OOM kill; here a stop whose LeaveGroup the
// broker refuses) left its member in the group, and the coordinator held
// the next run's join until that member's session ran out: nothing taken
// in for up to 30 s after every crash. The member id is kept in
// Config.MemberFile, and the next run removes that member. Timeouts 90 s,
// wait 30 s, as above.
func TestRestartAfterCrashNotHeldBySession(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	var refuseLeave atomic.Bool
	c.ControlKey(kmsg.LeaveGroup.Int16(), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if refuseLeave.Load() {
			return nil, errors.New("no leave"), true
		}
		return nil, nil, false
	})
	cfg := testConfig(t, c.ListenAddrs(), "g-crash", "delay")
	cfg.SessionTimeout, cfg.RebalanceTimeout = 90*time.Second, 90*time.Second
	cfg.MemberFile = filepath.Join(t.TempDir(), "kafka-member")
	cl := producer(t, c)
	h := newMemHandler()

	first, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop := runSource(t, first, h)
	produce(t, cl, &kgo.Record{Topic: "delay", Partition: 0, Value: []byte("before")})
	waitFor(t, "the message before the crash", func() bool { return h.count() == 1 })
	refuseLeave.Store(true)
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	refuseLeave.Store(false)
	if gi := c.GroupInfo("g-crash"); gi == nil || len(gi.Members) != 1 {
		t.Fatalf("the first run's member should still be in the group: %+v", gi)
	}

	second, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	runSource(t, second, h)
	produce(t, cl, &kgo.Record{Topic: "delay", Partition: 0, Value: []byte("after")})
	waitFor(t, "the message after the restart", func() bool { return h.count() == 2 })
}

// TestMemberFile: what the file holds is read back; a missing, empty,
// oversized or non-UTF-8 file gives no member (nothing to remove); no
// file configured writes nothing.
func TestMemberFile(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		name    string
		content []byte // nil: no file
		want    string
	}{
		{"missing", nil, ""},
		{"written", []byte("delaybridge-0123\n"), "delaybridge-0123"},
		{"empty", []byte{}, ""},
		{"too long", []byte(strings.Repeat("m", maxMemberID+1)), ""},
		{"not utf-8", []byte{0xff, 0xfe}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "-"))
			if tc.content != nil {
				if err := os.WriteFile(f, tc.content, 0o600); err != nil {
					t.Fatal(err)
				}
			}
			s := &Source{cfg: Config{MemberFile: f}, log: zap.NewNop()}
			if got := s.readMemberFile(); got != tc.want {
				t.Fatalf("readMemberFile = %q, want %q", got, tc.want)
			}
		})
	}
	f := filepath.Join(dir, "round-trip")
	s := &Source{cfg: Config{MemberFile: f}, log: zap.NewNop()}
	s.writeMemberFile("m-1")
	s.writeMemberFile("m-2")
	if got := s.readMemberFile(); got != "m-2" {
		t.Fatalf("after two joins the file holds %q, want m-2", got)
	}
	none := &Source{log: zap.NewNop()}
	none.writeMemberFile("m-3")
	if got := none.readMemberFile(); got != "" {
		t.Fatalf("no file configured: read %q", got)
	}
}

// TestRefusedStartNotHeldByStaleRemoval: a start whose join is refused
// (no ACL for the group) returns its error at once, not after the removal
// of the previous run's member, retrying meanwhile, has run out its
// deadline (the session timeout, 90 s here; the test gives Run 30 s).
func TestRefusedStartNotHeldByStaleRemoval(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"), kfake.EnableSASL(), kfake.EnableACLs(),
		kfake.Superuser("PLAIN", "admin", "admin"),
		kfake.User("PLAIN", "reader", "pw",
			kfake.ACL{Resource: kmsg.ACLResourceTypeTopic, Name: "delay", Pattern: kmsg.ACLResourcePatternTypeLiteral, Operation: kmsg.ACLOperationAll, Allow: true},
		))
	mech, err := SASLMechanism("PLAIN", "reader", "pw")
	if err != nil {
		t.Fatal(err)
	}
	// The removal's reads of the group fail (connections dropped), so it
	// is still retrying when the join is refused.
	c.ControlKey(kmsg.DescribeGroups.Int16(), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		return nil, errors.New("dropped"), true
	})
	cfg := testConfig(t, c.ListenAddrs(), "forbidden", "delay")
	cfg.SASL = mech
	cfg.SessionTimeout, cfg.RebalanceTimeout = 90*time.Second, 90*time.Second
	cfg.MemberFile = filepath.Join(t.TempDir(), "kafka-member")
	if err := os.WriteFile(cfg.MemberFile, []byte("delaybridge-old\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	src, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := src.Run(ctx, newMemHandler()); !errors.Is(err, ErrAuth) {
		t.Fatalf("Run = %v, want ErrAuth", err)
	}
	if ctx.Err() != nil {
		t.Fatal("Run returned only when its context ended: held by the removal of the old member")
	}
}

// TestStaleRemovalWaitsWhenLeaveRefused: a LeaveGroup the coordinator
// refuses as a whole (NOT_COORDINATOR while the coordinator moves after a
// broker restart, say) reads as a success in kafka-go, whose decoding of
// the response loses its error code; the member is then still there when
// the group is read back. The removal must wait between such tries, not
// send LeaveGroup and DescribeGroups back to back until the session runs
// out.
func TestStaleRemovalWaitsWhenLeaveRefused(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	var refuseLeave atomic.Bool
	var leaves atomic.Int32
	c.ControlKey(kmsg.LeaveGroup.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if !refuseLeave.Load() {
			return nil, nil, false
		}
		leaves.Add(1)
		resp := req.(*kmsg.LeaveGroupRequest).ResponseKind().(*kmsg.LeaveGroupResponse)
		resp.ErrorCode = kerr.NotCoordinator.Code
		return resp, nil, true
	})
	cfg := testConfig(t, c.ListenAddrs(), "g-refused-leave", "delay")
	cfg.SessionTimeout, cfg.RebalanceTimeout = 90*time.Second, 90*time.Second
	cfg.RetryMin, cfg.RetryMax = 100*time.Millisecond, time.Second
	cfg.MemberFile = filepath.Join(t.TempDir(), "kafka-member")
	first, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop := runSource(t, first, newMemHandler())
	waitFor(t, "the first run joined", func() bool { return first.readMemberFile() != "" })
	refuseLeave.Store(true)
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	member := first.readMemberFile()
	if gi := c.GroupInfo("g-refused-leave"); gi == nil || len(gi.Members) != 1 {
		t.Fatalf("the first run's member should still be in the group: %+v", gi)
	}
	leaves.Store(0)

	second, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	second.removeStaleMember(ctx, member, "test")
	// Waiting 100 ms, 200 ms, 400 ms, 800 ms between tries: 5 or so.
	if n := leaves.Load(); n > 20 {
		t.Fatalf("%d LeaveGroup requests in 2 s: the removal does not wait after a refused leave", n)
	}
}
