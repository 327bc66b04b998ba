package shard

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"

	"go.uber.org/zap"
)

func TestIndexEntryRoundTrip(t *testing.T) {
	for _, e := range []indexEntry{
		{Shard: 3, Fire: 1_800_000_000_000, Seq: 42, Order: order{Stamp: 1_700_000_000_000, Partition: 7, Offset: 99}},
		{Cancel: true, Shard: 0, Order: order{Stamp: -1, Partition: -1, Offset: -1}, Expiry: 123},
		{Shard: 65535, Fire: 0, Seq: 1<<64 - 1},
		{Shard: 2, Fire: 5, Seq: 6, Order: order{Stamp: 7, Partition: 1, Incarnation: 1, Offset: 3}},
		{Cancel: true, Order: order{Stamp: 7, Incarnation: 1<<32 - 1}, Expiry: 9},
	} {
		b := appendIndexEntry(nil, &e)
		// The first log's entries keep the 48-byte version 1 that
		// releases before incarnations read; later logs' are version 2.
		if wantLen := map[bool]int{false: indexEntryLen, true: indexEntryLen2}[e.Order.Incarnation != 0]; len(b) != wantLen {
			t.Fatalf("%+v encoded in %d bytes, want %d", e, len(b), wantLen)
		}
		var got indexEntry
		if err := decodeIndexEntry(b, &got); err != nil || got != e {
			t.Fatalf("round trip of %+v: %+v, %v", e, got, err)
		}
	}
	good := appendIndexEntry(nil, &indexEntry{Order: order{Incarnation: 5}})
	for name, b := range map[string][]byte{
		"version 2 with incarnation 0":  append(append([]byte(nil), good[:indexEntryLen]...), 0, 0, 0, 0),
		"version 2 at version 1 length": append([]byte(nil), good[:indexEntryLen]...),
		"version 1 at version 2 length": append([]byte{indexVersion}, good[1:]...),
		"version 3":                     append([]byte{3}, good[1:]...),
		"kind 3":                        append([]byte{indexVersion2, 3}, good[2:]...),
		"one byte":                      {indexVersion},
	} {
		var got indexEntry
		if err := decodeIndexEntry(b, &got); err == nil {
			t.Errorf("%s: decoded as %+v", name, got)
		}
	}
}

func TestKeysSortByTime(t *testing.T) {
	cases := []struct {
		a, b [3]int64 // shard, fire, seq
	}{
		{[3]int64{0, 1, 9}, [3]int64{0, 2, 1}},
		{[3]int64{0, 255, 1}, [3]int64{0, 256, 0}},
		{[3]int64{0, 1 << 40, 5}, [3]int64{0, 1 << 40, 6}},
		{[3]int64{1, 0, 0}, [3]int64{2, 0, 0}},
		{[3]int64{0, -5, 0}, [3]int64{0, 1, 0}}, // negative dues clamp to 0
	}
	for _, c := range cases {
		ka := string(appendTaskKey(nil, int(c.a[0]), c.a[1], uint64(c.a[2])))
		kb := string(appendTaskKey(nil, int(c.b[0]), c.b[1], uint64(c.b[2])))
		if ka >= kb {
			t.Fatalf("key %v sorts at or after %v", c.a, c.b)
		}
		sh, fire, seq, ok := parseTaskKey([]byte(ka))
		if !ok || sh != int(c.a[0]) || fire != max(c.a[1], 0) || seq != uint64(c.a[2]) {
			t.Fatalf("parse %v: %d %d %d %v", c.a, sh, fire, seq, ok)
		}
	}
}

func TestOrderNewerThan(t *testing.T) {
	cases := []struct {
		name    string
		in, old order
		newer   bool
	}{
		{"same partition later offset", order{1, 0, 0, 11}, order{5, 0, 0, 10}, true},
		{"same partition earlier offset", order{9, 0, 0, 9}, order{5, 0, 0, 10}, false},
		{"same partition same offset", order{9, 0, 0, 10}, order{5, 0, 0, 10}, false},
		{"same partition and later incarnation, later offset", order{1, 0, 3, 11}, order{5, 0, 3, 10}, true},
		{"other partition later stamp", order{6, 1, 0, 0}, order{5, 0, 0, 10}, true},
		{"other partition earlier stamp", order{4, 1, 0, 99}, order{5, 0, 0, 10}, false},
		{"other partition tie keeps existing", order{5, 1, 0, 99}, order{5, 0, 0, 10}, false},
		// A re-created topic numbers from 0 again: its messages are
		// ordered against the old log's by broker time, like another
		// partition's, not by their lower offsets.
		{"new log, lower offset, later stamp", order{6, 0, 1, 0}, order{5, 0, 0, 10}, true},
		{"new log, higher offset, earlier stamp", order{4, 0, 1, 99}, order{5, 0, 0, 10}, false},
		{"new log, tie keeps existing", order{5, 0, 1, 0}, order{5, 0, 0, 10}, false},
		{"old log after the new one, later offset", order{4, 0, 0, 11}, order{5, 0, 1, 0}, false},
	}
	for _, c := range cases {
		if got := c.in.newerThan(c.old); got != c.newer {
			t.Errorf("%s: newerThan = %v", c.name, got)
		}
	}
}

