package service

import (
	"strings"
	"testing"

	"github.com/twmb/franz-go/pkg/kfake"
)

// TestMissingSourceTopicAtStartWaits: a delay topic that does not exist
// yet at start must not end the process (the Kafka source is built to wait
// for it, not ready); once it is created the bridge becomes ready.
func TestMissingSourceTopicAtStartWaits(t *testing.T) {
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "delay.dlq"))
	if err != nil {
		t.Fatal(err)
	}
	defer kc.Close()
	svc, cancel, errc := runKafkaOnly(t, kc.ListenAddrs(), Options{})
	// Not ready, naming the topic, and still running.
	running := func() {
		select {
		case err := <-errc:
			t.Fatalf("Run returned while the source topic is missing: %v", err)
		default:
		}
	}
	eventually(t, "not ready, naming the missing topic", func() bool {
		running()
		err := svc.Ready()
		return err != nil && strings.Contains(err.Error(), "source topic does not exist: delay")
	})
	if err := kc.CreateTopic("delay", 1, nil); err != nil {
		t.Fatal(err)
	}
	eventually(t, "ready after the topic was created", func() bool {
		running()
		return svc.Ready() == nil
	})
	cancel()
	if err := <-errc; err != nil {
		t.Fatalf("Run: %v", err)
	}
}
