package shard

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/clock"
)

// TestCrashSafetyOps is TestCrashSafety with replaces, cancels, dead
// letters (IngestAwait with a checkpoint, so w records), failing publishes
// (retries move t keys; publish-failed dead letters) and a short cancel
// retention (the marker sweep runs between kills). It checks after the last
// recovery that
//   - every acknowledged dead letter reached its DLQ;
//   - for every id whose last message was acknowledged, a schedule's value
//     was delivered;
//   - nothing pending at the final recovery is older than the id's last
//     message (a replace or cancel lost by a kill would leave it);
//   - no checkpoint key still waits for a dead letter.
func TestCrashSafetyOps(t *testing.T) {
	if dir := os.Getenv(crashChildEnv + "_OPS"); dir != "" {
		crashOpsChild(dir)
		return
	}
	rounds := 4
	if longTests() {
		rounds = 25
	}
	dir := t.TempDir()
	seed := uint64(time.Now().UnixNano())
	t.Logf("random seed %d (kill times are real time: a seed repeats the choices, not the run)", seed)
	rng := rand.New(rand.NewPCG(seed, 1))
	type op struct {
		kind  byte // S, C, D
		key   string
		value string
		acked bool
		seq   int // global order
	}
	var ops []*op
	byBatch := map[string][]*op{}
	for round := 0; round < rounds; round++ {
		runChildUntilKill(t, "TestCrashSafetyOps", crashChildEnv+"_OPS="+dir, round, 20+rng.IntN(150), func(line string) bool {
			f := strings.Fields(line)
			if len(f) < 2 {
				return false
			}
			switch f[0] {
			case "B":
				for _, enc := range f[2:] {
					p := strings.SplitN(enc, ":", 3)
					o := &op{kind: p[0][0], key: p[1], value: p[2], seq: len(ops)}
					ops = append(ops, o)
					byBatch[f[1]] = append(byBatch[f[1]], o)
				}
			case "A":
				for _, o := range byBatch[f[1]] {
					o.acked = true
				}
				return true
			}
			return false
		})
	}

	clk := clock.NewFake(time.Now().Add(time.Hour))
	h := &harness{t: t, clk: clk, opts: crashOpsOptions(dir, clk, zap.NewNop()), sink: newRecSink(clk)}
	h.open()
	t.Cleanup(h.close)
	h.checkPending()
	h.run()
	if p := h.e.Stats().Pending; p != 0 {
		t.Fatalf("%d tasks still pending after draining", p)
	}
	if n := h.e.AwaitedDeadLetters("crash"); n != 0 {
		t.Errorf("checkpoint key still waits for %d dead letters after the drain", n)
	}
	// Deliveries: the child's file (kind value) and the final drain.
	delivered := map[string]int{}
	var lifeDeliveries [][2]string
	b, err := os.ReadFile(filepath.Join(dir, "delivered"))
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	lines := strings.Split(string(b), "\n")
	for _, l := range lines[:len(lines)-1] {
		if f := strings.Fields(l); len(f) == 3 {
			delivered[f[2]]++
			life, _ := strconv.Atoi(f[0])
			if f[1] == strconv.Itoa(int(codec.KindSchedule)) {
				lifeDeliveries = append(lifeDeliveries, [2]string{strconv.Itoa(life), f[2]})
			}
		}
	}
	final := h.sink.all()
	for _, d := range final {
		delivered[d.Value]++
	}
	// The last message of each id, and whether it is certain (acked, no
	// unacknowledged message after it).
	type last struct {
		acked   *op
		unacked bool // an unacknowledged message came after the last acked one
	}
	lastOf := map[string]*last{}
	older := map[string]int{} // value -> op seq, for schedules
	for _, o := range ops {
		if o.kind == 'D' {
			if o.acked && delivered[o.value] == 0 {
				t.Errorf("acknowledged dead letter %s (%s) never reached its DLQ", o.key, o.value)
			}
			continue
		}
		l := lastOf[o.key]
		if l == nil {
			l = &last{}
			lastOf[o.key] = l
		}
		if o.acked {
			l.acked, l.unacked = o, false
		} else {
			l.unacked = true
		}
		if o.kind == 'S' {
			older[o.value] = o.seq
		}
	}
	lost, stale := 0, 0
	for id, l := range lastOf {
		if l.acked == nil || l.unacked || l.acked.kind != 'S' {
			continue
		}
		if delivered[l.acked.value] == 0 {
			lost++
			if lost <= 10 {
				t.Errorf("id %s: last acknowledged schedule %s never delivered", id, l.acked.value)
			}
		}
	}
	for _, d := range final {
		if d.Kind != codec.KindSchedule {
			continue
		}
		l := lastOf[d.ID]
		if l == nil || l.acked == nil || l.unacked {
			continue
		}
		if s, ok := older[d.Value]; ok && s < l.acked.seq {
			stale++
			if stale <= 10 {
				t.Errorf("id %s: %s pending at the final recovery, but its acknowledged %c %s is newer (replace/cancel lost)",
					d.ID, d.Value, l.acked.kind, l.acked.value)
			}
		}
	}
	// A schedule delivered in a later life than the one whose acknowledged
	// replace or cancel superseded it was resurrected by a restart.
	byValue := map[string]*op{}
	for _, o := range ops {
		byValue[o.value] = o
	}
	roundOf := func(v string) int { r, _ := strconv.Atoi(strings.SplitN(v[1:], "-", 2)[0]); return r }
	resurrected := 0
	for _, ld := range lifeDeliveries {
		life, _ := strconv.Atoi(ld[0])
		o := byValue[ld[1]]
		if o == nil || o.kind != 'S' {
			continue
		}
		for _, n := range ops[o.seq+1:] {
			if n.key == o.key && n.acked && n.kind != 'D' && roundOf(n.value) < life {
				resurrected++
				if resurrected <= 10 {
					t.Errorf("id %s: %s delivered in life %d, after its newer %c %s was acknowledged in life %d",
						o.key, o.value, life, n.kind, n.value, roundOf(n.value))
				}
				break
			}
		}
	}
	acked := 0
	for _, o := range ops {
		if o.acked {
			acked++
		}
	}
	t.Logf("child deliveries: %d", len(lines)-1)
	t.Logf("%d rounds: %d ops (%d acked), %d ids, %d delivered at the final recovery; %d lost, %d stale",
		rounds, len(ops), acked, len(lastOf), len(final), lost, stale)
}

