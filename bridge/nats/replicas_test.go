package nats

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/internal/natstest"
)

// TestCreateReplicasOneServer: on a single server, replicas 1 is taken and
// more is refused by the server with an error that says so (the bridge
// does not retry a configuration the broker rejects), and no warning
// about replicas is logged, as there is no cluster.
func TestCreateReplicasOneServer(t *testing.T) {
	core, logs := observer.New(zap.WarnLevel)
	_, _, js, _ := createdSource(t, func(c *Config) { c.Replicas = 1; c.Logger = zap.New(core) })
	st, err := js.Stream(ctxT(t), "DELAY")
	if err != nil {
		t.Fatal(err)
	}
	if r := st.CachedInfo().Config.Replicas; r != 1 {
		t.Fatalf("replicas %d, want 1", r)
	}
	if n := logs.FilterMessageSnippet("one replica").Len(); n != 0 {
		t.Fatalf("%d replica warnings on a single server", n)
	}

	s := startServer(t, jsOptions(t))
	cfg := testConfig(t, serverURL(s))
	cfg.Create, cfg.Replicas = true, 3
	nc := connect(t, cfg)
	_, err = NewSource(nc, cfg)
	var api *jetstream.APIError
	if !errors.As(err, &api) || api.Code == 503 || !strings.Contains(err.Error(), "3 replicas") {
		t.Fatalf("replicas 3 on one server: %v, want the server's refusal (not a 503) naming the replicas", err)
	}
}

// TestCreateReplicasCluster: on a 3-node cluster, Create with Replicas 3
// makes an R3 delay stream; an existing R1 stream is scaled to R3 (and its
// missing subject added in the same update); and a one-replica delay
// stream on a cluster, with Replicas not set, is logged as a warning (it
// was made R1 silently before, unavailable with its one server).
func TestCreateReplicasCluster(t *testing.T) {
	c := natstest.StartCluster(t, 3)
	streamReplicas := func(js jetstream.JetStream, name string) int {
		t.Helper()
		st, err := js.Stream(ctxT(t), name)
		if err != nil {
			t.Fatal(err)
		}
		return st.CachedInfo().Config.Replicas
	}
	newSource := func(cfg Config) (*Source, jetstream.JetStream, *observer.ObservedLogs) {
		t.Helper()
		core, logs := observer.New(zap.InfoLevel)
		cfg.Logger = zap.New(core)
		nc := connect(t, cfg)
		js := newJS(t, nc)
		var src *Source
		var err error
		// A new cluster may still be placing its first assets.
		for deadline := time.Now().Add(20 * time.Second); ; {
			if src, err = NewSource(nc, cfg); err == nil || time.Now().After(deadline) {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		if err != nil {
			t.Fatal(err)
		}
		return src, js, logs
	}

	t.Run("create R3", func(t *testing.T) {
		cfg := testConfig(t, c.URLs())
		cfg.Stream, cfg.Create, cfg.Replicas = "DELAY3", true, 3
		_, js, logs := newSource(cfg)
		if r := streamReplicas(js, "DELAY3"); r != 3 {
			t.Fatalf("created with %d replicas, want 3", r)
		}
		if n := logs.FilterMessageSnippet("one replica").Len(); n != 0 {
			t.Fatalf("%d one-replica warnings for an R3 stream", n)
		}
	})
	t.Run("scale an R1 stream to R3", func(t *testing.T) {
		cfg := testConfig(t, c.URLs())
		cfg.Stream = "DELAY1"
		cfg.Sources = []SourceConfig{{Subject: "one.>"}}
		nc := connect(t, cfg)
		js := newJS(t, nc)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "DELAY1", Subjects: []string{"one.>"}, Replicas: 1}); err != nil {
			t.Fatal(err)
		}
		// Not asked to: a warning, the stream left alone.
		cfg.Create = true
		_, _, logs := newSource(cfg)
		if n := logs.FilterMessageSnippet("one replica on a NATS cluster").Len(); n != 1 {
			t.Fatalf("%d warnings for an R1 delay stream on a cluster, want 1", n)
		}
		if r := streamReplicas(js, "DELAY1"); r != 1 {
			t.Fatalf("replicas %d after a start without nats.replicas, want 1 (left alone)", r)
		}
		cfg.Replicas = 3
		cfg.Sources = append(cfg.Sources, SourceConfig{Subject: "two.>"})
		_, _, logs = newSource(cfg)
		st, err := js.Stream(ctxT(t), "DELAY1")
		if err != nil {
			t.Fatal(err)
		}
		got := st.CachedInfo().Config
		if got.Replicas != 3 || len(got.Subjects) != 2 {
			t.Fatalf("after a start with replicas 3 and a new subject: replicas %d, subjects %v", got.Replicas, got.Subjects)
		}
		if n := logs.FilterMessageSnippet("changed the stream's replicas").Len(); n != 1 {
			t.Fatalf("%d 'changed the stream's replicas' lines, want 1", n)
		}
	})
}
