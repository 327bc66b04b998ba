package config_test

import (
	"testing"

	"github.com/delaybridge/delaybridge/config"
)

// TestCheckOutputLoadsBackWithMetricsToken: README "Configuration" says
// the effective config `run --check` prints (Config.String) "loads back as
// a config". With admin.token and admin.metrics_token both given inline or
// by environment variable, both print as REDACTED, and the printed config
// is refused: "admin.metrics_token: must differ from admin.token".
func TestCheckOutputLoadsBackWithMetricsToken(t *testing.T) {
	base := "data_dir: /d\nnats: {sources: [{subject: a.>, dlq: b}]}\n"
	for _, env := range [][]string{
		{"DELAYBRIDGE_ADMIN_TOKEN=s3cret", "DELAYBRIDGE_ADMIN_METRICS_TOKEN=scrape"},
	} {
		c, err := config.LoadBytes([]byte(base), env)
		if err != nil {
			t.Fatalf("%v: %v", env, err)
		}
		if _, err := config.LoadBytes([]byte(c.String()), nil); err != nil {
			t.Errorf("%v: the effective config does not load back: %v\n%s", env, err, c)
		}
	}
}
