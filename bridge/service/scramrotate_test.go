package service

import (
	"context"
	"crypto/pbkdf2"
	"crypto/rand"
	"crypto/sha256"
	"fmt"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"github.com/twmb/franz-go/pkg/sasl/scram"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/internal/clock"
	"github.com/delaybridge/delaybridge/internal/testcert"
)

// setSCRAM changes user's SCRAM-SHA-256 password on the broker.
func setSCRAM(t *testing.T, cl *kgo.Client, user, pass string) {
	t.Helper()
	salt := make([]byte, 16)
	rand.Read(salt)
	salted, err := pbkdf2.Key(sha256.New, pass, salt, 4096, 32)
	if err != nil {
		t.Fatal(err)
	}
	req := kmsg.NewPtrAlterUserSCRAMCredentialsRequest()
	u := kmsg.NewAlterUserSCRAMCredentialsRequestUpsertion()
	u.Name, u.Mechanism, u.Iterations, u.Salt, u.SaltedPassword = user, 1, 4096, salt, salted
	req.Upsertions = append(req.Upsertions, u)
	resp, err := req.RequestWith(context.Background(), cl)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range resp.Results {
		if r.ErrorCode != 0 {
			t.Fatalf("alter scram %s: code %d %v", r.User, r.ErrorCode, r.ErrorMessage)
		}
	}
}

// TestKafkaSCRAMChangedOnBrokerFirst: the bridge's SCRAM password is
// changed on the broker before the mounted file (the wrong order), and the
// bridge's connections drop. Pending tasks and a message published in the
// broken period must be delivered once the file has the new password.
func TestKafkaSCRAMChangedOnBrokerFirst(t *testing.T) {
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "delay", "delay.dlq", "orders"),
		kfake.EnableSASL(),
		kfake.Superuser("SCRAM-SHA-256", "admin", "admin-pw"),
		kfake.Superuser("SCRAM-SHA-256", "bridge", "pw-1"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close)
	admin, err := kgo.NewClient(kgo.SeedBrokers(kc.ListenAddrs()...),
		kgo.SASL(scram.Auth{User: "admin", Pass: "admin-pw"}.AsSha256Mechanism()),
		kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(admin.Close)

	dir := t.TempDir()
	passFile := filepath.Join(dir, "kafka-password")
	testcert.ReplaceFile(t, passFile, []byte("pw-1\n"))
	clk := clock.NewFake(time.Now())
	core, logs := observer.New(zap.DebugLevel)
	yml := kafkaOnlyYAML(t, kc.ListenAddrs(), fmt.Sprintf("  group: bridge\n  sasl: {mechanism: SCRAM-SHA-256, username: bridge, password_file: %q}\n", passFile)) +
		"targets: {allow: [\"*\"]}\nretry: {initial: 1s, max: 4s, multiplier: 2, jitter: 0.1, max_attempts: 3}\n"
	svc, _, done := runYAML(t, yml, Options{Logger: zap.New(zapcore.NewTee(core)), Clock: clk, Kafka: fastKafka})
	eventually(t, "ready", func() bool { return svc.Ready() == nil })

	publish := func(key, value, after string) {
		t.Helper()
		r := &kgo.Record{Topic: "delay", Partition: 0, Key: []byte(key), Value: []byte(value), Timestamp: clk.Now(),
			Headers: []kgo.RecordHeader{{Key: "delay-after", Value: []byte(after)}, {Key: "delay-target", Value: []byte("orders")}}}
		pctx, pcancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer pcancel()
		if err := admin.ProduceSync(pctx, r).FirstErr(); err != nil {
			t.Fatalf("produce: %v", err)
		}
	}
	publish("a", "before", "1m")
	waitIngested(t, svc, 1)

	// The broker's password changes; then every connection of the bridge
	// drops (a broker restart): fetches, group requests, produces to
	// anything but the delay topic (the test's own produces).
	setSCRAM(t, admin, "bridge", "pw-2")
	var killing atomic.Bool
	var killed atomic.Int64
	killing.Store(true)
	kc.Control(func(req kmsg.Request) (kmsg.Response, error, bool) {
		kc.KeepControl()
		if !killing.Load() {
			kc.DropControl()
			return nil, nil, false
		}
		switch r := req.(type) {
		case *kmsg.FetchRequest, *kmsg.HeartbeatRequest, *kmsg.JoinGroupRequest, *kmsg.SyncGroupRequest,
			*kmsg.OffsetCommitRequest, *kmsg.OffsetFetchRequest, *kmsg.ListOffsetsRequest:
			killed.Add(1)
			return nil, fmt.Errorf("killed"), true
		case *kmsg.ProduceRequest:
			for _, tp := range r.Topics {
				if tp.Topic != "delay" && tp.Topic != "" { // kgo names topics by id
					killed.Add(1)
					return nil, fmt.Errorf("killed"), true
				}
			}
		}
		return nil, nil, false
	})
	brokenAt := time.Now()
	eventually(t, "not ready after the password changed", func() bool { return svc.Ready() != nil })
	t.Logf("not ready after %v: %v", time.Since(brokenAt), svc.Ready())

	publish("b", "during", "1m")
	clk.Advance(2 * time.Minute)
	// A and B are due while the bridge cannot log in: they wait (no
	// retry budget used), and /readyz says why.
	eventually(t, "the source to report the refused login", func() bool {
		err := svc.Ready()
		return err != nil && strings.Contains(err.Error(), "SASL Authentication failed") && strings.Contains(err.Error(), "kafka target unavailable")
	})
	killing.Store(false)
	t.Logf("readiness while broken: %v", svc.Ready())
	if n := logs.FilterMessage("join group failed; retrying").Len(); n > 2 {
		t.Errorf("%d join failure lines while broken, want one (then one per 30 s)", n)
	}
	// Recovery: the file gets the new password.
	testcert.ReplaceFile(t, passFile, []byte("pw-2\n"))
	fixedAt := time.Now()
	cons, err := kgo.NewClient(kgo.SeedBrokers(kc.ListenAddrs()...),
		kgo.SASL(scram.Auth{User: "admin", Pass: "admin-pw"}.AsSha256Mechanism()),
		kgo.ConsumeTopics("orders", "delay.dlq"), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cons.Close()
	got := map[string]int{}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for got["orders/before"] == 0 || got["orders/during"] == 0 {
		clk.Advance(time.Second)
		pctx, pcancel := context.WithTimeout(ctx, 500*time.Millisecond)
		fs := cons.PollFetches(pctx)
		pcancel()
		if ctx.Err() != nil {
			t.Fatalf("deliveries after recovery: %v; readiness %v, stats %+v", got, svc.Ready(), svc.Engine().Stats())
		}
		fs.EachRecord(func(r *kgo.Record) { got[r.Topic+"/"+string(r.Value)]++ })
	}
	t.Logf("delivered %v, %v after the file was rotated", got, time.Since(fixedAt))
	eventually(t, "ready after delivering", func() bool { return svc.Ready() == nil })
	for k, n := range got {
		if n != 1 {
			t.Errorf("%s delivered %d times", k, n)
		}
	}
	select {
	case err := <-done:
		t.Fatalf("bridge exited: %v", err)
	default:
	}
}
