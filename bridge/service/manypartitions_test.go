package service

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

func growDelay(t *testing.T, e *env, topic string, count int32) {
	t.Helper()
	req := kmsg.NewPtrCreatePartitionsRequest()
	rt := kmsg.NewCreatePartitionsRequestTopic()
	rt.Topic, rt.Count = topic, count
	req.Topics = append(req.Topics, rt)
	req.TimeoutMillis = 5000
	resp, err := req.RequestWith(context.Background(), e.kcl)
	if err != nil || resp.Topics[0].ErrorCode != 0 {
		t.Fatalf("create partitions: %v %+v", err, resp)
	}
}

func (e *env) publishMany(parts int32, from, n int) {
	e.t.Helper()
	rs := make([]*kgo.Record, 0, n)
	for i := from; i < from+n; i++ {
		d := (i * 37) % 2001 // 0..2000 ms
		rs = append(rs, &kgo.Record{Topic: kafkaDelay, Partition: int32(i*7919) % parts,
			Key: []byte("key-" + strconv.Itoa(i)), Value: []byte("m" + strconv.Itoa(i)), Timestamp: e.clk.Now(),
			Headers: []kgo.RecordHeader{{Key: "delay-after", Value: []byte(strconv.Itoa(d))}, {Key: "delay-target", Value: []byte("orders")}}})
	}
	if err := e.kcl.ProduceSync(context.Background(), rs...).FirstErr(); err != nil {
		e.t.Fatal(err)
	}
}

// TestManyPartitionsRestart (hunt H193): 3000 delays of 0-2 s over a
// 128-partition delay topic, the bridge stopped and restarted halfway:
// each delivered once, every partition's offset committed to its end.
func TestManyPartitionsRestart(t *testing.T) {
	const parts = 128
	e := newEnv(t, "")
	growDelay(t, e, kafkaDelay, parts)
	svc, stop := e.start()
	e.publishMany(parts, 0, 1500)
	e.waitAll(svc, 1500)
	e.clk.Advance(time.Second)
	e.settle(svc)
	stop()
	e.publishMany(parts, 1500, 1500)
	svc, stop = e.start()
	e.waitAll(svc, 3000)
	e.advance(svc, 3*time.Second, 500*time.Millisecond)
	e.advanceUntil("all", func(ds []delivery) bool { return len(byValue(ds, "orders")) >= 3000 })
	e.settle(svc)
	got := e.deliveries()
	for v, ds := range byValue(got, "orders") {
		if len(ds) != 1 {
			t.Errorf("%s delivered %d times", v, len(ds))
		}
	}
	if n := len(byValue(got, "orders")); n != 3000 {
		t.Errorf("%d distinct deliveries, want 3000", n)
	}
	stop()
	gi := e.kc.GroupInfo("bridge")
	for p := range int32(parts) {
		want := int64(0)
		for i := range 3000 {
			if int32(i*7919)%parts == p {
				want++
			}
		}
		if gi.Commits[kafkaDelay][p].Offset != want {
			t.Errorf("partition %d committed %d want %d", p, gi.Commits[kafkaDelay][p].Offset, want)
		}
	}
}

func (e *env) waitAll(svc *Service, n int) {
	e.t.Helper()
	eventually(e.t, "ingest", func() bool {
		return svc.Engine().Stats().Pending+int64(len(byValue(e.deliveries(), "orders"))) >= int64(n)
	})
}
