package service

import (
	"context"
	"fmt"
	"runtime"
	"sort"
	"sync/atomic"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"

	"github.com/delaybridge/delaybridge/bridge/nats"
	"github.com/delaybridge/delaybridge/internal/natstest"
	"github.com/delaybridge/delaybridge/internal/testlog"
)

// A NATS cluster through long quorum losses (long form only, through
// longNATSCluster): tasks held on disk, the whole cluster down, the bridge
// restarted meanwhile, a dead-letter stream without a server.

// publishTasks publishes n tasks to delay.x, each due at dueOf(i), with
// Nats-Msg-Id so a retried publish is stored once.
func publishTasks(t *testing.T, js jetstream.JetStream, prefix string, n int, dueOf func(i int) time.Time, target string) {
	t.Helper()
	for i := range n {
		id := fmt.Sprintf("%s%05d", prefix, i)
		m := delayMsg(id, target)
		m.Header.Set("delay-at", fmt.Sprint(dueOf(i).UnixMilli()))
		for attempt := 0; ; attempt++ {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			_, err := js.PublishMsgAsync(m)
			if err == nil && (i%200 == 199 || i == n-1) {
				select {
				case <-js.PublishAsyncComplete():
				case <-ctx.Done():
					err = ctx.Err()
				}
			}
			cancel()
			if err == nil {
				break
			}
			if attempt > 100 {
				t.Fatalf("publish %s: %v", id, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
}

// delayMsg is a message to delay.x for target with id as its payload,
// delay-id and Nats-Msg-Id (a retried publish is stored once) and one
// header of its own; the caller adds the due header.
func delayMsg(id, target string) *natsgo.Msg {
	m := natsgo.NewMsg("delay.x")
	m.Data = []byte(id)
	m.Header.Set("delay-target", target)
	m.Header.Set("delay-id", id)
	m.Header.Set("Nats-Msg-Id", id)
	m.Header.Set("x-h", "v")
	return m
}

// publishStored publishes m until JetStream stores it, at most attempts
// more times after the first, 50 ms apart.
func publishStored(js jetstream.JetStream, m *natsgo.Msg, attempts int) error {
	for attempt := 0; ; attempt++ {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_, err := js.PublishMsg(ctx, m)
		cancel()
		if err == nil {
			return nil
		}
		if attempt >= attempts {
			return fmt.Errorf("publish %s: %w", m.Data, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

type storedMsg struct {
	data    string
	stamp   time.Time
	headers natsgo.Header
}

// readStream reads every message of stream (limits retention) once it has
// at least want messages (or the deadline passes).
func readStream(t *testing.T, js jetstream.JetStream, stream string) []storedMsg {
	t.Helper()
	// A cluster just back from a quorum loss may still answer 503 for a
	// while: the whole read is tried again until the deadline.
	deadline := time.Now().Add(60 * time.Second)
	for {
		out, err := readStreamOnce(js, stream)
		if err == nil {
			return out
		}
		if time.Now().After(deadline) {
			t.Fatalf("read stream %s: %v", stream, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func readStreamOnce(js jetstream.JetStream, stream string) ([]storedMsg, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return nil, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return nil, err
	}
	total := info.State.Msgs
	if total == 0 {
		return nil, nil
	}
	oc, err := js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{})
	if err != nil {
		return nil, err
	}
	var out []storedMsg
	for uint64(len(out)) < total {
		batch, err := oc.Fetch(500, jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			return nil, fmt.Errorf("fetch: %w", err)
		}
		for m := range batch.Messages() {
			md, _ := m.Metadata()
			out = append(out, storedMsg{data: string(m.Data()), stamp: md.Timestamp, headers: m.Headers()})
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("read %d of %d: %w", len(out), total, ctx.Err())
		}
	}
	return out, nil
}

func streamMsgs(js jetstream.JetStream, stream string) (uint64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return 0, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return 0, err
	}
	return info.State.Msgs, nil
}

func within(t *testing.T, what string, d time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out (%s) waiting for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// outageRetry: short retries, and at most 100 waiting tasks in memory, so
// an outage holds the rest on disk.
const outageRetry = "retry: {initial: 200ms, max: 2s, multiplier: 2, jitter: 0.1, max_attempts: 3, waiting_in_memory: 100}"

// outageStreams are the R3 target and DLQ streams, with the default
// duplicate window (2 min). A publish that got no PubAck during the quorum
// loss is not proof that it was not stored: a stream leader that lost its
// quorum goes on taking proposals for a while and commits them once the
// quorum is back, so every publish attempt of the outage may be stored
// (sends in flight at a failure, which the contract allows). The bridge's
// Nats-Msg-Id (SOURCE|id|due) lets the window drop those copies, as in
// production; with a 100 ms window about half the tasks of a 40 s loss
// arrived two or three times.
func outageStreams() []jetstream.StreamConfig {
	return []jetstream.StreamConfig{
		{Name: "ORDERS", Subjects: []string{"orders.>"}, Replicas: 3},
		{Name: "DLQ", Subjects: []string{"dlq.>"}, Replicas: 3},
	}
}

func checkDelivered(t *testing.T, msgs []storedMsg, prefix string, n int, dupLimit int) {
	t.Helper()
	count := map[string]int{}
	for _, m := range msgs {
		count[m.data]++
		if m.headers.Get("delay-id") == "" || m.headers.Get("delay-due") == "" || m.headers.Get("delay-origin") == "" || m.headers.Get("x-h") != "v" {
			t.Errorf("%s: headers %v", m.data, m.headers)
		}
		if m.headers.Get("delay-at") != "" || m.headers.Get("delay-target") != "" {
			t.Errorf("%s: control headers %v", m.data, m.headers)
		}
	}
	var missing, dups []string
	for i := range n {
		id := fmt.Sprintf("%s%05d", prefix, i)
		switch k := count[id]; {
		case k == 0:
			missing = append(missing, id)
		case k > 1:
			dups = append(dups, fmt.Sprintf("%s x%d", id, k))
		}
	}
	sort.Strings(dups)
	t.Logf("%d messages, %d distinct, %d missing, %d duplicates %v", len(msgs), len(count), len(missing), len(dups), dups)
	if len(missing) > 0 {
		t.Errorf("%d tasks lost: %v", len(missing), missing[:min(20, len(missing))])
	}
	if len(dups) > dupLimit {
		t.Errorf("%d duplicates, more than the %d in flight allowed", len(dups), dupLimit)
	}
}

func runOnCluster(t *testing.T, c *natstest.Cluster, extra string) (*Service, context.CancelFunc, <-chan error, string) {
	return runOnClusterServer(t, c, 0, extra)
}

func runOnClusterServer(t *testing.T, c *natstest.Cluster, server int, extra string) (*Service, context.CancelFunc, <-chan error, string) {
	yml := clusterYAML(t, c.URL(server), extra)
	svc, cancel, done := runYAML(t, yml, Options{Logger: testlog.New(t, zaptest.Level(zapcore.WarnLevel)),
		NATS: func(c *nats.Config) { fastNATS(c); c.PublishTimeout = 3 * time.Second; c.AckWait = 3 * time.Second }})
	return svc, cancel, done, yml
}

func heapMB() float64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return float64(ms.HeapAlloc) / (1 << 20)
}

// TestNATSQuorumLossHeld: the target (and delay) streams lose their
// quorum for 40 s while 4000 tasks come due, with waiting_in_memory 100:
// the tasks are held on disk, none is dead-lettered, the bridge is not
// ready meanwhile, and all are delivered once, within a few retry.max of
// the quorum's return.
func TestNATSQuorumLossHeld(t *testing.T) {
	c, _, js := longNATSCluster(t, outageStreams()...)
	svc, _, done, _ := runOnCluster(t, c, outageRetry)
	alive := exitWatch(t, done)
	within(t, "ready", 60*time.Second, func() bool { alive(); return svc.Ready() == nil })
	const n = 4000
	t0 := time.Now().Add(8 * time.Second)
	publishTasks(t, js, "q", n, func(i int) time.Time { return t0.Add(time.Duration(i) * 25 * time.Millisecond / 4) }, "orders.out")
	within(t, "ingested", 30*time.Second, func() bool { alive(); return svc.Engine().Stats().Pending >= n })
	if time.Now().After(t0) {
		t.Fatalf("ingest too slow: %v past t0", time.Since(t0))
	}
	t.Logf("bridge on server %d; ORDERS leader %d; DELAY leader %d", c.ServerOf("delaybridge"), c.StreamLeader("ORDERS"), c.StreamLeader("DELAY"))
	h0 := heapMB()
	c.Stop(1)
	c.Stop(2)
	stopped := time.Now()
	within(t, "not ready", 30*time.Second, func() bool { alive(); return svc.Ready() != nil })
	var maxHeld int64
	var maxHeap float64
	for time.Since(stopped) < 40*time.Second {
		alive()
		st := svc.Engine().Stats()
		maxHeld = max(maxHeld, st.Held)
		if time.Since(stopped) > 12*time.Second && svc.Ready() == nil {
			t.Errorf("ready at %v into the quorum loss", time.Since(stopped))
		}
		time.Sleep(500 * time.Millisecond)
	}
	maxHeap = heapMB()
	st := svc.Engine().Stats()
	t.Logf("before restart: pending %d held %d maxHeld %d; heap %.1f MB -> %.1f MB; ready=%v", st.Pending, st.Held, maxHeld, h0, maxHeap, svc.Ready())
	if n-st.Pending > 10 {
		t.Errorf("%d delivered during the quorum loss?", n-st.Pending)
	}
	c.Start(1)
	c.Start(2)
	back := time.Now()
	within(t, "ORDERS leader", 60*time.Second, func() bool { return c.StreamLeader("ORDERS") >= 0 })
	leader := time.Now()
	t.Logf("ORDERS leader after %v", leader.Sub(back))
	within(t, "all delivered", 60*time.Second, func() bool {
		alive()
		k, err := streamMsgs(js, "ORDERS")
		return err == nil && k >= n
	})
	all := time.Now()
	t.Logf("all delivered %v after the restart, %v after the ORDERS leader", all.Sub(back), all.Sub(leader))
	within(t, "nothing pending", 30*time.Second, func() bool { st := svc.Engine().Stats(); return st.Pending == 0 && st.Held == 0 })
	within(t, "ready", 30*time.Second, func() bool { alive(); return svc.Ready() == nil })
	msgs := readStream(t, js, "ORDERS")
	checkDelivered(t, msgs, "q", n, 50)
	var last time.Time
	for _, m := range msgs {
		if m.stamp.After(last) {
			last = m.stamp
		}
	}
	t.Logf("last stored %v after ORDERS leader", last.Sub(leader))
	if d := all.Sub(leader); d > 10*time.Second {
		t.Errorf("delivery took %v after the quorum returned (retry.max 2s)", d)
	}
	if dl, _ := streamMsgs(js, "DLQ"); dl != 0 {
		t.Errorf("%d dead letters", dl)
	}
	if maxHeld == 0 {
		t.Errorf("nothing held")
	}
}

// publishStream publishes n tasks in the background, each due dueAfter after
// it is sent, pausing gap between them; publishes retry until stored.
func publishStream(t *testing.T, js jetstream.JetStream, prefix string, n int, dueAfter, gap time.Duration, target string) (published func() int, wait func()) {
	var count atomic.Int64
	done := make(chan error, 1)
	go func() {
		for i := range n {
			m := delayMsg(fmt.Sprintf("%s%05d", prefix, i), target)
			m.Header.Set("delay-at", fmt.Sprint(time.Now().Add(dueAfter).UnixMilli()))
			if err := publishStored(js, m, 1000); err != nil {
				done <- err
				return
			}
			count.Add(1)
			time.Sleep(gap)
		}
		done <- nil
	}()
	return func() int { return int(count.Load()) }, func() {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
}

// TestNATSWholeClusterDown: the whole cluster is stopped for 30 s while
// tasks are published, ingested and come due, and started again with its
// data: every task delivered once, none taken in twice, not ready while
// it is down.
func TestNATSWholeClusterDown(t *testing.T) {
	c, _, js := longNATSCluster(t, outageStreams()...)
	svc, _, done, _ := runOnCluster(t, c, outageRetry)
	alive := exitWatch(t, done)
	within(t, "ready", 60*time.Second, func() bool { alive(); return svc.Ready() == nil })
	const n = 3000
	published, wait := publishStream(t, js, "w", n, 3*time.Second, 3*time.Millisecond, "orders.out")
	within(t, "a third published", 60*time.Second, func() bool { alive(); return published() > n/3 })
	st := svc.Engine().Stats()
	t.Logf("stopping all: published %d pending %d", published(), st.Pending)
	c.Stop(0)
	c.Stop(1)
	c.Stop(2)
	within(t, "not ready", 30*time.Second, func() bool { alive(); return svc.Ready() != nil })
	for end := time.Now().Add(30 * time.Second); time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		alive()
		if svc.Ready() == nil {
			t.Fatal("ready with the whole cluster down")
		}
	}
	st = svc.Engine().Stats()
	t.Logf("before start: pending %d held %d", st.Pending, st.Held)
	c.Start(0)
	c.Start(1)
	c.Start(2)
	back := time.Now()
	wait()
	awaitAllDelivered(t, js, svc, alive, n, back)
	checkOutage(t, js, "w", n, 5*time.Second) // let any late re-ingestion show
}

// TestNATSRestartDuringQuorumLoss: the bridge is restarted (the SIGTERM
// way) during a quorum loss with tasks held on disk: the held tasks survive
// the restart and are all delivered once the quorum is back.
func TestNATSRestartDuringQuorumLoss(t *testing.T) {
	c, _, js := longNATSCluster(t, outageStreams()...)
	svc, cancel, done, yml := runOnCluster(t, c, outageRetry)
	within(t, "ready", 60*time.Second, func() bool { return svc.Ready() == nil })
	const n = 3000
	t0 := time.Now().Add(8 * time.Second)
	publishTasks(t, js, "r", n, func(i int) time.Time { return t0.Add(time.Duration(i) * 5 * time.Millisecond) }, "orders.out")
	within(t, "ingested", 30*time.Second, func() bool { return svc.Engine().Stats().Pending >= n })
	c.Stop(1)
	c.Stop(2)
	within(t, "most held", 60*time.Second, func() bool { return svc.Engine().Stats().Held >= n-2*100-50 }) // 100 a shard wait in memory
	time.Sleep(3 * time.Second)
	st := svc.Engine().Stats()
	t.Logf("stopping the bridge: pending %d held %d", st.Pending, st.Held)
	cancel()
	select {
	case err := <-done:
		t.Logf("bridge stopped: %v", err)
	case <-time.After(40 * time.Second):
		t.Fatal("bridge did not stop")
	}
	svc2, _, done2 := runYAML(t, yml, Options{Logger: testlog.New(t, zaptest.Level(zapcore.WarnLevel)),
		NATS: func(c *nats.Config) { fastNATS(c); c.PublishTimeout = 3 * time.Second; c.AckWait = 3 * time.Second }})
	alive := exitWatch(t, done2)
	st = svc2.Engine().Stats()
	t.Logf("restarted: pending %d held %d", st.Pending, st.Held)
	for end := time.Now().Add(10 * time.Second); time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		alive()
		if svc2.Ready() == nil {
			t.Fatal("ready with no quorum")
		}
	}
	st = svc2.Engine().Stats()
	t.Logf("after 10s: pending %d held %d, ready: %v", st.Pending, st.Held, svc2.Ready())
	c.Start(1)
	c.Start(2)
	back := time.Now()
	awaitAllDelivered(t, js, svc2, alive, n, back)
	checkOutage(t, js, "r", n, 3*time.Second)
}

// TestNATSDLQWithoutQuorum: the DLQ stream (R1) has no server while bad
// messages arrive among good ones: the bad ones are not acked and the
// bridge is not ready (CONTRACT §3), then each reaches the DLQ once, and
// every good one is delivered once.
func TestNATSDLQWithoutQuorum(t *testing.T) {
	c, _, js := longNATSCluster(t, jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.>"}, Replicas: 3, Duplicates: 100 * time.Millisecond})
	// An R1 DLQ; the bridge on another server.
	{
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "DLQ", Subjects: []string{"dlq.>"}, Replicas: 1, Duplicates: 100 * time.Millisecond})
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		within(t, "DLQ leader", 10*time.Second, func() bool { return c.StreamLeader("DLQ") >= 0 })
	}
	dlqServer := c.StreamLeader("DLQ")
	svc, _, done, _ := runOnClusterServer(t, c, (dlqServer+1)%3, outageRetry)
	alive := exitWatch(t, done)
	within(t, "ready", 60*time.Second, func() bool { alive(); return svc.Ready() == nil })
	t.Logf("DLQ on %d, bridge on %d", dlqServer, c.ServerOf("delaybridge"))
	c.Stop(dlqServer)
	pub := func(id string, bad bool) {
		m := delayMsg(id, "orders.out")
		if !bad {
			m.Header.Set("delay-after", "1s")
		}
		if err := publishStored(js, m, 100); err != nil {
			t.Fatal(err)
		}
	}
	const n = 600
	var bads []string
	for i := range n {
		id := fmt.Sprintf("g%05d", i)
		bad := i%100 == 7
		if bad {
			id = fmt.Sprintf("b%05d", i)
			bads = append(bads, id)
		}
		pub(id, bad)
	}
	within(t, "not ready", 30*time.Second, func() bool { alive(); return svc.Ready() != nil })
	t.Logf("not ready: %v", svc.Ready())
	for end := time.Now().Add(25 * time.Second); time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		alive()
		if svc.Ready() == nil {
			t.Fatal("ready while the DLQ cannot be written")
		}
	}
	// The first bad message must not be acked: the DELAY work queue still has it.
	ctx, cc := context.WithTimeout(context.Background(), 5*time.Second)
	s, err := js.Stream(ctx, "DELAY")
	cc()
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("DELAY during DLQ outage: %d msgs, first seq %d; pending %d", info.State.Msgs, info.State.FirstSeq, svc.Engine().Stats().Pending)
	if info.State.Msgs == 0 || info.State.FirstSeq > 8+1 {
		t.Errorf("the bad message (seq 8) was acked before its DLQ took it: DELAY %+v", info.State)
	}
	c.Start(dlqServer)
	back := time.Now()
	within(t, "all delivered", 90*time.Second, func() bool {
		alive()
		k, err := streamMsgs(js, "ORDERS")
		d, err2 := streamMsgs(js, "DLQ")
		return err == nil && err2 == nil && int(k) >= n-len(bads) && int(d) >= len(bads)
	})
	t.Logf("all delivered %v after the start", time.Since(back))
	within(t, "ready", 30*time.Second, func() bool { alive(); return svc.Ready() == nil })
	time.Sleep(3 * time.Second)
	got := readStream(t, js, "ORDERS")
	count := map[string]int{}
	for _, m := range got {
		count[m.data]++
	}
	for i := range n {
		id := fmt.Sprintf("g%05d", i)
		if i%100 == 7 {
			continue
		}
		if count[id] != 1 {
			t.Errorf("%s delivered %d times", id, count[id])
		}
	}
	dl := readStream(t, js, "DLQ")
	dcount := map[string]int{}
	for _, m := range dl {
		dcount[m.data]++
		if m.headers.Get("delay-error") != "missing-due" || m.headers.Get("delay-origin") == "" {
			t.Errorf("dead letter %s headers %v", m.data, m.headers)
		}
	}
	for _, b := range bads {
		if dcount[b] != 1 {
			t.Errorf("dead letter %s: %d copies", b, dcount[b])
		}
	}
	t.Logf("%d dead letters %v", len(dl), dcount)
}

// TestNATSRestartedBridgeAfterQuorum: a bridge restarted during a quorum
// loss delivers its held tasks soon after the quorum is back (README:
// "delivered after the outage, at most retry.max late"). They were 10-30 s
// late: the connect backoff doubled to 30 s whatever retry.max said, and
// the publisher waited for the delay stream's consumer to be set up.
// Measured from the end of the catch-up pause: the source's consumer
// set-up is measured on its own (bridge/nats TestSetupDuringQuorumLoss:
// it waited out a request sent before the quorum was back, up to 12 s
// after it, before its requests were sent again while unanswered).
func TestNATSRestartedBridgeAfterQuorum(t *testing.T) {
	c, _, js := longNATSCluster(t, outageStreams()...)
	svc, cancel, done, yml := runOnCluster(t, c, outageRetry)
	within(t, "ready", 60*time.Second, func() bool { return svc.Ready() == nil })
	const n = 500
	t0 := time.Now().Add(10 * time.Second)
	publishTasks(t, js, "l", n, func(i int) time.Time { return t0.Add(time.Duration(i) * time.Millisecond) }, "orders.out")
	within(t, "ingested", 30*time.Second, func() bool { return svc.Engine().Stats().Pending >= n })
	c.Stop(1)
	c.Stop(2)
	within(t, "held", 60*time.Second, func() bool {
		st := svc.Engine().Stats()
		if time.Now().After(t0.Add(30 * time.Second)) {
			t.Logf("pending %d held %d ready %v", st.Pending, st.Held, svc.Ready())
		}
		return st.Held >= n-2*100-50 // 100 a shard wait in memory
	})
	cancel()
	<-done
	svc2, _, done2 := runYAML(t, yml, Options{Logger: testlog.New(t, zaptest.Level(zapcore.WarnLevel)),
		NATS: func(c *nats.Config) { fastNATS(c); c.PublishTimeout = 3 * time.Second; c.AckWait = 3 * time.Second }})
	restarted := time.Now()
	// The quorum comes back 17 s after the restart.
	for time.Since(restarted) < 17*time.Second {
		select {
		case err := <-done2:
			t.Fatalf("bridge exited: %v", err)
		default:
		}
		time.Sleep(100 * time.Millisecond)
	}
	c.Start(1)
	c.Start(2)
	within(t, "stream leaders", 60*time.Second, func() bool { return c.StreamLeader("DELAY") >= 0 && c.StreamLeader("ORDERS") >= 0 })
	c.WaitMeta()
	back := time.Now()
	t.Logf("stream and meta leaders back at %s", back.UTC().Format(time.RFC3339Nano))
	// Firing waits at start until the source has read its backlog (the
	// catch-up pause), and the source's consumer set-up may have sent a
	// request before the quorum was back that no server answers: it is
	// sent again every 2 s (min(connect_timeout, 2s)) while unanswered.
	// That part is the source's; what is measured here is the held
	// tasks' release.
	within(t, "firing resumed", 60*time.Second, func() bool { return !svc2.Engine().FiringPaused() })
	resumed := time.Now()
	within(t, "all delivered", 90*time.Second, func() bool {
		st := svc2.Engine().Stats()
		return st.Pending == 0 && st.Held == 0
	})
	late := time.Since(resumed)
	t.Logf("firing resumed %v after the quorum was back, all delivered %v after that (retry.max 2s); ready: %v", resumed.Sub(back), late, svc2.Ready())
	if late > 8*time.Second {
		t.Errorf("the held tasks were delivered %v after firing resumed; retry.max is 2s", late)
	}
	// A publish retried while the first one waits for the quorum is
	// answered "duplicate message id is in process": an outage, not an
	// attempt (charged, it dead-lettered most tasks as publish-failed).
	checkOutage(t, js, "l", n, 0)
}

// awaitAllDelivered waits until the ORDERS stream holds n messages, then
// until nothing is pending or held and the bridge is ready again.
func awaitAllDelivered(t *testing.T, js jetstream.JetStream, svc *Service, alive func(), n int, back time.Time) {
	t.Helper()
	within(t, "all delivered", 90*time.Second, func() bool {
		alive()
		k, err := streamMsgs(js, "ORDERS")
		return err == nil && k >= uint64(n)
	})
	t.Logf("all delivered %v after the start", time.Since(back))
	within(t, "nothing pending", 30*time.Second, func() bool { st := svc.Engine().Stats(); return st.Pending == 0 && st.Held == 0 })
	within(t, "ready", 30*time.Second, func() bool { alive(); return svc.Ready() == nil })
}

// checkOutage waits settle, then checks that ORDERS holds every task of
// prefix once (at most 50 duplicates: sends in flight at the faults) and
// that nothing was dead-lettered: an outage charges no attempt.
func checkOutage(t *testing.T, js jetstream.JetStream, prefix string, n int, settle time.Duration) {
	t.Helper()
	time.Sleep(settle)
	checkDelivered(t, readStream(t, js, "ORDERS"), prefix, n, 50)
	if dl, _ := streamMsgs(js, "DLQ"); dl != 0 {
		t.Errorf("%d dead letters", dl)
	}
}
