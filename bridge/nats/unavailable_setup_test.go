package nats

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/delaybridge/delaybridge/internal/natstest"
)

// startLimitedCluster starts a 3-node JetStream cluster whose servers
// each hold at most maxHA replicated (R>1) streams and consumers
// (max_ha_assets), and returns its client URLs once one is meta leader.
func startLimitedCluster(t *testing.T, maxHA int) string {
	t.Helper()
	const n = 3
	routes := make([]string, n)
	cports := make([]int, n)
	for i := range n {
		cports[i] = natstest.FreePort(t)
		routes[i] = "nats://127.0.0.1:" + strconv.Itoa(cports[i])
	}
	servers := make([]*server.Server, n)
	urls := make([]string, n)
	for i := range n {
		opts := &server.Options{
			ServerName:      fmt.Sprintf("L%d", i+1),
			Host:            "127.0.0.1",
			Port:            natstest.FreePort(t),
			JetStream:       true,
			JetStreamLimits: server.JSLimitOpts{MaxHAAssets: maxHA},
			StoreDir:        t.TempDir(),
			NoSigs:          true,
			NoLog:           true,
			Cluster:         server.ClusterOpts{Name: "L", Host: "127.0.0.1", Port: cports[i]},
			Routes:          server.RoutesFromStr(strings.Join(routes, ",")),
		}
		servers[i] = startServer(t, opts)
		urls[i] = servers[i].ClientURL()
	}
	eventually(t, "a meta leader", func() bool {
		for _, s := range servers {
			if s.JetStreamIsLeader() {
				return true
			}
		}
		return false
	})
	return strings.Join(urls, ",")
}

// TestSetupHAAssetsLimit (review R194): a set-up refused with 503
// "insufficient resources" because the cluster's max_ha_assets is reached
// (the consumer's create, or the stream's scale-up to nats.replicas) is the
// operator's limit to raise, not an outage: the server answers it at once
// and will answer it again. The set-up returns that answer at once (one
// request) rather than sending it again every resendEvery until its budget
// ends (2 requests and the whole 4 s budget here; 5 and 10 s by default).
func TestSetupHAAssetsLimit(t *testing.T) {
	tests := []struct {
		name    string
		streams []jetstream.StreamConfig // made first
		request string                   // the subject of the request refused
	}{
		// The stream, R3, takes each peer's one HA asset; the consumer
		// (R3 like its stream) would take a second.
		{"consumer create", []jetstream.StreamConfig{
			{Name: "DELAY", Subjects: []string{"delay.>"}, Retention: jetstream.WorkQueuePolicy, Duplicates: MinDuplicateWindow, Replicas: 3},
		}, "$JS.API.CONSUMER.CREATE.DELAY.>"},
		// Another stream, R3, takes each peer's one HA asset; DELAY, R1,
		// would take a second scaled up to 3.
		{"stream scale-up", []jetstream.StreamConfig{
			{Name: "OTHER", Subjects: []string{"other.>"}, Replicas: 3},
			{Name: "DELAY", Subjects: []string{"delay.>"}, Retention: jetstream.WorkQueuePolicy, Duplicates: MinDuplicateWindow, Replicas: 1},
		}, "$JS.API.STREAM.UPDATE.DELAY"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			urls := startLimitedCluster(t, 1)
			// One server for the source and the request counter below,
			// so that the counter sees every request sent.
			cfg := testConfig(t, strings.Split(urls, ",")[0])
			cfg.Create, cfg.Replicas = true, 3
			cfg.ConnectTimeout = 2 * time.Second // budget 4 s, resendEvery 2 s
			nc := connect(t, cfg)
			js := newJS(t, nc)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			for _, sc := range tc.streams {
				var err error
				for {
					if _, err = js.CreateStream(ctx, sc); err == nil || ctx.Err() != nil {
						break
					}
					time.Sleep(100 * time.Millisecond) // a new cluster still placing
				}
				if err != nil {
					t.Fatalf("create stream %s: %v", sc.Name, err)
				}
			}
			var requests atomic.Int32
			sub, err := nc.Subscribe(tc.request, func(*natsgo.Msg) { requests.Add(1) })
			if err != nil {
				t.Fatal(err)
			}
			if err := nc.Flush(); err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			_, err = NewSource(connect(t, cfg), cfg)
			took := time.Since(start)
			eventually(t, "the request counted", func() bool { return requests.Load() > 0 })
			_ = sub.Unsubscribe()
			var api *jetstream.APIError
			if !errors.As(err, &api) || api.ErrorCode != jsErrInsufficientResources {
				t.Fatalf("NewSource: %v; want the server's insufficient resources (%d)", err, jsErrInsufficientResources)
			}
			t.Logf("NewSource failed after %v with %d requests %s: %v", took, requests.Load(), tc.request, err)
			if n := requests.Load(); n != 1 {
				t.Errorf("%d requests %s for a refusal answered at once, want 1 (the set-up took %v of its %v budget)", n, tc.request, took, 2*cfg.ConnectTimeout)
			}
		})
	}
}
