package service

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"
	"go.uber.org/zap/zaptest"

	"github.com/delaybridge/delaybridge/internal/faultfs"
	"github.com/delaybridge/delaybridge/internal/testlog"
	"github.com/delaybridge/delaybridge/shard"
)

// TestShutdownWithStoreWriteStalled: the disk fills up, so the store can
// no longer flush (sstable and blob writes fail with ENOSPC) while its WAL
// still takes writes; once both memtables are full every write waits,
// and an Ingest with it. The bridge says so (not ready, naming the
// stall), and SIGTERM still ends Run: the store's close, which would wait
// for that Ingest, is left to the process exit past shutdown_timeout.
// With the disk freed, a restart holds every task.
func TestShutdownWithStoreWriteStalled(t *testing.T) {
	e := newEnv(t, "shutdown_timeout: 3s\nstore: {cache_mb: 64, memtable_mb: 4}\n")
	toggle := faultfs.FullDisk(".sst", ".blob")
	defer toggle.Off() // a failing test's store closes
	svc, cancel, done := e.runWith(Options{FS: errorfs.Wrap(vfs.Default, toggle)})
	toggle.On()
	val := bytes.Repeat([]byte("v"), 60<<10)
	const n = 250 // 15 MB: well past two 4 MB memtables
	for i := range n {
		e.publishKafka(int32(i%3), time.Time{}, []byte(fmt.Sprint("k", i)), val, "delay-after", "1h", "delay-target", kafkaOut)
	}
	eventually(t, "not ready for the stall", func() bool { return errors.Is(svc.Ready(), shard.ErrStoreStalled) })
	if !strings.Contains(svc.Ready().Error(), "no space left on device") {
		t.Fatalf("Ready() = %v, want the flush's error named", svc.Ready())
	}
	if err := svc.Live(); err != nil {
		t.Fatalf("Live() = %v: a stall ends when space is freed, without a restart", err)
	}
	cancel() // SIGTERM
	select {
	case err := <-done:
		t.Logf("Run returned %v", err)
	case <-time.After(30 * time.Second): // turns a hang into a failure
		t.Fatal("Run did not return 30 s after SIGTERM with shutdown_timeout 3s")
	}
	// The disk is freed: the stalled write completes and the store left
	// behind closes. A restart on the same data dir holds every task.
	toggle.Off()
	var svc2 *Service
	var err error
	eventually(t, "reopened", func() bool {
		svc2, err = New(context.Background(), e.config(), Options{
			Logger: testlog.New(t, zaptest.Level(testLogLevel())), Clock: e.clk, Kafka: fastKafka, NATS: fastNATS})
		return err == nil
	})
	ctx2, cancel2 := context.WithCancel(context.Background())
	done2 := make(chan error, 1)
	go func() { done2 <- svc2.Run(ctx2) }()
	eventually(t, "every task pending", func() bool { return svc2.Engine().Stats().Pending == n })
	cancel2()
	if err := <-done2; err != nil {
		t.Fatal(err)
	}
}
