package shard

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
)

// TestHeldReleaseProperty drives one or two shards with random ingests,
// replaces, cancels, target outages (whole targets, and one target's
// "partition": its odd-numbered tasks), clock steps of 1 s and reopens,
// against a sink that fails as unavailable per target, and checks after
// every step:
//   - Stats().Pending = t keys in the store = the model's live tasks,
//     Stats().Held = held t keys;
//   - no version is acknowledged twice, none after its replace or cancel
//     returned (ops start from a settled engine) except one superseded
//     from inside Deliver (in flight), none tried before its due;
//   - no task whose target answers for it waits (held or not) longer than
//     a bound of backoffs (ceil(group/limit)+2 of Retry.Max) after it
//     became deliverable, even while its group's other target or
//     partition stays down;
//   - and at the end, all targets up, everything is delivered and
//     Pending/Held reach 0.
//
// DELAYBRIDGE_LONG=1 runs many more seeds; HOLDPROP_SEED=n runs one.
func TestHeldReleaseProperty(t *testing.T) {
	seeds, steps := 6, 70
	if longTests() {
		seeds, steps = 200, 250
	}
	first := uint64(1)
	if v := holdpropSeed(); v != 0 {
		first, seeds = v, 1
	}
	for seed := first; seed < first+uint64(seeds); seed++ {
		t.Run(fmt.Sprintf("seed%d", seed), func(t *testing.T) {
			runHeldProp(t, seed, steps)
		})
	}
}

func holdpropSeed() uint64 {
	var v uint64
	fmt.Sscan(os.Getenv("HOLDPROP_SEED"), &v)
	return v
}

type hpVersion struct {
	id, value string
	target    string
	tr        codec.Transport
	num       int // the id's number: odd ones are on the down "partition"
	due       int64
	born      int64 // clock ms at ingest
	live      bool  // current version of its id, not cancelled
	acked     bool
	bound     int64 // ms: the largest wait allowed since then
	flaky     bool  // fails once with a non-outage error
	// inflightOK: replaced or cancelled while in flight: its delivery
	// in that batch may still be acknowledged.
	inflightOK bool
}

type hpTarget struct {
	tr   codec.Transport
	name string
}

