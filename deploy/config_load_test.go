package deploy

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/delaybridge/delaybridge/config"
)

// TestRenderedConfigLoads feeds every config.yaml the chart renders to the
// binary's own loader and validator (config.LoadBytes), with the mounted
// credential files and the data directory stood in by temporary files: a
// chart value the bridge would refuse at start fails here.
func TestRenderedConfigLoads(t *testing.T) {
	for _, f := range ciValues {
		t.Run(f, func(t *testing.T) {
			m := decodeAll(t, render(t, "-f", filepath.Join(chartDir, "ci", f)))
			raw := m.configMaps[0].Data["config.yaml"]
			root := t.TempDir()
			secrets := filepath.Join(root, "secrets") + "/"
			// Stand-in credential files for every path under the mount.
			for _, line := range strings.Split(raw, "\n") {
				_, v, ok := strings.Cut(line, "_file: ")
				if !ok || !strings.HasPrefix(strings.TrimSpace(v), secretsRoot) {
					continue
				}
				p := filepath.Join(secrets, strings.TrimPrefix(strings.TrimSpace(v), secretsRoot))
				if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(p, []byte("stand-in\n"), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			local := strings.ReplaceAll(raw, secretsRoot, secrets)
			local = strings.ReplaceAll(local, "data_dir: /var/lib/delaybridge", "data_dir: "+filepath.Join(root, "data"))
			var env []string
			for _, e := range m.statefulSets[0].Spec.Template.Spec.Containers[0].Env {
				if strings.HasPrefix(e.Name, "DELAYBRIDGE_") {
					env = append(env, e.Name+"="+e.Value)
				}
			}
			cfg, err := config.LoadBytes([]byte(local), env)
			if err != nil {
				t.Fatalf("the bridge refuses the rendered config:\n%v\n--- config.yaml ---\n%s", err, raw)
			}
			if len(cfg.Targets.Allow) == 0 && f != "default-values.yaml" {
				t.Errorf("targets.allow empty after load")
			}
		})
	}
}

// TestSchemaDurationMatchesConfig keeps the chart schema's duration pattern
// in step with config.ParseDuration, so the schema neither refuses a value
// the bridge takes nor lets through one it refuses at start.
func TestSchemaDurationMatchesConfig(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join(chartDir, "values.schema.json"))
	if err != nil {
		t.Fatal(err)
	}
	var s struct {
		Definitions struct {
			Duration struct {
				Pattern string `json:"pattern"`
			} `json:"duration"`
		} `json:"definitions"`
	}
	if err := json.Unmarshal(raw, &s); err != nil {
		t.Fatal(err)
	}
	re := regexp.MustCompile(s.Definitions.Duration.Pattern)
	for _, v := range []string{
		"0", "90s", "1h30m", "500ms", "1.5h", "3d", "365d", "2d12h", "1d0s", "10us", "10µs", "250ns",
		"1h2d", "d", "3", "1 h", "3days", "1.5d", "h", "2d-1h", "1w",
	} {
		_, perr := config.ParseDuration(v)
		if got, want := re.MatchString(v), perr == nil; got != want {
			t.Errorf("%q: schema accepts=%v, config.ParseDuration accepts=%v (%v)", v, got, want, perr)
		}
	}
}
