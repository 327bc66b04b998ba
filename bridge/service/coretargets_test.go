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
// it deliveries to subjects without a stream are not best effort.
func TestNATSCoreTargetsWiring(t *testing.T) {
	ns := startNATSServer(t, &natsserver.Options{})
	for _, c := range []struct {
		name  string
		extra string
		env   []string
		want  bool
	}{
		{"default", "", nil, false},
		{"yaml", "  core_targets: true\n", nil, true},
		{"env", "", []string{"DELAYBRIDGE_NATS_CORE_TARGETS=true"}, true},
		{"env beats yaml", "  core_targets: true\n", []string{"DELAYBRIDGE_NATS_CORE_TARGETS=false"}, false},
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
			got := make(chan bool, 1)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			svc, err := New(ctx, cfg, Options{NATS: func(nc *nats.Config) { got <- nc.CoreTargets }})
			if err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- svc.Run(ctx) }()
			select {
			case v := <-got:
				if v != c.want {
					t.Errorf("nats.Config.CoreTargets = %v, want %v", v, c.want)
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