func FuzzDecodeIndexEntry(f *testing.F) {
	f.Add(appendIndexEntry(nil, &indexEntry{Shard: 1, Fire: 2, Seq: 3}))
	f.Add(appendIndexEntry(nil, &indexEntry{Cancel: true, Expiry: 9}))
	f.Add(appendIndexEntry(nil, &indexEntry{Shard: 1, Order: order{Incarnation: 2}}))
	f.Add([]byte{})
	f.Add([]byte{1, 3})
	f.Fuzz(func(t *testing.T, b []byte) {
		var e indexEntry
		if err := decodeIndexEntry(b, &e); err != nil {
			return
		}
		if got := appendIndexEntry(nil, &e); string(got) != string(b) {
			t.Fatalf("re-encoding %x gave %x", b, got)
		}
	})
}

// FuzzParseExpiryKey: an x key names its expiry and the i key of the
// cancel marker it expires, and a t key its shard, fire time and seq. The
// parsers never panic, accept exactly the keys of their form with a fire
// time or expiry below 2^63 (as the encoders write them), and what they
// accept encodes back to the same key: an expiry key to the marker's index
// key of the same source and id.
func FuzzParseExpiryKey(f *testing.F) {
	f.Add(appendExpiryKey(nil, 2, 1234, "src", "id"))
	f.Add(appendExpiryKey(nil, 0, 0, "", ""))
	f.Add(appendExpiryKey(nil, 65535, 1<<62, "a\x00b", "c"))
	f.Add(appendTaskKey(nil, 3, 1_800_000_000_000, 42))
	f.Add(appendTaskKey(nil, 1, heldBase+5, 1<<64-1))
	f.Add([]byte{prefixExpiry})
	f.Add([]byte{prefixTask})
	// Fire times and expiries with the top bit set: refused.
	f.Add([]byte{prefixTask, 0, 3, 0x80, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1})
	f.Add(append(append([]byte{prefixExpiry, 0, 2}, 0xff, 0, 0, 0, 0, 0, 0, 0), "src\x00id"...))
	f.Fuzz(func(t *testing.T, b []byte) {
		expiry, ik, ok := parseExpiryKey(b)
		if want := len(b) >= 11 && b[0] == prefixExpiry && b[3]&0x80 == 0 && strings.Contains(string(b[11:]), "\x00"); ok != want {
			t.Fatalf("parseExpiryKey(%x) ok = %v", b, ok)
		}
		if ok {
			sh := int(binary.BigEndian.Uint16(b[1:3]))
			source, id, _ := strings.Cut(string(b[11:]), "\x00")
			if got := appendExpiryKey(nil, sh, expiry, source, id); string(got) != string(b) {
				t.Fatalf("expiry key %x parsed to %d %q %q, which encode to %x", b, expiry, source, id, got)
			}
			if want := appendIndexKey(nil, source, id); string(ik) != string(want) {
				t.Fatalf("expiry key %x names index key %x, want %x", b, ik, want)
			}
		}
		sh, fire, seq, ok := parseTaskKey(b)
		if want := len(b) == taskKeyLen && b[0] == prefixTask && b[3]&0x80 == 0; ok != want {
			t.Fatalf("parseTaskKey(%x) ok = %v", b, ok)
		}
		if ok {
			if got := appendTaskKey(nil, sh, fire, seq); string(got) != string(b) {
				t.Fatalf("task key %x parsed to %d %d %d, which encode to %x", b, sh, fire, seq, got)
			}
		}
	})
}

