package kafka

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/delaybridge/delaybridge/codec"
)

// TestStuckBrokerDoesNotHoldHealthyOnes (review R186): a broker that takes
// produce requests and does not answer (a disk stall, a GC pause) holds
// the requests for the partitions it leads until WriteTimeout. Deliveries
// to topics another broker leads should not wait for it.
func TestStuckBrokerDoesNotHoldHealthyOnes(t *testing.T) {
	const stuckNode, healthyNode = 0, 1
	var stuck []string
	for i := range 64 {
		stuck = append(stuck, fmt.Sprintf("stuck-%d", i))
	}
	c := newCluster(t, kfake.NumBrokers(2), kfake.SeedTopics(1, append(stuck, "healthy")...))
	for _, tp := range stuck {
		if err := c.MoveTopicPartition(tp, 0, stuckNode); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.MoveTopicPartition("healthy", 0, healthyNode); err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	var once sync.Once
	unstick := func() { once.Do(func() { close(release) }) }
	t.Cleanup(unstick) // before the cluster closes (cleanups run last first)
	var held atomic.Int32
	heldAll := make(chan struct{})
	c.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if c.CurrentNode() == stuckNode {
			if held.Add(1) == int32(len(stuck)) {
				close(heldAll)
			}
			c.SleepControl(func() { <-release })
		}
		return nil, nil, false
	})

	cfg := testConfig(t, c.ListenAddrs(), "")
	cfg.WriteTimeout = 3 * time.Second
	cfg.WriteAttempts = 1
	s, err := NewSink(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()

	stuckDone := make(chan []error, 1)
	go func() {
		var batch []*codec.Task
		for _, tp := range stuck {
			batch = append(batch, task(tp, "k", "v"))
		}
		stuckDone <- s.Deliver(context.Background(), batch)
	}()
	select {
	case <-heldAll:
	case <-time.After(30 * time.Second):
		t.Fatalf("only %d produce requests reached the stuck broker", held.Load())
	}

	began := time.Now()
	errs := s.Deliver(context.Background(), []*codec.Task{task("healthy", "k", "v")})
	took := time.Since(began)
	t.Logf("healthy delivery: %v after %v", errs, took)
	if errs != nil {
		t.Errorf("a task for a topic of a healthy broker failed while another broker was stuck: %v", errors.Join(errs...))
	}
	// The healthy broker answers in milliseconds; half of WriteTimeout is
	// far more than it takes, and less than waiting for a stuck request
	// to time out.
	if took > cfg.WriteTimeout/2 {
		t.Errorf("a task for a topic of a healthy broker took %v (WriteTimeout %v): it waited for the stuck broker's requests", took, cfg.WriteTimeout)
	}
	unstick()
	<-stuckDone
}