func crashOpsOptions(dir string, clk clock.Clock, log *zap.Logger) Options {
	o := crashOptions(dir, clk, log)
	o.Retry = RetryPolicy{Initial: 5 * time.Millisecond, Max: 50 * time.Millisecond, MaxAttempts: 2}
	o.CancelRetention = 300 * time.Millisecond
	return o
}

// opsSink records "kind value" durably before acknowledging; a task whose
// value hashes to 0 mod 5 fails its first two attempts (a schedule becomes
// a publish-failed dead letter, which fails twice too).
type opsSink struct {
	f     *os.File
	round string
}

func failsTwice(v []byte) bool {
	h := fnv.New32a()
	h.Write(v)
	return h.Sum32()%5 == 0
}

func (s opsSink) Deliver(_ context.Context, batch []*codec.Task) []error {
	var b []byte
	errs := make([]error, len(batch))
	for i, t := range batch {
		if failsTwice(t.Value) && t.Attempts < 2 {
			errs[i] = errors.New("injected publish failure")
			continue
		}
		b = append(b, s.round...)
		b = append(b, ' ', byte('0'+t.Kind), ' ')
		b = append(b, t.Value...)
		b = append(b, '\n')
	}
	if len(b) > 0 {
		if _, err := s.f.Write(b); err != nil {
			return allErr(len(batch), err)
		}
		if err := s.f.Sync(); err != nil {
			return allErr(len(batch), err)
		}
	}
	return errs
}

func crashOpsChild(dir string) {
	fail := func(err error) {
		fmt.Fprintln(os.Stderr, "crash child:", err)
		os.Exit(2)
	}
	round := os.Getenv("DELAYBRIDGE_CRASH_ROUND")
	r, _ := strconv.Atoi(round)
	e, err := Open(crashOpsOptions(dir, clock.Real{}, zap.NewNop()))
	if err != nil {
		fail(err)
	}
	f, err := os.OpenFile(filepath.Join(dir, "delivered"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		fail(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	go e.Run(ctx, opsSink{f, round})
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 3))
	w := bufio.NewWriter(os.Stdout)
	for n, batchNo := 0, 0; ctx.Err() == nil; batchNo++ {
		now := time.Now().UnixMilli()
		batch := make([]codec.Task, 40)
		name := fmt.Sprintf("%d-%d", r, batchNo)
		var line strings.Builder
		line.WriteString("B " + name)
		for i := range batch {
			n++
			off := int64(r)*10_000_000 + int64(n)
			v := fmt.Sprintf("v%d-%d", r, n)
			id := "id-" + strconv.Itoa(rng.IntN(300))
			due := now - 50 + rng.Int64N(400)
			t := codec.Task{Kind: codec.KindSchedule, ID: id, Source: "crash", Origin: "kafka:crash/0@" + strconv.FormatInt(off, 10),
				Stamp: now, Offset: off, Due: due, Transport: codec.TransportKafka, Target: "out", Value: []byte(v),
				DLQTransport: codec.TransportKafka, DLQ: "dlq"}
			kind := "S"
			switch x := rng.IntN(100); {
			case x < 12:
				t.Kind, t.Value, t.Due, kind = codec.KindCancel, nil, 0, "C"
			case x < 20:
				t = codec.DeadLetter(&t, codec.CodeBadDue, "test")
				t.ID, kind = "", "D"
			}
			batch[i] = t
			key := id
			if kind == "D" {
				key = "dl"
			}
			line.WriteString(" " + kind + ":" + key + ":" + v)
		}
		w.WriteString(line.String() + "\n")
		w.Flush()
		cp := Checkpoint{Key: "crash", Offset: int64(r)*10_000_000 + int64(n)}
		if _, err := e.IngestAwait(ctx, batch, []Checkpoint{cp}); err != nil {
			fail(err)
		}
		w.WriteString("A " + name + "\n")
		w.Flush()
		time.Sleep(time.Duration(rng.IntN(5)) * time.Millisecond)
	}
	os.Exit(3)
}
