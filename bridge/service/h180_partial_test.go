package service

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// createKafkaTopicsN creates topics with n partitions each on e's broker.
func (e *env) createKafkaTopicsN(n int32, topics ...string) {
	e.t.Helper()
	req := kmsg.NewPtrCreateTopicsRequest()
	for _, tp := range topics {
		rt := kmsg.NewCreateTopicsRequestTopic()
		rt.Topic, rt.NumPartitions, rt.ReplicationFactor = tp, n, 1
		req.Topics = append(req.Topics, rt)
	}
	resp, err := req.RequestWith(context.Background(), e.kcl)
	if err != nil {
		e.t.Fatalf("create topics: %v", err)
	}
	for _, rt := range resp.Topics {
		if rt.ErrorCode != 0 {
			e.t.Fatalf("create topic %s: %v", rt.Topic, kerr.ErrorForCode(rt.ErrorCode))
		}
	}
}

// h180Run is one long run of steady traffic against a Kafka target partly
// down (one partition of a topic, or one topic of six), on the fake clock.
type h180Run struct {
	shards    int
	minutes   int
	rate      int  // tasks per fake second
	topicDown bool // one whole topic down among 5 healthy; else one partition of 6
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil {
		return v
	}
	return def
}

// TestPartlyDownTopicUnderLoad (hunt H180): a Kafka target topic with one
// partition without a leader, then (subtest topic) one topic of six
// refusing writes, under steady traffic: no loss, no duplicate, one Warn
// per shard and readiness steadily not ready, everything delivered soon
// after the return. DELAYBRIDGE_LONG=1 runs its short form (2 fake
// minutes); H180_MIN (fake minutes; 30 for the hunt's run, about 6.5 min
// of real time each), H180_RATE (tasks/s, 20), H180_SHARDS (8),
// H180_STEP_MS (1000) and H180_MODE (partition|topic|both) size it.
func TestPartlyDownTopicUnderLoad(t *testing.T) {
	if os.Getenv("DELAYBRIDGE_LONG") == "" {
		t.Skip("DELAYBRIDGE_LONG=1 runs it")
	}
	mode := os.Getenv("H180_MODE")
	for _, topicDown := range []bool{false, true} {
		if (mode == "partition" && topicDown) || (mode == "topic" && !topicDown) {
			continue
		}
		name := "partition"
		if topicDown {
			name = "topic"
		}
		t.Run(name, func(t *testing.T) {
			runH180(t, h180Run{shards: envInt("H180_SHARDS", 8), minutes: envInt("H180_MIN", 2), rate: envInt("H180_RATE", 20), topicDown: topicDown})
		})
	}
}

type h180Task struct {
	due int64 // ms
	bad bool
	at  []int64 // fake ms of each delivery
}

