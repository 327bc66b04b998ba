package service

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/delaybridge/delaybridge/config"
	"github.com/delaybridge/delaybridge/shard"
)

// TestStoreReserveHoldsIngest: with less free on data_dir's volume than
// store.reserve_mb, the bridge takes no message in: it is not ready,
// naming the reserve, but live; a Kafka and a NATS message are neither
// stored nor committed or acked, their sources retrying. Restarted with
// the reserve off, it takes both in and delivers them.
func TestStoreReserveHoldsIngest(t *testing.T) {
	e := newEnv(t, "store: {reserve_mb: 16777216}\n") // 16 TiB: more than the test volume has free
	svc, stop := e.start()
	e.publishKafka(0, time.Time{}, []byte("k"), []byte("kafka"), "delay-after", "1s", "delay-target", kafkaOut)
	e.publishNATS("delay.a", []byte("nats"), "delay-after", "1s", "delay-target", "nats:orders.a")
	eventually(t, "both sources' batches refused", func() bool {
		return testutil.ToFloat64(svc.m.SourceErrors.WithLabelValues(kafkaDelay)) > 0 &&
			testutil.ToFloat64(svc.m.SourceErrors.WithLabelValues("DELAY")) > 0
	})
	err := svc.Ready()
	if !errors.Is(err, shard.ErrStoreLowSpace) || !strings.Contains(err.Error(), "store volume low on space") ||
		!strings.Contains(err.Error(), "reserve 16777216 MiB") {
		t.Fatalf("Ready() = %v, want the reserve named", err)
	}
	if err := svc.Live(); err != nil {
		t.Fatalf("Live() = %v: the reserve clears without a restart", err)
	}
	if n := svc.Engine().Stats().Pending; n != 0 {
		t.Fatalf("%d tasks stored below the reserve", n)
	}
	if off := e.committedOffset(0); off != -1 {
		t.Fatalf("offset %d committed below the reserve", off)
	}
	stop()

	e.mutate = func(c *config.Config) { c.Store.ReserveMB = 0 }
	e.start()
	e.advanceUntil("both delivered", func(ds []delivery) bool {
		var kafka, nats bool
		for _, d := range ds {
			kafka = kafka || d.value == "kafka"
			nats = nats || d.value == "nats"
		}
		return kafka && nats
	})
}