func runHeldProp(t *testing.T, seed uint64, steps int) {
	r := rand.New(rand.NewPCG(seed, 0x5eed))
	fb := 4 + r.IntN(5)
	shards := 1 + r.IntN(2)
	om := -1
	if r.IntN(2) == 0 {
		om = 1 + r.IntN(3)
	}
	retry := RetryPolicy{Initial: time.Second, Max: 8 * time.Second, Multiplier: 2, Jitter: -1, MaxAttempts: 3}
	h := newHarness(t, func(o *Options) {
		o.Shards = shards
		o.OutageMemory = om
		o.FireBatch = fb
		o.Retry = retry
		o.Logger = zap.NewNop()
	})
	t.Logf("seed %d: shards %d, OutageMemory %d, FireBatch %d", seed, shards, om, fb)
	kslot := transportSlot(codec.TransportKafka)
	targets := []hpTarget{
		{codec.TransportKafka, "out-0"},
		{codec.TransportKafka, "out-1"}, // has the "partition"
		{codec.TransportKafka, collidingTarget(kslot, "out-0")},
		{codec.TransportNATS, "subj-0"},
		{codec.TransportNATS, "subj-1"},
	}
	const partTarget = "out-1"
	down := map[string]bool{}
	partDown := false
	upSince := map[string]int64{} // target (or partTarget+"/odd") -> ms it last came up
	now := func() int64 { return h.clk.Now().UnixMilli() }

	versions := map[string]*hpVersion{} // by value
	current := map[string]*hpVersion{}  // by id: its live version
	failedOnce := map[string]bool{}
	var ids []string
	deliverable := func(v *hpVersion) bool {
		if down[v.target] {
			return false
		}
		return !(v.target == partTarget && partDown && v.num%2 == 1)
	}
	n := int64(0)
	nextID := 0
	mk := func(v *hpVersion) codec.Task {
		n++
		return codec.Task{
			Kind: codec.KindSchedule, ID: v.id, Source: "src", Origin: fmt.Sprintf("kafka:src/0@%d", n),
			Stamp: ms(t0) + n, Partition: 0, Offset: n, Due: v.due,
			Transport: v.tr, Target: v.target, Value: []byte(v.value),
			DLQTransport: codec.TransportKafka, DLQ: "dlq",
		}
	}
	newVersion := func(id string, num int, sinkLocked bool) *hpVersion {
		tg := targets[r.IntN(len(targets))]
		v := &hpVersion{id: id, num: num, tr: tg.tr, target: tg.name,
			due: now() + int64(r.IntN(18)-3)*1000 + int64(r.IntN(1000)), born: now(), live: true,
			flaky: r.IntN(25) == 0}
		v.value = fmt.Sprintf("%s#%d", id, n+1)
		if !sinkLocked {
			h.sink.mu.Lock()
			defer h.sink.mu.Unlock()
		}
		versions[v.value] = v
		return v
	}
	liveIDs := func() []string {
		var out []string
		for _, id := range ids {
			if current[id] != nil {
				out = append(out, id)
			}
		}
		return out
	}
	// armed: the next delivery of a live version replaces (1) or cancels
	// it by message (2) or by Engine.Cancel (3) from inside Deliver, so
	// while it is in flight.
	armed, inflightOps := 0, 0
	h.sink.setFail(func(tk *codec.Task) error {
		v := versions[string(tk.Value)]
		if armed != 0 && v != nil && v.live && current[v.id] == v {
			v.live, v.inflightOK = false, true
			delete(current, v.id)
			switch armed {
			case 1:
				nv := newVersion(v.id, v.num, true)
				current[v.id] = nv
				if err := h.e.Ingest(context.Background(), []codec.Task{mk(nv)}, nil); err != nil {
					t.Errorf("seed %d: in-flight replace of %s: %v", seed, v.value, err)
				}
			case 2:
				n++
				c := codec.Task{Kind: codec.KindCancel, ID: v.id, Source: "src", Origin: fmt.Sprintf("kafka:src/0@%d", n),
					Stamp: ms(t0) + n, Partition: 0, Offset: n, Transport: codec.TransportKafka}
				if err := h.e.Ingest(context.Background(), []codec.Task{c}, nil); err != nil {
					t.Errorf("seed %d: in-flight cancel of %s: %v", seed, v.value, err)
				}
			case 3:
				if err := h.e.Cancel("src", v.id); err != nil {
					t.Errorf("seed %d: in-flight Cancel of %s: %v", seed, v.value, err)
				}
			}
			armed = 0
			inflightOps++
		}
		if down[tk.Target] {
			return errDown
		}
		if tk.Target == partTarget && partDown && v != nil && v.num%2 == 1 {
			return errDown
		}
		if v != nil && v.flaky && !failedOnce[v.value] {
			failedOnce[v.value] = true
			return errors.New("transient: record too large")
		}
		return nil
	})
	seen := 0
	reopenedAt := int64(0)
	steady := os.Getenv("HOLDPROP_STEADY") != "" // outages 5x longer
	tight := os.Getenv("HOLDPROP_TIGHT") != ""   // the brief's ceil(group/FireBatch) backoffs
	maxHeld, partialSeen := int64(0), 0
	check := func(where string) {
		t.Helper()
		log := h.sink.all()
		for _, d := range log[seen:] {
			v := versions[d.Value]
			if d.Kind != codec.KindSchedule {
				t.Fatalf("seed %d %s: unexpected %v delivery %+v", seed, where, d.Kind, d)
			}
			if v == nil {
				t.Fatalf("seed %d %s: delivery of unknown value %q", seed, where, d.Value)
			}
			if d.At.UnixMilli() < v.due {
				t.Fatalf("seed %d %s: %s tried at %v, before its due %v", seed, where, d.Value, d.At.Sub(t0), time.UnixMilli(v.due).Sub(t0))
			}
			if d.Err != nil {
				continue
			}
			if v.acked {
				t.Fatalf("seed %d %s: %s delivered twice (second at %v)", seed, where, d.Value, d.At.Sub(t0))
			}
			if !v.live && !v.inflightOK {
				t.Fatalf("seed %d %s: %s delivered at %v after its replace/cancel returned", seed, where, d.Value, d.At.Sub(t0))
			}
			v.acked, v.inflightOK = true, false
			if current[v.id] == v {
				delete(current, v.id)
			}
		}
		seen = len(log)
		// Store against Stats and the model.
		tkeys, heldKeys, groupOfValue, groupSize := scanHeldProp(t, h.e)
		if os.Getenv("HOLDPROP_TRACE") != "" {
			for _, sh := range h.e.shards {
				sh.mu.Lock()
				hs := sh.lanes[kslot].hold
				t.Logf("TRACE %s at %v: kafka cursor %x/%d next %v down %+v", where, h.clk.Now().Sub(t0), hs.cursorFire, hs.cursorSeq, hs.next, hs.down)
				sh.mu.Unlock()
			}
		}
		st := h.e.Stats()
		maxHeld = max(maxHeld, st.Held)
		for _, sh := range h.e.shards {
			sh.mu.Lock()
			for l := range sh.lanes {
				for _, d := range sh.lanes[l].hold.down {
					if d.partial {
						partialSeen++
					}
				}
			}
			sh.mu.Unlock()
		}
		live := int64(len(current))
		if st.Pending != tkeys || st.Held != heldKeys || tkeys != live {
			t.Fatalf("seed %d %s at %v: Stats pending %d held %d; store t keys %d held keys %d; model live %d",
				seed, where, h.clk.Now().Sub(t0), st.Pending, st.Held, tkeys, heldKeys, live)
		}
		// Stranding: a live task deliverable for too long.
		halfFB := (fb + 1) / 2
		for _, id := range ids {
			v := current[id]
			if v == nil {
				continue
			}
			if !deliverable(v) {
				v.bound = 0
				continue
			}
			since := max(v.due, v.born, upSince[v.target], reopenedAt)
			if v.target == partTarget && v.num%2 == 1 {
				since = max(since, upSince[partTarget+"/odd"])
			}
			if since > now() {
				continue
			}
			g, held := groupOfValue[v.value]
			backoffs := int64(2)
			if held {
				backoffs += int64((groupSize[g] + halfFB - 1) / halfFB)
			}
			if tight && held {
				backoffs = 1 + int64((groupSize[g]+fb-1)/fb)
			}
			// The largest bound since it became deliverable: one held
			// meanwhile and released (into the wheel) keeps its group's.
			v.bound = max(v.bound, backoffs*retry.Max.Milliseconds()+3000)
			bound := v.bound
			if now()-since > bound {
				info, lerr := h.e.Lookup("src", v.id)
				t.Logf("lookup: %+v %v; due %v", info, lerr, time.UnixMilli(v.due).Sub(t0))
				for _, d := range h.sink.all() {
					if d.ID == v.id {
						t.Logf("  try %s at %v err %v", d.Value, d.At.Sub(t0), d.Err)
					}
				}
				if os.Getenv("HOLDPROP_TRACE") != "" {
					for _, d := range h.sink.all() {
						t.Logf("  all: %s %s at %v err %v", d.Value, d.Target, d.At.Sub(t0), d.Err)
					}
				}
				t.Fatalf("seed %d %s at %v: %s (target %s, held %v, group size %d) deliverable since %v and not delivered (bound %v); down %v partDown %v",
					seed, where, h.clk.Now().Sub(t0), v.value, v.target, held, groupSize[g], time.UnixMilli(since).Sub(t0),
					time.Duration(bound)*time.Millisecond, down, partDown)
			}
		}
	}

	// Start with everything down for a while so that tasks get held.
	for _, tg := range targets {
		down[tg.name] = true
	}
	h.run()
	setDown := func(name string, d bool) {
		h.sink.mu.Lock()
		if down[name] && !d {
			upSince[name] = now()
		}
		down[name] = d
		h.sink.mu.Unlock()
	}
	setPart := func(d bool) {
		h.sink.mu.Lock()
		if partDown && !d {
			upSince[partTarget+"/odd"] = now()
		}
		partDown = d
		h.sink.mu.Unlock()
	}
	for step := range steps {
		where := fmt.Sprintf("step %d", step)
		switch k := r.IntN(100); {
		case k < 35: // new schedules
			var batch []codec.Task
			for range 1 + r.IntN(6) {
				nextID++
				id := fmt.Sprintf("k%04d", nextID)
				v := newVersion(id, nextID, false)
				batch = append(batch, mk(v))
				current[id] = v
				ids = append(ids, id)
			}
			h.ingest(batch)
		case k < 47: // replace a live one
			l := liveIDs()
			if len(l) == 0 {
				break
			}
			id := l[r.IntN(len(l))]
			old := current[id]
			v := newVersion(id, old.num, false)
			task := mk(v)
			old.live = false
			current[id] = v
			h.ingest([]codec.Task{task})
		case k < 55: // cancel message
			l := liveIDs()
			if len(l) == 0 {
				break
			}
			id := l[r.IntN(len(l))]
			n++
			c := codec.Task{Kind: codec.KindCancel, ID: id, Source: "src", Origin: fmt.Sprintf("kafka:src/0@%d", n),
				Stamp: ms(t0) + n, Partition: 0, Offset: n, Transport: codec.TransportKafka}
			current[id].live = false
			delete(current, id)
			h.ingest([]codec.Task{c})
		case k < 59: // admin cancel
			l := liveIDs()
			if len(l) == 0 {
				break
			}
			id := l[r.IntN(len(l))]
			current[id].live = false
			delete(current, id)
			if err := h.e.Cancel("src", id); err != nil {
				t.Fatalf("seed %d %s: Cancel(%s): %v", seed, where, id, err)
			}
			h.settle()
		case k < 75: // flip a target
			if steady && r.IntN(5) != 0 {
				break
			}
			tg := targets[r.IntN(len(targets))]
			setDown(tg.name, !down[tg.name])
		case k < 81:
			if steady && r.IntN(5) != 0 {
				break
			}
			setPart(!partDown)
		case k < 84:
			h.reopen()
			h.run()
			// A restart forgets the groups' backoffs and probe positions
			// (in memory only): the stranding bound starts over.
			reopenedAt = now()
		case k < 92:
			h.sink.mu.Lock()
			armed = 1 + r.IntN(3)
			h.sink.mu.Unlock()
		}
		check(where + " op")
		h.advance(time.Second)
		check(where)
	}
	// All up: everything is delivered within Retry.Max and a few rounds
	// after the last due.
	for _, tg := range targets {
		setDown(tg.name, false)
	}
	setPart(false)
	lastDue := now()
	for _, v := range current {
		lastDue = max(lastDue, v.due)
	}
	for now() < lastDue+4*retry.Max.Milliseconds() {
		h.advance(time.Second)
		check("final")
	}
	if len(current) != 0 {
		var left []string
		for id, v := range current {
			info, _ := h.e.Lookup("src", id)
			left = append(left, fmt.Sprintf("%s(%s held=%v due=%v)", v.value, v.target, info.Held, time.UnixMilli(v.due).Sub(t0)))
		}
		slices.Sort(left)
		t.Fatalf("seed %d: all targets up: %d tasks never delivered: %v", seed, len(left), left)
	}
	t.Logf("seed %d: %d ids, max held %d, partial-group observations %d, in-flight supersessions %d, %d deliveries", seed, nextID, maxHeld, partialSeen, inflightOps, len(h.sink.all()))
	if st := h.e.Stats(); st.Pending != 0 || st.Held != 0 {
		t.Fatalf("seed %d: all delivered, Stats %+v", seed, st)
	}
}

// scanHeldProp counts the t keys and held t keys, and gives each held
// task's value its (shard, group) and each group's held size.
func scanHeldProp(t testing.TB, e *Engine) (tkeys, held int64, groupOfValue map[string][2]int64, groupSize map[[2]int64]int) {
	it, err := e.db.NewIter(&pebble.IterOptions{LowerBound: []byte{prefixTask}, UpperBound: []byte{prefixTask + 1}})
	if err != nil {
		t.Fatal(err)
	}
	defer it.Close()
	groupOfValue = map[string][2]int64{}
	groupSize = map[[2]int64]int{}
	for ok := it.First(); ok; ok = it.Next() {
		tkeys++
		sh, fire, _, valid := parseTaskKey(it.Key())
		if !valid || !isHeld(fire) {
			continue
		}
		held++
		var tk codec.Task
		if err := codec.DecodeTask(it.Value(), &tk); err != nil {
			t.Fatal(err)
		}
		g := [2]int64{int64(sh), groupOf(fire)}
		groupOfValue[string(tk.Value)] = g
		groupSize[g]++
	}
	return
}