func runH180(t *testing.T, o h180Run) {
	e := newEnv(t, fmt.Sprintf("shards: %d\nretry: {max_attempts: 10}\n", o.shards))
	var topics []string
	if o.topicDown {
		topics = []string{"orders-h0", "orders-h1", "orders-h2", "orders-h3", "orders-h4", "orders-down"}
		e.createKafkaTopicsN(3, topics...)
	} else {
		topics = []string{"orders6"}
		e.createKafkaTopicsN(6, topics...)
	}
	e.kcl.AddConsumeTopics(topics...)
	core, logs := observer.New(zap.InfoLevel)
	svc, _, _ := e.runWith(Options{Logger: zap.New(core)})
	for _, tp := range topics {
		e.publishKafka(0, time.Time{}, []byte("w"+tp), []byte("warm-"+tp), "delay-after", "0", "delay-target", tp)
	}
	e.advanceUntil("warm-up", func(ds []delivery) bool {
		return countDest(ds, func(d delivery) bool { return strings.HasPrefix(d.value, "warm-") }) == len(topics)
	})
	logs.TakeAll()

	// Keys by partition of orders6 (kafka-go's murmur2, 6 partitions).
	keysBy := make([][]string, 6)
	for i := 0; ; i++ {
		k := "k" + strconv.Itoa(i)
		p := (&kafkago.Murmur2Balancer{}).Balance(kafkago.Message{Key: []byte(k)}, 0, 1, 2, 3, 4, 5)
		keysBy[p] = append(keysBy[p], k)
		if i > 6000 {
			break
		}
	}
	var fault *kfake.FaultHandle
	if o.topicDown {
		fault = e.kc.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: "orders-down", Err: kerr.NotEnoughReplicas, Count: -1})
	} else {
		fault = e.kc.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: "orders6", Partitions: []int32{5}, Err: kerr.NotLeaderForPartition, Count: -1})
	}
	produces := e.kc.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Observe: true, Count: -1})
	defer produces.Remove()

	tasks := map[string]*h180Task{}
	var healthyDue []int64 // sorted as published
	seen, healthyDelivered := 0, 0
	process := func() {
		e.mu.Lock()
		ds := e.got[seen:]
		seen = len(e.got)
		e.mu.Unlock()
		for _, d := range ds {
			if tk, ok := tasks[d.value]; ok {
				if len(tk.at) == 0 && !tk.bad {
					healthyDelivered++
				}
				tk.at = append(tk.at, d.at.UnixMilli())
			} else if !strings.HasPrefix(d.value, "warm-") {
				t.Errorf("unexpected delivery %s %q %s", d.dest, d.value, d.header("delay-error"))
			}
		}
	}
	t0 := e.clk.Now().Truncate(time.Second).Add(time.Second)
	e.clk.Set(t0)
	const lead = 10 // s between publish and due
	publish := func(s int) {
		var recs []*kgo.Record
		for j := range o.rate {
			v := fmt.Sprintf("t%d-%d", s, j)
			due := t0.Add(time.Duration(s+lead)*time.Second + time.Duration(j)*time.Second/time.Duration(o.rate))
			var topic, key string
			bad := false
			if o.topicDown {
				topic, key = topics[(s*o.rate+j)%6], v
				bad = (s*o.rate+j)%6 == 5
			} else {
				p := (s*o.rate + j) % 6
				topic, key = "orders6", keysBy[p][(s*o.rate+j)%len(keysBy[p])]
				bad = p == 5
			}
			tasks[v] = &h180Task{due: due.UnixMilli(), bad: bad}
			if !bad {
				healthyDue = append(healthyDue, due.UnixMilli())
			}
			recs = append(recs, &kgo.Record{Topic: kafkaDelay, Partition: int32(j % 3), Key: []byte(key), Value: []byte(v), Timestamp: e.clk.Now(),
				Headers: []kgo.RecordHeader{{Key: "delay-id", Value: []byte(v)}, {Key: "delay-at", Value: []byte(strconv.FormatInt(due.UnixMilli(), 10))}, {Key: "delay-target", Value: []byte(topic)}}})
		}
		if err := e.kcl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
			t.Fatalf("produce: %v", err)
		}
	}
	retries := func() float64 { return testutil.ToFloat64(svc.m.PublishRetries.WithLabelValues("kafka")) }
	wasReady := svc.Ready() == nil
	flips, flipsMin := 0, 0
	var realWait time.Duration
	var stepWaits []int64 // real ms until the healthy tasks due were delivered, per step
	lastHits, lastProd, lastRetries := fault.Hits(), produces.Hits(), retries()
	total := o.minutes * 60
	stepMs := envInt("H180_STEP_MS", 1000) // fake ms per clock step
	stepStart := time.Now()
	step := func(s int, traffic bool) {
		if traffic {
			publish(s)
		}
		for range 1000 / stepMs {
			e.clk.Advance(time.Duration(stepMs) * time.Millisecond)
			now := e.clk.Now().UnixMilli()
			want, _ := slices.BinarySearch(healthyDue, now+1)
			w0 := time.Now()
			for deadline := time.Now().Add(2 * time.Second); ; {
				process()
				if healthyDelivered >= want || time.Now().After(deadline) {
					break
				}
				select {
				case <-e.seen:
				case <-time.After(5 * time.Millisecond):
				}
			}
			realWait += time.Since(w0)
			if traffic {
				stepWaits = append(stepWaits, time.Since(w0).Milliseconds())
			}
			r := svc.Ready() == nil
			if r != wasReady {
				flips++
				flipsMin++
				wasReady = r
			}
		}
	}
	summary := func(minute int) {
		ents := logs.TakeAll()
		byMsg := map[string]int{}
		for _, en := range ents {
			m := en.Message
			if len(m) > 60 {
				m = m[:60]
			}
			byMsg[m]++
		}
		st := svc.Engine().Stats()
		h, p, r := fault.Hits(), produces.Hits(), retries()
		var lines []string
		for m, n := range byMsg {
			lines = append(lines, fmt.Sprintf("%d x %q", n, m))
		}
		slices.Sort(lines)
		t.Logf("min %2d: refused %d produces %d retries %.0f, ready flips %d (ready=%v), pending %d held %d, real %.1fs (waits %.1fs); logs: %s",
			minute, h-lastHits, p-lastProd, r-lastRetries, flipsMin, wasReady, st.Pending, st.Held, time.Since(stepStart).Seconds(), realWait.Seconds(), strings.Join(lines, "; "))
		lastHits, lastProd, lastRetries, flipsMin = h, p, r, 0
		stepStart, realWait = time.Now(), 0
	}
	for s := range total {
		step(s, true)
		if (s+1)%60 == 0 {
			summary((s + 1) / 60)
		}
	}
	fault.Remove()
	back := e.clk.Now().UnixMilli()
	t.Logf("target back at +%ds", (back-t0.UnixMilli())/1000)
	// Recovery: traffic goes on; until every task is delivered.
	s := total
	for ; s < total+20*60; s++ {
		step(s, s < total+120)
		if (s+1)%60 == 0 {
			summary((s + 1) / 60)
		}
		done := true
		for _, tk := range tasks {
			if len(tk.at) == 0 {
				done = false
				break
			}
		}
		if done && s >= total+120+lead {
			break
		}
	}
	summary(-1)
	// Lateness.
	var hl, bl []int64
	lost, dup := 0, 0
	lastBad := int64(0)
	for _, tk := range tasks {
		if len(tk.at) == 0 {
			lost++
			continue
		}
		if len(tk.at) > 1 {
			dup++
		}
		l := tk.at[0] - tk.due
		if tk.bad {
			bl = append(bl, l)
			if tk.due < back {
				lastBad = max(lastBad, tk.at[0])
			}
		} else {
			hl = append(hl, l)
		}
	}
	pct := func(xs []int64) string {
		if len(xs) == 0 {
			return "none"
		}
		slices.Sort(xs)
		q := func(f float64) int64 { return xs[min(len(xs)-1, int(f*float64(len(xs))))] }
		return fmt.Sprintf("n=%d p50=%dms p99=%dms max=%dms", len(xs), q(0.5), q(0.99), xs[len(xs)-1])
	}
	t.Logf("healthy lateness: %s", pct(hl))
	t.Logf("real wait per step for the healthy tasks due: %s", pct(stepWaits))
	t.Logf("down-part lateness: %s", pct(bl))
	t.Logf("last overdue down-part task delivered %.1fs after the target was back; lost %d, duplicated %d", float64(lastBad-back)/1000, lost, dup)
	if lost > 0 || dup > 0 {
		t.Errorf("lost %d, duplicated %d", lost, dup)
	}
	eventually(t, "nothing pending", func() bool { return svc.Engine().Stats().Pending == 0 })
}

