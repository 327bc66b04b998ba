package fault

import (
	"context"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/delaybridge/delaybridge/codec"
)

// load publishes uniquely numbered messages to the Kafka delay topic and
// the NATS delay subjects until stopped, with delays of 0-2 s and targets
// on both transports (half of them crossing). A message counts as sent
// only when the broker acknowledged it.
type load struct {
	b     *brokers
	mu    sync.Mutex
	sent  map[string]bool
	fails atomic.Int64 // publishes the broker did not acknowledge (outages)
	stop  context.CancelFunc
	wg    sync.WaitGroup
	pace  time.Duration
}

func startLoad(t *testing.T, b *brokers, pace time.Duration) *load {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	l := &load{b: b, sent: map[string]bool{}, stop: cancel, pace: pace}
	kcl := b.kafkaClient(kgo.MaxBufferedRecords(2000))
	nc := b.natsConn()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	l.wg.Go(func() {
		rng := rand.New(rand.NewPCG(1, 1))
		var inflight sync.WaitGroup
		for i := 0; ctx.Err() == nil; i++ {
			v := "k" + strconv.Itoa(i)
			target := kafkaTarget
			if i%2 == 1 {
				target = "nats:orders.fromkafka"
			}
			r := kafkaRecord(int32(i%3), []byte(v), []byte(v), hdr(
				codec.HeaderAfter, strconv.Itoa(rng.IntN(2001)), codec.HeaderTarget, target))
			inflight.Add(1)
			kcl.Produce(context.Background(), r, func(_ *kgo.Record, err error) {
				defer inflight.Done()
				if err != nil {
					l.fails.Add(1)
					return
				}
				l.mark(v)
			})
			sleepCtx(ctx, l.pace)
		}
		inflight.Wait()
		kcl.Close()
	})
	l.wg.Go(func() {
		rng := rand.New(rand.NewPCG(2, 2))
		for i := 0; ctx.Err() == nil; i++ {
			v := "n" + strconv.Itoa(i)
			target := "orders.fromnats"
			if i%2 == 1 {
				target = "kafka:" + kafkaTarget
			}
			m := natsMsg("delay.load", []byte(v), hdr(
				codec.HeaderAfter, strconv.Itoa(rng.IntN(2001))+"ms", codec.HeaderTarget, target, codec.HeaderNatsMsgID, v))
			pctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			_, err := js.PublishMsg(pctx, m, jetstream.WithRetryAttempts(0))
			cancel()
			if err != nil {
				l.fails.Add(1)
			} else {
				l.mark(v)
			}
			sleepCtx(ctx, l.pace)
		}
		nc.Close()
	})
	return l
}

func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

func (l *load) mark(v string) {
	l.mu.Lock()
	l.sent[v] = true
	l.mu.Unlock()
}

// finish stops publishing and returns the acknowledged messages.
func (l *load) finish() map[string]bool {
	l.stop()
	l.wg.Wait()
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.sent
}

// tally compares what was sent with what reached the targets.
type tally struct {
	sent, delivered, duplicates, lost, unsent int
}

func count(sent map[string]bool, got map[string][]delivery) tally {
	var t tally
	t.sent = len(sent)
	for v, ds := range got {
		if !sent[v] {
			t.unsent++ // published, but the publisher saw an error (ambiguous during an outage)
		}
		t.delivered++
		t.duplicates += len(ds) - 1
	}
	for v := range sent {
		if len(got[v]) == 0 {
			t.lost++
		}
	}
	return t
}

// drainWait is how long the end of a test waits for the backlog to reach
// the targets. It covers the broker-side timeouts a kill -9 leaves behind:
// the JetStream ack wait of messages delivered to the dead process (30 s)
// and the Kafka group session of each dead member (30 s, sessionExpiry
// stands in where kfake does not expire one; after many kills in a row the
// group needs several rebalances to shed them all).
var drainWait = map[bool]time.Duration{false: 3 * time.Minute, true: 8 * time.Minute}[long()]

// TestKill9UnderLoad SIGKILLs the bridge at random moments while messages
// keep arriving on both transports, restarts it each time, and checks at
// the end that every acknowledged message reached its target: none lost,
// duplicates only from deliveries in flight at a kill.
func TestKill9UnderLoad(t *testing.T) {
	t.Parallel()
	rounds := 3
	if long() {
		rounds = 20
	}
	const fireBatch, shards = 64, 4
	b := newBrokers(t, 0)
	col := b.collect(t)
	r := newRunner(t, b, bridgeConfig{fireBatch: fireBatch})
	l := startLoad(t, b, 4*time.Millisecond)
	p := killRounds(t, r, rounds, 500*time.Millisecond, 2500*time.Millisecond)
	checkDrained(t, b, l, col, rounds*shards*fireBatch*inFlightBatches, p)
}

// killRounds starts r's bridge rounds times and SIGKILLs each at a random
// moment between minWait and minWait+spread after its sources run (the
// load runs meanwhile), then starts one more and returns it, running.
func killRounds(t *testing.T, r *runner, rounds int, minWait, spread time.Duration) *proc {
	t.Helper()
	seed := uint64(time.Now().UnixNano())
	t.Logf("random seed %d (kill times are real time: a seed repeats the choices, not the run)", seed)
	rng := rand.New(rand.NewPCG(seed, 7))
	for round := range rounds {
		p := r.start()
		// Kill only once the sources run (the kill moment within the
		// load is random); readiness over HTTP is TestBrokerOutage's job.
		p.waitLog(90*time.Second, "delaybridge running")
		wait := minWait + time.Duration(rng.Int64N(int64(spread)))
		time.Sleep(wait) // real load runs meanwhile; the kill moment is random
		p.kill()
		t.Logf("round %d: killed %v after ready", round+1, wait)
	}
	p := r.start()
	p.waitLog(90*time.Second, "delaybridge running")
	return p
}

