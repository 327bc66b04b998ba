package deploy

import (
	"crypto/x509"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/delaybridge/delaybridge/config"
	"github.com/delaybridge/delaybridge/internal/testcert"
)

// TestRenderedConfigLoads feeds every config.yaml the chart renders to the
// binary's own loader and validator (config.LoadBytes), with the mounted
// credential files and the data directory stood in by temporary files: a
// chart value the bridge would refuse at start fails here.
func TestRenderedConfigLoads(t *testing.T) {
	for _, f := range ciValues {
		t.Run(f, func(t *testing.T) {
			m := decodeAll(t, render(t, "-f", filepath.Join(chartDir, "ci", f)))
			cfg := loadRendered(t, m, nil)
			if len(cfg.Targets.Allow) == 0 && f != "default-values.yaml" {
				t.Errorf("targets.allow empty after load")
			}
			if f == "all-features-values.yaml" && (cfg.NATS == nil || !cfg.NATS.CoreTargets) {
				t.Errorf("config.nats.core_targets: true did not reach the loaded config")
			}
			if f == "all-features-values.yaml" && (cfg.NATS == nil || !cfg.NATS.Create || cfg.NATS.Replicas != 3) {
				t.Errorf("config.nats.create: true and replicas: 3 did not reach the loaded config")
			}
		})
	}
}

// TestServiceLinksDoNotBreakConfig installs the chart under release names
// whose Service names start with "delaybridge". Unless the pod spec turns
// service links off, the kubelet gives the container an environment
// variable for every Service of the namespace (DELAYBRIDGE_SERVICE_HOST,
// DELAYBRIDGE_PORT_8080_TCP, ...); every DELAYBRIDGE_ variable must name a
// config key, so the bridge would refuse to start and crash-loop.
func TestServiceLinksDoNotBreakConfig(t *testing.T) {
	for _, release := range []string{"delaybridge", "delaybridge-prod"} {
		t.Run(release, func(t *testing.T) {
			out, stderr, err := helm(t, "template", release, chartDir, "--namespace", namespace, "--kube-version", "1.31.0",
				"-f", filepath.Join(chartDir, "ci", "default-values.yaml"))
			if err != nil {
				t.Fatalf("helm template: %v\n%s", err, stderr)
			}
			m := decodeAll(t, out)
			pod := m.statefulSets[0].Spec.Template.Spec
			var env []string
			if pod.EnableServiceLinks == nil || *pod.EnableServiceLinks {
				env = serviceLinkEnv(m.services)
			}
			loadRendered(t, m, env)
		})
	}
}

// serviceLinkEnv is what the kubelet injects for services (Docker-link
// style variables, pkg/kubelet/envvars): for each Service with a cluster IP,
// NAME_SERVICE_HOST, NAME_SERVICE_PORT[_PORTNAME], NAME_PORT and
// NAME_PORT_<port>_<PROTO>[_PROTO|_PORT|_ADDR], NAME being the upper-case
// Service name with "-" as "_".
func serviceLinkEnv(services []corev1.Service) []string {
	const ip = "10.96.0.10"
	up := func(s string) string { return strings.ToUpper(strings.ReplaceAll(s, "-", "_")) }
	var env []string
	for _, s := range services {
		if s.Spec.ClusterIP == corev1.ClusterIPNone || len(s.Spec.Ports) == 0 {
			continue
		}
		name := up(s.Name)
		first := s.Spec.Ports[0]
		env = append(env, name+"_SERVICE_HOST="+ip, fmt.Sprintf("%s_SERVICE_PORT=%d", name, first.Port),
			fmt.Sprintf("%s_PORT=%s://%s:%d", name, strings.ToLower(string(first.Protocol)), ip, first.Port))
		for _, p := range s.Spec.Ports {
			if p.Name != "" {
				env = append(env, fmt.Sprintf("%s_SERVICE_PORT_%s=%d", name, up(p.Name), p.Port))
			}
			pre := fmt.Sprintf("%s_PORT_%d_%s", name, p.Port, strings.ToUpper(string(p.Protocol)))
			env = append(env, fmt.Sprintf("%s=%s://%s:%d", pre, strings.ToLower(string(p.Protocol)), ip, p.Port),
				pre+"_PROTO="+strings.ToLower(string(p.Protocol)), fmt.Sprintf("%s_PORT=%d", pre, p.Port), pre+"_ADDR="+ip)
		}
	}
	return env
}

// loadRendered feeds the config.yaml of a render to the binary's own loader
// and validator (config.LoadBytes), with the mounted credential files and
// the data directory stood in by temporary files, and the container's
// DELAYBRIDGE_ variables plus env as its environment.
func loadRendered(t *testing.T, m manifests, env []string) *config.Config {
	t.Helper()
	raw := m.configMaps[0].Data["config.yaml"]
	root := t.TempDir()
	secrets := filepath.Join(root, "secrets") + "/"
	// Stand-in credential files for every path under the mount, of the
	// kind their key names: the loader reads TLS files and the NATS
	// .creds as the start does (a placeholder would be refused).
	stand := standIns(t)
	for _, line := range strings.Split(raw, "\n") {
		k, v, ok := strings.Cut(line, "_file: ")
		if !ok || !strings.HasPrefix(strings.TrimSpace(v), secretsRoot) {
			continue
		}
		p := filepath.Join(secrets, strings.TrimPrefix(strings.TrimSpace(v), secretsRoot))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		b, ok := stand[strings.TrimSpace(k)]
		if !ok {
			b = []byte("stand-in-" + filepath.Base(p) + "\n") // distinct per file: two tokens may not be the same
		}
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	local := strings.ReplaceAll(raw, secretsRoot, secrets)
	local = strings.ReplaceAll(local, "data_dir: /var/lib/delaybridge", "data_dir: "+filepath.Join(root, "data"))
	for _, e := range m.statefulSets[0].Spec.Template.Spec.Containers[0].Env {
		if strings.HasPrefix(e.Name, "DELAYBRIDGE_") {
			env = append(env, e.Name+"="+e.Value)
		}
	}
	cfg, err := config.LoadBytes([]byte(local), env)
	if err != nil {
		t.Fatalf("the bridge refuses the rendered config:\n%v\n--- config.yaml ---\n%s", err, raw)
	}
	return cfg
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

// standIns are the contents of the credential files the loader reads as
// the start does, by the key before "_file": a CA, a client certificate
// and its key (one pair, so each cert_file matches each key_file), and a
// NATS .creds file (a user JWT and its nkey seed).
func standIns(t *testing.T) map[string][]byte {
	t.Helper()
	ca := testcert.NewCA(t, "ca")
	leaf := ca.Issue(t, "client", x509.ExtKeyUsageClientAuth)
	creds, _ := testcert.NATSCreds(t)
	return map[string][]byte{"ca": ca.CertPEM(), "cert": leaf.CertPEM(), "key": leaf.KeyPEM(t), "creds": creds}
}
