package shard

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/cockroachdb/pebble/v2"

	"github.com/delaybridge/delaybridge/codec"
)

// dlWaitRecords returns the prefixDLWait records in the store, by seq.
func dlWaitRecords(t *testing.T, e *Engine) map[uint64][]string {
	t.Helper()
	it, err := e.db.NewIter(&pebble.IterOptions{LowerBound: []byte{prefixDLWait}, UpperBound: []byte{prefixDLWait + 1}})
	if err != nil {
		t.Fatal(err)
	}
	defer it.Close()
	out := make(map[uint64][]string)
	for it.First(); it.Valid(); it.Next() {
		_, seq, _, keys, err := parseDLWait(it.Key(), it.Value())
		if err != nil {
			t.Fatalf("record %x: %v", it.Key(), err)
		}
		out[seq] = keys
	}
	return out
}

// awaitAsync runs AwaitStored in the background.
func awaitAsync(e *Engine, key string) chan error {
	ch := make(chan error, 1)
	go func() { ch <- e.AwaitStored(context.Background(), key) }()
	return ch
}

func pendingErr(ch chan error) (error, bool) {
	select {
	case err := <-ch:
		return err, true
	default:
		return nil, false
	}
}

// The wait for a batch's dead letters outlives its Handle and the process
// (CONTRACT §3): a source that starts reading a checkpoint key again, after
// a restart or after its Handle gave up (a rebalance), waits with
// AwaitStored until the DLQ took that key's dead letters or parked them.
// Another key does not wait; a dead letter the DLQ took leaves no record;
// dead letters of a batch without checkpoints and those of failed
// publishes are awaited by no source and get none.
func TestDeadLetterHoldSurvivesRestart(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t, func(o *Options) {
		o.Shards = 2
		o.Retry = parkPolicy
	})
	refusal := fmt.Errorf("kafka: publish to \"dlq\": %w: message too large", ErrRefused)
	denied := errors.New("kafka: publish to \"dlq\": TOPIC_AUTHORIZATION_FAILED")
	h.sink.setFail(func(t *codec.Task) error {
		switch {
		case t.ID == "held", t.ID == "nocp":
			return denied
		case t.ID == "big":
			return refusal
		case t.ID == "pf" && t.Kind == codec.KindSchedule:
			return errors.New("target down")
		}
		return nil
	})
	h.run()
	ingest := func(task codec.Task, key string, off int64) *DeadLetters {
		t.Helper()
		var cps []Checkpoint
		if key != "" {
			cps = []Checkpoint{{Key: key, Offset: off}, {Key: key + "|extra", Offset: 1}}
		}
		d, err := h.e.IngestAwait(ctx, []codec.Task{task}, cps)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	ingest(sched("pf", t0, 5), "k5", 5)
	h.settle()
	h.advanceUntil("pf dead-lettered", func() bool {
		for _, d := range h.sink.all() {
			if d.ID == "pf" && d.Kind == codec.KindDeadLetter && d.Err == nil {
				return true
			}
		}
		return false
	})
	if n := h.e.AwaitedDeadLetters("k5"); n != 0 {
		t.Fatalf("the dead letter of a failed publish is awaited by %d sources", n)
	}
	dHeld := ingest(deadLetter("held", 1), "k1", 1)
	ingest(deadLetter("big", 2), "k2", 2)
	ingest(deadLetter("ok", 3), "k3", 3)
	ingest(deadLetter("nocp", 4), "", 0)
	h.settle()

	// The Handle of k1 gives up (its source stopped): k1 is still held.
	stopped, cancel := context.WithCancel(ctx)
	cancel()
	if err := dHeld.Wait(stopped); err == nil {
		t.Fatal("Wait returned nil while the DLQ refuses the dead letter")
	}
	if n := h.e.AwaitedDeadLetters("k1"); n != 1 {
		t.Fatalf("k1 awaits %d dead letters after its Handle gave up, want 1", n)
	}
	if err := h.e.AwaitStored(stopped, "k1"); !errors.Is(err, context.Canceled) {
		t.Fatalf("AwaitStored(k1) with a cancelled ctx = %v, want context.Canceled", err)
	}

	h.stop()
	h.reopen()
	recs := dlWaitRecords(t, h.e)
	if len(recs) != 2 {
		t.Fatalf("awaited dead-letter records after the restart: %v, want those of held and big", recs)
	}
	for _, keys := range recs {
		if len(keys) != 2 || !strings.HasSuffix(keys[1], "|extra") {
			t.Fatalf("record names keys %q, want the batch's two checkpoint keys", keys)
		}
	}
	for key, want := range map[string]int{"k1": 1, "k1|extra": 1, "k2": 1, "k3": 0, "k5": 0, "other": 0} {
		if got := h.e.AwaitedDeadLetters(key); got != want {
			t.Errorf("after the restart %s awaits %d dead letters, want %d", key, got, want)
		}
	}
	if err := h.e.AwaitStored(stopped, "other"); err != nil {
		t.Fatalf("AwaitStored of a key without dead letters = %v, want nil at once", err)
	}
	w1, w2 := awaitAsync(h.e, "k1"), awaitAsync(h.e, "k2")
	h.run()
	h.advanceUntil("the park of big", func() bool { return h.e.AwaitedDeadLetters("k2") == 0 })
	if err := <-w2; err != nil {
		t.Fatalf("AwaitStored(k2) after the park = %v", err)
	}
	if err, done := pendingErr(w1); done {
		t.Fatalf("AwaitStored(k1) returned %v while its DLQ refuses it as a whole", err)
	}
	if recs := dlWaitRecords(t, h.e); len(recs) != 1 {
		t.Fatalf("records after the park: %v, want only held's", recs)
	}
	if h.e.Err() == nil {
		t.Fatal("Err is nil while a dead letter is held and one parked")
	}
	h.sink.setFail(nil)
	h.advanceUntil("held delivered", func() bool { return h.sink.deliveriesOf("held") > 0 && h.e.AwaitedDeadLetters("k1") == 0 })
	if err := <-w1; err != nil {
		t.Fatalf("AwaitStored(k1) after the DLQ took it = %v", err)
	}
	h.settle()
	if recs := dlWaitRecords(t, h.e); len(recs) != 0 {
		t.Fatalf("records after every dead letter was delivered or parked: %v", recs)
	}
	h.stop()
	h.reopen()
	if n := h.e.AwaitedDeadLetters("k1") + h.e.AwaitedDeadLetters("k2"); n != 0 {
		t.Fatalf("%d dead letters awaited after a restart with none recorded", n)
	}
}