// inFlightBatches is how many fire batches of one shard a kill can find
// in flight: one per lane (a Kafka and a NATS target transport publish
// at once, or hold a delivered batch while they wait to queue its
// commit), up to 4 delivered batches queued whose delete is not yet
// synced (the engine's fire commit depth), and the one being synced. Each
// may be delivered again.
const inFlightBatches = 2 + 4 + 1

// checkDrained stops the load a second later, waits for every acknowledged
// message to reach its target, stops procs, and fails on a loss, on more
// than maxDups duplicates (what can be in flight at the kills) or on a
// good message dead-lettered.
func checkDrained(t *testing.T, b *brokers, l *load, col *collector, maxDups int, procs ...*proc) {
	t.Helper()
	time.Sleep(time.Second)
	sent := l.finish()
	var tl tally
	drainStart := time.Now()
	ok := waitFor(drainWait, func() bool {
		tl = count(sent, col.byValue(isTarget))
		return tl.lost == 0
	})
	drained := time.Since(drainStart)
	for _, p := range procs {
		if err := p.term(); err != nil {
			t.Errorf("bridge: %v", err)
		}
	}
	t.Logf("drained %v after the load stopped; sent %d (publisher errors %d), delivered %d unique, %d duplicates, %d lost, %d delivered whose publish reported an error",
		drained.Round(time.Millisecond), tl.sent, l.fails.Load(), tl.delivered, tl.duplicates, tl.lost, tl.unsent)
	if !ok || tl.lost > 0 {
		lostBy := map[string]int{}
		for v := range sent {
			if len(col.byValue(isTarget)[v]) == 0 {
				lostBy[v[:1]]++
			}
		}
		t.Logf("lost by source (k = Kafka, n = NATS): %v", lostBy)
		t.Logf("Kafka group at the end: %s", describeGroup(t, b))
		t.Fatalf("%d acknowledged messages not delivered within %v of the load stopping (lost, or stalled in the source)", tl.lost, drainWait)
	}
	if tl.duplicates > maxDups {
		t.Errorf("%d duplicates, more than the %d that can be in flight at the kills (shards x fire_batch each)", tl.duplicates, maxDups)
	}
	if dl := col.byValue(isDLQ); len(dl) > 0 {
		t.Errorf("%d good messages dead-lettered", len(dl))
		for v, ds := range dl {
			t.Logf("dead letter %s: %s %s", v, ds[0].headers[codec.HeaderError], ds[0].headers[codec.HeaderErrorDetail])
			break
		}
	}
}

// TestKill9DuringGroupJoin is a crash loop during a Kafka rebalance: the
// bridge is SIGKILLed twice while its consumer-group join is still pending
// (the group waits for the member of the process killed before), then a
// last process runs. Every partition of the delay topic must be consumed
// again: messages published afterwards, on every partition, are delivered.
// Long form only: the group needs several 30 s session timeouts to shed the
// dead members (about 2 min), which would not fit the CI budget next to
// TestKill9UnderLoad (tests run two at a time on two cores).
func TestKill9DuringGroupJoin(t *testing.T) {
	if !long() {
		t.Skip("long form only (DELAYBRIDGE_LONG=1): takes about 2 minutes")
	}
	t.Parallel()
	b := newBrokers(t, 0)
	col := b.collect(t)
	r := newRunner(t, b, bridgeConfig{})
	p := r.start()
	p.waitLog(90*time.Second, "delaybridge running", `"joined group"`)
	p.kill()
	for range 2 {
		p = r.start()
		p.waitLog(90*time.Second, "delaybridge running")
		time.Sleep(time.Second) // the join is pending: the dead member holds the rebalance
		p.kill()
	}
	p = r.start()
	p.waitLog(90*time.Second, "delaybridge running")
	kcl := b.kafkaClient()
	defer kcl.Close()
	var vals []string
	for i := range 30 {
		v := "join-" + strconv.Itoa(i)
		vals = append(vals, v)
		if err := kcl.ProduceSync(context.Background(), kafkaRecord(int32(i%3), []byte(v), []byte(v),
			hdr(codec.HeaderAfter, "0", codec.HeaderTarget, kafkaTarget))).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	start := time.Now()
	var lost []string
	ok := waitFor(drainWait, func() bool { lost, _ = lostAndDups(col, vals); return len(lost) == 0 })
	t.Logf("delivered after %v; Kafka group: %s", time.Since(start).Round(time.Millisecond), describeGroup(t, b))
	if !ok {
		byPart := map[string]int{}
		for _, v := range lost {
			n, _ := strconv.Atoi(v[len("join-"):])
			byPart["partition "+strconv.Itoa(n%3)]++
		}
		t.Fatalf("%d of %d messages not delivered within %v (%v): partitions left unconsumed after a crash loop during a rebalance",
			len(lost), len(vals), drainWait, byPart)
	}
	if err := p.term(); err != nil {
		t.Errorf("bridge stop: %v", err)
	}
}
