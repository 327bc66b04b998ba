package kafka

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

const unstoredMsg = "the store holds no checkpoint of it"

// TestStoreWithoutGroupsCheckpointLogged: a bridge started on a new store
// (data_dir changed, its volume replaced or wiped) while its group had
// committed offsets read on from them in silence, though the tasks the old
// store held were not in the new one. It is now an error line, once per
// partition, naming the committed offset; the source still reads on from
// it. A group without commits on a new store is a first start: no line.
func TestStoreWithoutGroupsCheckpointLogged(t *testing.T) {
	t0 := time.Now().Add(-time.Hour).Truncate(time.Second)
	c := newCluster(t, kfake.SeedTopics(2, "delay"))
	cl := producer(t, c)
	first := gen{"a", 10, t0}
	produce(t, cl, first.records("delay", 0)...)

	// A first start: no commits, no checkpoints.
	firstCore, firstLogs := observer.New(zap.InfoLevel)
	old := newMemHandler()
	runLogged(t, c, old, loggedFresh(firstCore), 10, 10)
	if n := firstLogs.FilterMessageSnippet(unstoredMsg).Len(); n != 0 {
		t.Fatalf("a first start logged %d %q lines, want none", n, unstoredMsg)
	}

	// The same group on an empty store: partition 0 was read up to 10,
	// partition 1 never (no commit).
	core, logs := observer.New(zap.InfoLevel)
	fresh := newMemHandler()
	more := gen{"b", 2, t0}
	produce(t, cl, more.records("delay", 10)...)
	runLogged(t, c, fresh, loggedFresh(core), 2, 12)
	if got := fresh.offsets("delay")[0]; !slices.Equal(got, []int64{10, 11}) {
		t.Fatalf("the new store took in offsets %v, want 10 and 11 (read on from the committed offset)", got)
	}
	l := logs.FilterMessageSnippet(unstoredMsg).All()
	if len(l) != 1 || l[0].Level != zap.ErrorLevel || l[0].ContextMap()["committed"] != int64(10) || l[0].ContextMap()["partition"] != int64(0) {
		t.Fatalf("logged %+v, want one error for partition 0 at committed offset 10", l)
	}
}

// TestRestartAfterOnlyAbortedNotLogged (review R161): a partition that so
// far holds only an aborted transaction and its marker is committed past
// them with no checkpoint stored. A restart on that store, which is not
// fresh, must not take it for another store's partition.
func TestRestartAfterOnlyAbortedNotLogged(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	txn := producer(t, c, kgo.TransactionalID("tx"))
	if err := txn.BeginTransaction(); err != nil {
		t.Fatal(err)
	}
	produce(t, txn, &kgo.Record{Topic: "delay", Value: []byte("t0")}, &kgo.Record{Topic: "delay", Value: []byte("t1")})
	if err := txn.EndTransaction(context.Background(), kgo.TryAbort); err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.InfoLevel)
	h := newMemHandler()
	runLogged(t, c, h, loggedFresh(core), 0, 3) // past the aborted records and their marker
	produce(t, producer(t, c), &kgo.Record{Topic: "delay", Value: []byte("r3")})
	runLogged(t, c, h, func(cfg *Config) { cfg.Logger = zap.New(core) }, 1, 4) // a restart on the same store
	if l := logs.FilterMessageSnippet(unstoredMsg).All(); len(l) != 0 {
		t.Fatalf("a restart on the same store logged %+v", l)
	}
}

// loggedFresh sets a source up on a store created by this start, logging
// to core.
func loggedFresh(core zapcore.Core) func(*Config) {
	return func(cfg *Config) { cfg.Logger, cfg.FreshStore = zap.New(core), true }
}

// runLogged is consume with the source's config changed by mod (nil: as
// testConfig makes it).
func runLogged(t *testing.T, c *kfake.Cluster, h *memHandler, mod func(*Config), want int, commitTo int64) {
	t.Helper()
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
	if mod != nil {
		mod(&cfg)
	}
	s, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop := runSource(t, s, h)
	waitFor(t, fmt.Sprintf("%d messages", want), func() bool { return h.count() >= want })
	waitFor(t, fmt.Sprintf("commit %d", commitTo), func() bool { return committed(c, "g", "delay")[0] == commitTo })
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
}