// FuzzParseWaiting: a waiting record read back from the store never panics
// the decoder, is accepted exactly when it is one appendWaiting can have
// written (a fire time below the held ones, a target group named), and an
// accepted one encodes back to the same key and value.
func FuzzParseWaiting(f *testing.F) {
	f.Add(waitingKey(2, 7), appendWaiting(nil, 1234, packLate(1_800_000_000_000, heldBase)))
	f.Add(waitingKey(0, 0), appendWaiting(nil, 0, packLate(0, heldBase+5<<heldDueBits)))
	f.Add(waitingKey(1, 1), appendWaiting(nil, heldBase, 1<<heldDueBits))
	f.Add(waitingKey(1, 1), appendWaiting(nil, 1, 1234))
	f.Add([]byte{prefixWaiting}, []byte{})
	f.Fuzz(func(t *testing.T, k, v []byte) {
		sh, seq, fire, dg, ok := parseWaiting(k, v)
		want := len(k) == shardSeqKeyLen && k[0] == prefixWaiting && len(v) == waitingLen
		if want {
			f, i := binary.BigEndian.Uint64(v), binary.BigEndian.Uint64(v[8:])>>heldDueBits
			want = f < heldBase && i >= 1 && i <= transportSlots<<heldGroupBits
		}
		if ok != want {
			t.Fatalf("parseWaiting(%x, %x) ok = %v, want %v", k, v, ok, want)
		}
		if !ok {
			return
		}
		if lt := (lateTask{dg: dg}); fire < 0 || isHeld(fire) || !isHeld(lt.group()) || packLate(lt.due(), lt.group()) != dg {
			t.Fatalf("parseWaiting(%x, %x) = fire %d, dg %d: not a waiting task's", k, v, fire, dg)
		}
		if got := waitingKey(sh, seq); string(got) != string(k) {
			t.Fatalf("key %x decoded to shard %d seq %d, which encode to %x", k, sh, seq, got)
		}
		if got := appendWaiting(nil, fire, dg); string(got) != string(v) {
			t.Fatalf("value %x decoded to %d %d, which encode to %x", v, fire, dg, got)
		}
	})
}

// TestIngestScratchReuse: buffers handed out again come back zeroed and
// sized to the call, and an oversized envelope arena is not kept.
func TestIngestScratchReuse(t *testing.T) {
	cases := []struct {
		name          string
		n, shards     int
		envCap, ikCap int
	}{
		{"small", 3, 2, 100, 10},
		{"larger than before", 300, 8, 10_000, 3_000},
		{"smaller again", 1, 1, 10, 1},
		{"arena over the pool limit", 2, 2, maxPooledArena + 1, 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			sc := getScratch(c.n, c.shards)
			if len(sc.route) != c.n || len(sc.envEnd) != c.n || len(sc.ikEnd) != c.n || len(sc.acts) != c.n ||
				len(sc.touched) != c.shards || len(sc.pbs) != c.shards {
				t.Fatalf("sizes: route %d envEnd %d ikEnd %d acts %d touched %d pbs %d; want %d tasks, %d shards",
					len(sc.route), len(sc.envEnd), len(sc.ikEnd), len(sc.acts), len(sc.touched), len(sc.pbs), c.n, c.shards)
			}
			for i := range sc.route {
				if sc.route[i] != 0 || sc.envEnd[i] != 0 || sc.ikEnd[i] != 0 || sc.acts[i] != (ingestAction{}) {
					t.Fatalf("task %d: scratch not zeroed", i)
				}
			}
			for i := range sc.touched {
				if sc.touched[i] || sc.pbs[i] != nil {
					t.Fatalf("shard %d: scratch not zeroed", i)
				}
			}
			envs, iks := sc.arenas(c.envCap, c.ikCap)
			if len(envs) != 0 || cap(envs) < c.envCap || len(iks) != 0 || cap(iks) < c.ikCap {
				t.Fatalf("arenas: len %d/%d cap %d/%d", len(envs), len(iks), cap(envs), cap(iks))
			}
			// Dirty everything, as an Ingest call would.
			for i := range sc.route {
				sc.route[i], sc.envEnd[i], sc.ikEnd[i] = 7, 7, 7
				sc.acts[i].seq = 7
			}
			for i := range sc.touched {
				sc.touched[i], sc.pbs[i] = true, &pendingBatch{}
			}
			putScratch(sc)
			if sc.pbs[0] != nil {
				t.Error("pending batches kept alive by the pool")
			}
			if c.envCap > maxPooledArena && sc.envs != nil {
				t.Errorf("arena of %d bytes kept for reuse (limit %d)", cap(sc.envs), maxPooledArena)
			}
		})
	}
}

