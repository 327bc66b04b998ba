package shard

import (
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/codec"
)

// storeOutageHarness: 8 shards (the default) whose store's reads
// (sstables, blob files) fail while readFail is set and whose WAL syncs
// and writes fail while writeFail is, with 8 tasks due each second for
// 200 s from t0 (in sstables, no block cached), the fire loops running,
// and an observed logger.
func storeOutageHarness(t *testing.T) (h *harness, logs *observer.ObservedLogs, readFail, writeFail *atomic.Bool) {
	readFail, writeFail = new(atomic.Bool), new(atomic.Bool)
	fs := errorfs.Wrap(vfs.Default, errorfs.InjectorFunc(func(op errorfs.Op) error {
		if readFail.Load() && op.Kind == errorfs.OpFileReadAt && (strings.HasSuffix(op.Path, ".sst") || strings.HasSuffix(op.Path, ".blob")) {
			return errors.New("injected read error")
		}
		if writeFail.Load() && strings.HasSuffix(op.Path, ".log") && (op.Kind == errorfs.OpFileSync || op.Kind == errorfs.OpFileSyncData || op.Kind == errorfs.OpFileWrite) {
			return errors.New("injected sync error")
		}
		return nil
	}))
	core, logs := observer.New(zap.InfoLevel)
	h = newHarness(t, func(o *Options) {
		o.Shards = 8
		o.FS = fs
		o.Logger = zap.New(core)
	})
	var tasks []codec.Task
	for i := range 8 * 200 {
		tasks = append(tasks, sched(fmt.Sprintf("t%04d", i), t0.Add(time.Duration(i/8)*time.Second), int64(i+1)))
	}
	h.ingest(tasks)
	h.close()                  // flushes: the tasks are read from sstables
	h.opts.noBlockCache = true // every round reads from the files
	h.open()
	h.run()
	h.advance(10 * time.Second)
	logs.TakeAll()
	return h, logs, readFail, writeFail
}

// linesOf counts the observed lines by message.
func linesOf(logs *observer.ObservedLogs) map[string]int {
	n := map[string]int{}
	for _, l := range logs.TakeAll() {
		n[l.Message]++
	}
	return n
}

// TestStoreOutageLinesOncePerEngine: a store whose reads fail for 2
// minutes, with tasks coming due all the time in every shard, logged
// "fire loop: store read failed" once per shard and round, a round a
// second: 957 lines with 8 shards, and nothing when it ended. It is
// logged once per engine, then once per 30 s (per error text) with the
// lines held back and the shards affected, and one line says when it is
// over; a sticky write failure's "fire: commit failed" goes once per
// engine, not once per shard with a commit in flight (5 lines).
func TestStoreOutageLinesOncePerEngine(t *testing.T) {
	t.Run("reads", func(t *testing.T) {
		h, logs, readFail, _ := storeOutageHarness(t)
		readFail.Store(true)
		for range 120 {
			h.advance(time.Second)
		}
		all := logs.TakeAll()
		n, heldBack := 0, int64(0)
		var shards []int
		for _, l := range all {
			if l.Message != msgFireReadFailed {
				continue
			}
			n++
			f := l.ContextMap()
			t.Logf("%s %s %v", l.Time.Format(time.TimeOnly), l.Message, f)
			hb, _ := f["held_back"].(int64)
			heldBack += hb
			if s, ok := f["shards_affected"].([]interface{}); ok {
				shards = shards[:0]
				for _, v := range s {
					shards = append(shards, v.(int))
				}
			}
		}
		t.Logf("during the outage: %d %q lines, %d held back, shards affected %v", n, msgFireReadFailed, heldBack, shards)
		// Two error texts (a load's, a read of claimed tasks'), each at
		// its start and then once per 30 s.
		if n == 0 || n > 2*(120/30+1) {
			t.Fatalf("%d %q lines in a 2 min read outage of 8 shards; want one per engine and 30 s per error text", n, msgFireReadFailed)
		}
		if heldBack == 0 || len(shards) < 2 {
			t.Fatalf("held back %d lines, shards affected %v; want the count and the shards", heldBack, shards)
		}
		readFail.Store(false)
		for range 60 {
			h.advance(time.Second)
		}
		for _, l := range logs.FilterMessageSnippet("store failure over").All() {
			t.Logf("%s %s %v", l.Time.Format(time.TimeOnly), l.Message, l.ContextMap())
		}
		after := linesOf(logs)
		if got := after["store failure over: every shard that failed does it again without error"]; got != 1 || after[msgFireReadFailed] != 0 {
			t.Fatalf("after the outage: %v; want one line saying it is over", after)
		}
	})
	t.Run("sticky write failure", func(t *testing.T) {
		h, logs, _, writeFail := storeOutageHarness(t)
		writeFail.Store(true)
		deadline := time.Now().Add(10 * time.Second)
		for h.e.failed() == nil && time.Now().Before(deadline) {
			h.clk.Advance(time.Second)
			time.Sleep(time.Millisecond)
		}
		if h.e.failed() == nil {
			t.Fatal("the store never failed")
		}
		for range 30 {
			h.clk.Advance(time.Second)
		}
		h.close()
		if n := linesOf(logs)[msgFireCommitFailed]; n == 0 || n > 2 {
			t.Fatalf("%d %q lines for a sticky write failure; want one per engine (per error text: fire, retry)", n, msgFireCommitFailed)
		}
	})
}