// A record that does not decode and one whose
// dead letter is not stored are dropped at open, and hold nothing.
func TestDLWaitStaleRecords(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.Shards = 2 })
	for _, kv := range [][2][]byte{
		{dlWaitKey(0, 7), appendDLWait(nil, 5, []string{"gone"})},
		{dlWaitKey(1, 8), []byte{1, 2, 3}},
	} {
		if err := h.e.db.Set(kv[0], kv[1], pebble.Sync); err != nil {
			t.Fatal(err)
		}
	}
	h.reopen()
	if n := h.e.AwaitedDeadLetters("gone"); n != 0 {
		t.Fatalf("a record without its dead letter holds %d", n)
	}
	if recs := dlWaitRecords(t, h.e); len(recs) != 0 {
		t.Fatalf("stale records left: %v", recs)
	}
}

func TestDLWaitRecord(t *testing.T) {
	k := dlWaitKey(3, 42)
	good := appendDLWait(nil, 1234, []string{"kafka|t|0", "x"})
	sh, seq, fire, keys, err := parseDLWait(k, good)
	if err != nil || sh != 3 || seq != 42 || fire != 1234 || len(keys) != 2 || keys[0] != "kafka|t|0" || keys[1] != "x" {
		t.Fatalf("parseDLWait(good) = %d %d %d %q %v", sh, seq, fire, keys, err)
	}
	bigFire := appendDLWait(nil, 0, []string{"a"})
	copy(bigFire, []byte{0x80, 0, 0, 0, 0, 0, 0, 0})
	tooMany := appendDLWait(nil, 1, nil)
	tooMany[9] = dlWaitMaxKeys + 1
	for name, c := range map[string][2][]byte{
		"short key":      {k[:10], good},
		"other prefix":   {dlFailureKey(3, 42), good},
		"empty value":    {k, nil},
		"no keys":        {k, appendDLWait(nil, 1, nil)},
		"too many keys":  {k, tooMany},
		"empty key":      {k, appendDLWait(nil, 1, []string{""})},
		"truncated key":  {k, good[:len(good)-1]},
		"truncated len":  {k, good[:len(good)-2]},
		"trailing bytes": {k, append(append([]byte(nil), good...), 0)},
		"fire overflow":  {k, bigFire},
	} {
		if _, _, _, _, err := parseDLWait(c[0], c[1]); !errors.Is(err, errDLWaitRecord) {
			t.Errorf("%s: err %v, want errDLWaitRecord", name, err)
		}
	}
	if keys := dlWaitKeys([]Checkpoint{{Key: "a"}, {Key: ""}, {Key: "a"}, {Key: strings.Repeat("x", math.MaxUint16+1)}, {Key: "b"}, {Key: "c", Aside: true}}); len(keys) != 2 || keys[0] != "a" || keys[1] != "b" {
		t.Fatalf("dlWaitKeys = %q, want [a b] (not c, kept aside)", keys)
	}
}

// FuzzParseDLWait: an awaited-dead-letter record read back from the store
// never panics the decoder, and an accepted one is exactly the encoding of
// what it decoded to.
func FuzzParseDLWait(f *testing.F) {
	f.Add(dlWaitKey(2, 7), appendDLWait(nil, 1234, []string{"kafka|t|3", "nats-incarnation|s"}))
	f.Add(dlWaitKey(0, 0), appendDLWait(nil, 0, []string{"k"}))
	f.Add([]byte{prefixDLWait}, []byte{})
	f.Fuzz(func(t *testing.T, k, v []byte) {
		sh, seq, fire, keys, err := parseDLWait(k, v)
		if err != nil {
			if !errors.Is(err, errDLWaitRecord) {
				t.Fatalf("error %v does not wrap errDLWaitRecord", err)
			}
			return
		}
		if got := dlWaitKey(sh, seq); string(got) != string(k) {
			t.Fatalf("key %x decoded to shard %d seq %d, which encode to %x", k, sh, seq, got)
		}
		if got := appendDLWait(nil, fire, keys); string(got) != string(v) {
			t.Fatalf("value %x decoded to %d %q, which encode to %x", v, fire, keys, got)
		}
	})
}