// TestOnePartitionDownNoFlap (hunt H180): a Kafka target topic with one
// partition that cannot take writes (NOT_LEADER_FOR_PARTITION) while its
// other partitions take them is one outage until that partition does: one
// Warn, no "reachable again", readiness steadily not ready. Every delivery
// of a new task to a healthy partition ended the outage (its target group
// is the whole topic) and the next retry of a waiting task began it again:
// with 8 shards at 20 tasks/s some 430 Warn and 430 Info lines a minute.
func TestOnePartitionDownNoFlap(t *testing.T) {
	e := newEnv(t, "shards: 1\nretry: {initial: 1s, max: 4s, multiplier: 2, jitter: 0, max_attempts: 2}\n")
	core, logs := observer.New(zap.InfoLevel)
	svc, _, _ := e.runWith(Options{Logger: zap.New(core)})
	var p0, other []string // keys of partition 0 of orders (3 partitions), of the others
	for i := 0; len(p0) < 2 || len(other) < 12; i++ {
		k := "key" + strconv.Itoa(i)
		if (&kafkago.Murmur2Balancer{}).Balance(kafkago.Message{Key: []byte(k)}, 0, 1, 2) == 0 {
			p0 = append(p0, k)
		} else {
			other = append(other, k)
		}
	}
	fault := e.kc.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: kafkaOut, Partitions: []int32{0}, Err: kerr.NotLeaderForPartition, Count: -1})
	e.publishKafka(0, time.Time{}, []byte(p0[0]), []byte("down"), "delay-after", "1s", "delay-target", kafkaOut)
	waitIngested(t, svc, 1)
	advanceUntilCond(t, e, "a refused produce", func() bool { return fault.Hits() >= 1 })
	var states []bool // readiness after each healthy delivery and after each refused retry
	for i := range 6 {
		for _, k := range other[2*i : 2*i+2] {
			e.publishKafka(0, time.Time{}, []byte(k), []byte(k), "delay-after", "0", "delay-target", kafkaOut)
			e.advanceUntil("healthy delivery", func(ds []delivery) bool { return len(byValue(ds, kafkaOut)[k]) > 0 })
			states = append(states, svc.Ready() == nil)
		}
		h := fault.Hits()
		advanceUntilCond(t, e, "another refused retry", func() bool { return fault.Hits() > h })
		states = append(states, svc.Ready() == nil)
	}
	down, up := logs.FilterMessageSnippet("target broker unreachable").Len(), logs.FilterMessageSnippet("target broker reachable again").Len()
	t.Logf("readiness %v; %d Warn unreachable, %d Info reachable again", states, down, up)
	if down != 1 || up != 0 {
		t.Errorf("one partition down among healthy ones: %d Warn lines \"target broker unreachable\" and %d \"reachable again\", want 1 and 0", down, up)
	}
	if slices.Contains(states, true) {
		t.Errorf("readiness passes while a partition of the target cannot take writes: %v", states)
	}
	fault.Remove()
	e.advanceUntil("the waiting task delivered", func(ds []delivery) bool { return len(byValue(ds, kafkaOut)["down"]) > 0 })
	eventually(t, "ready again", func() bool { return svc.Ready() == nil })
	if n := logs.FilterMessageSnippet("target broker reachable again").Len(); n != 1 {
		t.Errorf("%d Info lines \"reachable again\" after the partition came back, want 1", n)
	}
}