// TestOpenStoreInUse: Open of a store directory another process holds
// (another delaybridge on the same data_dir) fails with an error that says
// so, not a bare "resource temporarily unavailable". The holder is this
// test binary run again as a child that opens the store and waits.
func TestOpenStoreInUse(t *testing.T) {
	if dir := os.Getenv(holdStoreEnv); dir != "" {
		e, err := Open(Options{Dir: dir, Logger: zap.NewNop()})
		if err != nil {
			fmt.Println("open:", err)
			os.Exit(1)
		}
		fmt.Println("held")
		_, _ = io.Copy(io.Discard, os.Stdin) // until the parent closes stdin
		_ = e.Close()
		os.Exit(0)
	}
	dir := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^TestOpenStoreInUse$")
	cmd.Env = append(os.Environ(), holdStoreEnv+"="+dir)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = stdin.Close(); _ = cmd.Wait() }()
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || line != "held\n" {
		t.Fatalf("child: %q, %v", line, err)
	}
	_, err = Open(Options{Dir: dir, Logger: zap.NewNop()})
	if err == nil || !strings.Contains(err.Error(), "in use by another process") {
		t.Fatalf("Open of a store another process holds = %v, want it in use", err)
	}
}

const holdStoreEnv = "DELAYBRIDGE_HOLD_STORE"

// FuzzMerger feeds the counter and sequence merge operator (which Pebble
// runs on operands read back from disk during reads and compactions)
// arbitrary keys and operands. It never panics; it refuses keys other
// than counters and the sequence, and operands not 8 bytes long; and what
// it accepts merges to the sum (counters) or the maximum (sequence)
// whatever the order and the grouping of the operands.
func FuzzMerger(f *testing.F) {
	f.Add([]byte{prefixCount, 0, 1}, u64(5), append(u64(1<<64-1), u64(3)...), uint8(0))
	f.Add([]byte{prefixSeq}, u64(7), append(u64(9), u64(2)...), uint8(1))
	f.Add([]byte{prefixHeld, 0, 0}, u64(0), []byte{1, 2, 3}, uint8(2))
	f.Add([]byte{prefixTask}, u64(1), []byte{}, uint8(3))
	f.Add([]byte{}, []byte{}, []byte{}, uint8(0))
	f.Fuzz(func(t *testing.T, key, first, rest []byte, order uint8) {
		m, err := merger.Merge(key, first)
		okKey := len(key) > 0 && (key[0] == prefixCount || key[0] == prefixHeld || key[0] == prefixSeq)
		if !okKey || len(first) != 8 {
			if err == nil {
				t.Fatalf("Merge(%x, %x) accepted", key, first)
			}
			return
		}
		if err != nil {
			t.Fatalf("Merge(%x, %x): %v", key, first, err)
		}
		combine := func(a, b uint64) uint64 {
			if key[0] == prefixSeq {
				return max(a, b)
			}
			return a + b
		}
		want := binary.BigEndian.Uint64(first)
		var ops [][]byte
		for len(rest) > 0 {
			n := min(len(rest), 8)
			ops = append(ops, rest[:n])
			rest = rest[n:]
		}
		for i, op := range ops {
			var err error
			if (int(order)>>(i%8))&1 == 0 {
				err = m.MergeNewer(op)
			} else {
				err = m.MergeOlder(op)
			}
			if (err != nil) != (len(op) != 8) {
				t.Fatalf("operand %x: err %v", op, err)
			}
			if err != nil {
				return // refused, as it should be
			}
			want = combine(want, binary.BigEndian.Uint64(op))
		}
		got, closer, err := m.Finish(true)
		if err != nil || closer != nil {
			t.Fatalf("Finish: %v", err)
		}
		if string(got) != string(u64(want)) {
			t.Fatalf("merged %x, want %x", got, u64(want))
		}
		// A partial merge (compaction) then a full one gives the same.
		if len(ops) > 1 {
			m1, _ := merger.Merge(key, first)
			for _, op := range ops[:len(ops)/2] {
				_ = m1.MergeNewer(op)
			}
			part, _, _ := m1.Finish(false)
			m2, err := merger.Merge(key, part)
			if err != nil {
				t.Fatalf("partial merge result %x refused: %v", part, err)
			}
			for _, op := range ops[len(ops)/2:] {
				_ = m2.MergeNewer(op)
			}
			if got2, _, _ := m2.Finish(true); string(got2) != string(got) {
				t.Fatalf("partial then full merge %x, full %x", got2, got)
			}
		}
	})
}
