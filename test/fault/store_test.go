package fault

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/shard"
)

// errNoSpace is what the injected store fault returns: a full disk.
var errNoSpace = fmt.Errorf("fault test: %w", syscall.ENOSPC)

// TestStoreWriteErrors makes the store's WAL writes and syncs fail with
// ENOSPC while messages arrive on both transports. Ingest must fail, the
// sources must not commit or ack what they could not store, Ready must say
// not-ready, and nothing may be lost: the store error is sticky by design
// (after a failed fsync the engine refuses writes until reopened), so the
// recovery path is a restart on the same data dir once the disk has room,
// which must deliver everything published during the fault.
func TestStoreWriteErrors(t *testing.T) {
	t.Parallel()
	b := newBrokers(t, 0)
	col := b.collect(t)
	var injected atomic.Int64
	toggle := &errorfs.Toggle{Injector: errorfs.InjectorFunc(func(op errorfs.Op) error {
		if !strings.HasSuffix(op.Path, ".log") {
			return nil
		}
		switch op.Kind {
		case errorfs.OpFileWrite, errorfs.OpFileWriteAt, errorfs.OpFileSync, errorfs.OpFileSyncData, errorfs.OpFileSyncTo:
			injected.Add(1)
			return errNoSpace
		}
		return nil
	})}
	ip := newInproc(t, b, nil, errorfs.Wrap(vfs.Default, toggle))
	pub := newPublisher(t, b)
	delays := func(i int) []string { return []string{codec.HeaderAfter, strconv.Itoa(i % 300)} }

	run := ip.start()
	before := pub.send("before", 30, delays)
	waitDelivered(t, col, before, "before the fault")

	toggle.On()
	during := pub.send("during", 50, delays)
	kafkaFirst, natsFirst := pub.kafkaMin, pub.natsMin
	var readyErr error
	if !waitFor(time.Minute, func() bool { readyErr = run.svc.Ready(); return readyErr != nil }) {
		t.Fatalf("Ready() stayed nil for a minute with every WAL write failing (%d faults injected): "+
			"is Options.FS passed to the store?", injected.Load())
	}
	t.Logf("not ready during the fault (%d faults injected): %v", injected.Load(), readyErr)
	if !errors.Is(readyErr, shard.ErrStoreFailed) {
		t.Errorf("Ready() = %v, want it to wrap shard.ErrStoreFailed", readyErr)
	}
	// The store refuses writes until reopened, so liveness fails too: the
	// supervisor restarts the process, which resumes once the fault is gone.
	if err := run.svc.Live(); !errors.Is(err, shard.ErrStoreFailed) {
		t.Errorf("Live() = %v during a sticky store failure, want it to wrap shard.ErrStoreFailed", err)
	}
	// The sources retry the failing batch; give them time to (wrongly)
	// commit or ack it, then check they did not.
	time.Sleep(2 * time.Second)
	for p, off := range committedKafka(t, pub.kcl) {
		if first, ok := kafkaFirst[p]; ok && off > first {
			t.Errorf("kafka partition %d committed offset %d, past %d, the first message published during the store fault", p, off, first)
		}
	}
	if floor := natsAckFloor(t, pub); floor >= natsFirst {
		t.Errorf("nats consumer ack floor %d reaches %d, the first message published during the store fault", floor, natsFirst)
	}
	if lost, _ := lostAndDups(col, during); len(lost) < len(during) {
		t.Logf("%d messages of the fault were delivered before the store failed", len(during)-len(lost))
	}
	if run.exited() {
		t.Logf("the bridge stopped on the store error: %v", run.err)
	}

	// The operator frees space and restarts the process on the same data dir.
	err := run.stop()
	t.Logf("first process stopped: %v", err)
	toggle.Off()
	ip.fs = nil
	run2 := ip.start()
	after := pub.send("after", 30, delays)
	all := append(append(append([]string{}, before...), during...), after...)
	waitDelivered(t, col, all, "after the restart")
	if err := run2.svc.Live(); err != nil {
		t.Errorf("Live() after the restart = %v, want nil", err)
	}
	if err := run2.svc.Ready(); err != nil {
		t.Errorf("not ready after the restart: %v", err)
	}
	lost, dups := lostAndDups(col, all)
	t.Logf("sent %d, lost %d, duplicates %d", len(all), len(lost), dups)
	if err := run2.stop(); err != nil {
		t.Errorf("second process: %v", err)
	}
}

// committedKafka reads the bridge group's committed offsets of the delay
// topic.
func committedKafka(t *testing.T, cl *kgo.Client) map[int32]int64 {
	t.Helper()
	req := kmsg.NewPtrOffsetFetchRequest()
	req.Group = "bridge"
	rt := kmsg.NewOffsetFetchRequestTopic()
	rt.Topic = kafkaDelay
	rt.Partitions = []int32{0, 1, 2}
	req.Topics = append(req.Topics, rt)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		t.Fatalf("offset fetch: %v", err)
	}
	out := map[int32]int64{}
	for _, tp := range resp.Topics {
		for _, p := range tp.Partitions {
			out[p.Partition] = p.Offset
		}
	}
	for _, g := range resp.Groups {
		for _, tp := range g.Topics {
			for _, p := range tp.Partitions {
				out[p.Partition] = p.Offset
			}
		}
	}
	return out
}

// natsAckFloor is the stream sequence below which the bridge's durable
// consumer has acknowledged everything.
func natsAckFloor(t *testing.T, p *publisher) uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := p.js.Consumer(ctx, natsStream, "bridge")
	if err != nil {
		t.Fatalf("consumer: %v", err)
	}
	info, err := c.Info(ctx)
	if err != nil {
		t.Fatalf("consumer info: %v", err)
	}
	return info.AckFloor.Stream
}

// describeGroup reports the bridge's consumer group as the broker sees it:
// state, generation and each member's assigned partitions.
func describeGroup(t *testing.T, b *brokers) string {
	cl := b.kafkaClient()
	defer cl.Close()
	req := kmsg.NewPtrDescribeGroupsRequest()
	req.Groups = []string{"bridge"}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return "describe groups: " + err.Error()
	}
	var sb strings.Builder
	for _, g := range resp.Groups {
		fmt.Fprintf(&sb, "state %s protocol %s, %d members:", g.State, g.Protocol, len(g.Members))
		for _, m := range g.Members {
			var a kmsg.ConsumerMemberAssignment
			parts := "?"
			if err := a.ReadFrom(m.MemberAssignment); err == nil {
				parts = fmt.Sprint(a.Topics)
			}
			fmt.Fprintf(&sb, " [%s client %s host %s assigned %s]", m.MemberID, m.ClientID, m.ClientHost, parts)
		}
	}
	return sb.String()
}
