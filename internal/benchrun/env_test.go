package benchrun

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// The in-process Kafka broker of bench (and dev) runs with small segments:
// kfake grows an in-memory segment by doubling, and copying a large one
// stalled the broker (see KfakeSegmentBytes).
func TestKafkaBrokerSegmentBytes(t *testing.T) {
	b, err := startBroker(Kafka, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer b.close()
	cl, err := kgo.NewClient(kgo.SeedBrokers(b.addr()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// kfake answers a topic's describe with the default segment.bytes
	// and the broker's own value under its broker name.
	req := kmsg.NewPtrDescribeConfigsRequest()
	res := kmsg.NewDescribeConfigsRequestResource()
	res.ResourceType = kmsg.ConfigResourceTypeBroker
	res.ResourceName = "0"
	res.ConfigNames = []string{"log.segment.bytes"}
	req.Resources = append(req.Resources, res)
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		t.Fatal(err)
	}
	var got string
	for _, r := range resp.Resources {
		if r.ErrorCode != 0 {
			t.Fatalf("describe broker %s: error code %d", r.ResourceName, r.ErrorCode)
		}
		for _, c := range r.Configs {
			if c.Name == "log.segment.bytes" && c.Value != nil {
				got = *c.Value
			}
		}
	}
	if want := strconv.Itoa(KfakeSegmentBytes); got != want {
		t.Errorf("log.segment.bytes = %q, want %s", got, want)
	}
}
