package service

import (
	"context"
	"strconv"
	"testing"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"

	"github.com/delaybridge/delaybridge/bridge/nats"
	"github.com/delaybridge/delaybridge/config"
)

// TestNATSCoreTargetsWiring: nats.core_targets (YAML or
// DELAYBRIDGE_NATS_CORE_TARGETS) reaches the NATS sink's config; without
// it deliveries to subjects without a stream are not best effort. So does
// nats.replicas the source's.
func TestNATSCoreTargetsWiring(t *testing.T) {
	ns := startNATSServer(t, &natsserver.Options{})
	for _, c := range []struct {
		name  string
		extra string
		env   []string
		want  bool
		repl  int
	}{
		{"default", "", nil, false, 0},
		{"yaml", "  core_targets: true\n", nil, true, 0},
		{"env", "", []string{"DELAYBRIDGE_NATS_CORE_TARGETS=true"}, true, 0},
		{"env beats yaml", "  core_targets: true\n", []string{"DELAYBRIDGE_NATS_CORE_TARGETS=false"}, false, 0},
		{"replicas yaml", "  replicas: 1\n", nil, false, 1},
		{"replicas env", "", []string{"DELAYBRIDGE_NATS_REPLICAS=1"}, false, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			yml := `
data_dir: ` + strconv.Quote(t.TempDir()) + `
nats:
  url: ` + strconv.Quote(ns.ClientURL()) + `
  create: true
` + c.extra + `  sources: [{subject: delay.>, dlq: dlq.delay}]
admin: {listen: "127.0.0.1:0"}
`
			cfg, err := config.LoadBytes([]byte(yml), c.env)
			if err != nil {
				t.Fatal(err)
			}
			got := make(chan nats.Config, 1)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			svc, err := New(ctx, cfg, Options{NATS: func(nc *nats.Config) { got <- *nc }})
			if err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- svc.Run(ctx) }()
			select {
			case nc := <-got:
				if nc.CoreTargets != c.want || nc.Replicas != c.repl {
					t.Errorf("nats.Config.CoreTargets = %v, Replicas = %d; want %v, %d", nc.CoreTargets, nc.Replicas, c.want, c.repl)
				}
			case err := <-done:
				t.Fatalf("Run returned before the NATS setup: %v", err)
			case <-ctx.Done():
				t.Fatal("NATS setup not reached")
			}
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Run: %v", err)
			}
		})
	}
}
