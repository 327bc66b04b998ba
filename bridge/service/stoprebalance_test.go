package service

import (
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kmsg"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/bridge/kafka"
	"github.com/delaybridge/delaybridge/config"
)

// TestStopDuringRebalance: a bridge stopped while its group's rebalance
// waits on the coordinator (a second member joined; JoinGroup answered
// only when the rebalance completes, up to the rebalance timeout of 30 s)
// stops without waiting for that answer. Its partition workers committed
// when the generation ended, so nothing is in flight; before, closing the
// group waited for the join, which took the whole shutdown_timeout from
// the fire loops and the store's flush (hunt H122).
func TestStopDuringRebalance(t *testing.T) {
	e := newEnv(t, "shutdown_timeout: 10s\n")
	e.mutate = func(c *config.Config) { c.NATS = nil }
	defaults := func(c *kafka.Config) { c.MaxWait = 50 * time.Millisecond } // kafka-go's group timeouts
	core, logs := observer.New(zap.WarnLevel)
	svcA, cancelA, doneA := e.runWith(Options{Kafka: defaults, Logger: zap.New(core)})
	for i := range 30 {
		e.publishKafka(int32(i%3), time.Time{}, []byte("a"+strconv.Itoa(i)), []byte("a"+strconv.Itoa(i)), "delay-after", "1h", "delay-target", kafkaOut)
	}
	waitIngested(t, svcA, 30) // A is in the group, its generation running
	e.dataDir = t.TempDir()   // B's own store
	gi := e.kc.GroupInfo("bridge")
	if gi == nil || len(gi.Members) != 1 {
		t.Fatalf("group before B: %+v, want A alone", gi)
	}
	memberA := gi.Members[0].MemberID
	// A's next join waits on the coordinator, as in a rebalance that waits
	// for a slow member (up to the rebalance timeout); B's goes through.
	release := make(chan struct{})
	t.Cleanup(func() { close(release) })
	var held atomic.Int32
	e.kc.ControlKey(int16(kmsg.JoinGroup), func(req kmsg.Request) (kmsg.Response, error, bool) {
		e.kc.KeepControl()
		if req.(*kmsg.JoinGroupRequest).MemberID != memberA {
			return nil, nil, false
		}
		held.Add(1)
		e.kc.SleepControl(func() { <-release })
		return nil, nil, false
	})
	e.runWith(Options{Kafka: defaults}) // B joins: A is told to join again
	deadline := time.Now().Add(30 * time.Second)
	for held.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("A did not join again after B joined")
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancelA()
	select {
	case err := <-doneA:
		if err != nil {
			t.Errorf("Run: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return")
	}
	for _, msg := range []string{"sources did not stop in time", "fire loops did not stop in time"} {
		if n := logs.FilterMessageSnippet(msg).Len(); n != 0 {
			t.Errorf("logged %q: the stop waited for the coordinator's answer to the join", msg)
		}
	}
	if logs.FilterMessageSnippet("a join in flight holds it").Len() != 1 {
		t.Errorf("no line saying the group was left without waiting for the join in flight: %v", logs.All())
	}
}
