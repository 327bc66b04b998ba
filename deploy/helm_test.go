package deploy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	sigsjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"

	"github.com/delaybridge/delaybridge/metrics"
)

// The Helm release the tests render with. Pinned: the chart is linted and
// rendered by exactly this version on every machine.
const helmModule = "helm.sh/helm/v3/cmd/helm@v3.22.0"

const (
	chartDir    = "helm/delaybridge"
	releaseName = "db"
	namespace   = "delaybridge"
	secretsRoot = "/etc/delaybridge/secrets/"
)

// ciValues are the values files under helm/delaybridge/ci, each rendered and
// linted; the features each one must turn on are checked per file.
var ciValues = []string{
	"default-values.yaml",
	"kafka-sasl-tls-values.yaml",
	"nats-creds-values.yaml",
	"all-features-values.yaml",
}

var (
	helmOnce sync.Once
	helmPath string
	helmErr  error
	helmDir  string
)

func TestMain(m *testing.M) {
	code := m.Run()
	if helmDir != "" {
		os.RemoveAll(helmDir)
	}
	os.Exit(code)
}

// goEnv is the environment for the go command that builds Helm: outside any
// module or workspace, without the -mod flags a caller may have exported
// (they are refused for pkg@version).
func goEnv(gobin string) []string {
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "GOFLAGS=") || strings.HasPrefix(kv, "GOWORK=") || strings.HasPrefix(kv, "GOBIN=") {
			continue
		}
		env = append(env, kv)
	}
	return append(env, "GOWORK=off", "GOFLAGS=-buildvcs=false", "GOBIN="+gobin)
}

// helmBinary installs the pinned Helm once per test process into a
// temporary directory (`go install pkg@version`, the same module resolution
// as `go run pkg@version`). The first build on a machine compiles Helm and
// takes minutes; afterwards the build cache makes it a few seconds, and every
// call runs the binary directly instead of paying `go run`'s lookup.
func helmBinary(t *testing.T) string {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("skipping: the go command is not on PATH, so the pinned Helm (" + helmModule + ") cannot be built")
	}
	helmOnce.Do(func() {
		helmDir, helmErr = os.MkdirTemp("", "delaybridge-helm-")
		if helmErr != nil {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, goBin, "install", helmModule)
		cmd.Dir = helmDir
		cmd.Env = goEnv(filepath.Join(helmDir, "bin"))
		start := time.Now()
		out, err := cmd.CombinedOutput()
		if err != nil {
			helmErr = fmt.Errorf("go install %s: %v\n%s", helmModule, err, out)
			return
		}
		helmPath = filepath.Join(helmDir, "bin", "helm")
		if _, err := os.Stat(helmPath + ".exe"); err == nil {
			helmPath += ".exe"
		}
		t.Logf("built %s in %s", helmModule, time.Since(start).Round(time.Millisecond))
	})
	if helmErr != nil {
		t.Fatal(helmErr)
	}
	return helmPath
}

// helm runs the pinned Helm with args and returns stdout, stderr and the
// error of the run.
func helm(t *testing.T, args ...string) (string, string, error) {
	t.Helper()
	bin := helmBinary(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	// Keep Helm away from the user's repositories, caches and kube config.
	home := t.TempDir()
	cmd.Env = append(os.Environ(),
		"HELM_CACHE_HOME="+filepath.Join(home, "cache"),
		"HELM_CONFIG_HOME="+filepath.Join(home, "config"),
		"HELM_DATA_HOME="+filepath.Join(home, "data"),
		"KUBECONFIG="+filepath.Join(home, "kubeconfig"),
	)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	return stdout.String(), stderr.String(), err
}

func renderArgs(extra ...string) []string {
	return append([]string{"template", releaseName, chartDir, "--namespace", namespace, "--kube-version", "1.31.0"}, extra...)
}

func render(t *testing.T, extra ...string) string {
	t.Helper()
	out, stderr, err := helm(t, renderArgs(extra...)...)
	if err != nil {
		t.Fatalf("helm template %v: %v\n%s", extra, err, stderr)
	}
	return out
}

func TestHelmLint(t *testing.T) {
	for _, f := range ciValues {
		t.Run(f, func(t *testing.T) {
			out, stderr, err := helm(t, "lint", "--strict", chartDir, "-f", filepath.Join(chartDir, "ci", f))
			if err != nil {
				t.Fatalf("helm lint: %v\n%s%s", err, out, stderr)
			}
			for _, line := range strings.Split(out, "\n") {
				if strings.Contains(line, "[WARNING]") || strings.Contains(line, "[ERROR]") {
					t.Errorf("helm lint: %s", line)
				}
			}
		})
	}
}

// manifests is one render, decoded strictly by kind.
type manifests struct {
	statefulSets    []appsv1.StatefulSet
	services        []corev1.Service
	configMaps      []corev1.ConfigMap
	serviceAccounts []corev1.ServiceAccount
	pdbs            []policyv1.PodDisruptionBudget
	netpols         []networkingv1.NetworkPolicy
	serviceMonitors []serviceMonitor
	rules           []prometheusRule
}

// serviceMonitor and prometheusRule are the parts of the Prometheus Operator
// CRDs (monitoring.coreos.com/v1) the chart uses; unknown fields fail the
// decode like in the core types.
type serviceMonitor struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Selector          metav1.LabelSelector `json:"selector"`
		NamespaceSelector struct {
			Any        bool     `json:"any,omitempty"`
			MatchNames []string `json:"matchNames,omitempty"`
		} `json:"namespaceSelector"`
		Endpoints []struct {
			Port          string `json:"port"`
			Path          string `json:"path"`
			Scheme        string `json:"scheme"`
			Interval      string `json:"interval"`
			ScrapeTimeout string `json:"scrapeTimeout"`
			Authorization *struct {
				Type        string                   `json:"type"`
				Credentials corev1.SecretKeySelector `json:"credentials"`
			} `json:"authorization,omitempty"`
			Relabelings       []map[string]any `json:"relabelings,omitempty"`
			MetricRelabelings []map[string]any `json:"metricRelabelings,omitempty"`
		} `json:"endpoints"`
	} `json:"spec"`
}

type ruleGroups struct {
	Groups []struct {
		Name     string `json:"name"`
		Interval string `json:"interval,omitempty"`
		Rules    []struct {
			Alert       string            `json:"alert,omitempty"`
			Record      string            `json:"record,omitempty"`
			Expr        string            `json:"expr"`
			For         string            `json:"for,omitempty"`
			Labels      map[string]string `json:"labels,omitempty"`
			Annotations map[string]string `json:"annotations,omitempty"`
		} `json:"rules"`
	} `json:"groups"`
}

type prometheusRule struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              ruleGroups `json:"spec"`
}

// strictDecode turns YAML into JSON (refusing duplicate keys) and decodes it
// into v refusing unknown fields, so a misspelt field fails. encoding/json
// matches field names case-insensitively (readOnlyRootFileSystem would pass),
// so a second, case-sensitive pass with sigs.k8s.io/json, the decoder the API
// server uses, refuses a wrongly capitalised field too.
func strictDecode(doc []byte, v any) error {
	js, err := yaml.YAMLToJSONStrict(doc)
	if err != nil {
		return err
	}
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if dec.More() {
		return errors.New("trailing data after the object")
	}
	fresh := reflect.New(reflect.TypeOf(v).Elem()).Interface()
	strictErrs, err := sigsjson.UnmarshalStrict(js, fresh, sigsjson.DisallowUnknownFields, sigsjson.DisallowDuplicateFields)
	if err != nil {
		return err
	}
	return errors.Join(strictErrs...)
}

func decodeAll(t *testing.T, rendered string) manifests {
	t.Helper()
	var m manifests
	r := utilyaml.NewYAMLReader(bufio.NewReader(strings.NewReader(rendered)))
	n := 0
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("split rendered manifests: %v", err)
		}
		var head struct {
			APIVersion string `json:"apiVersion"`
			Kind       string `json:"kind"`
		}
		if err := yaml.Unmarshal(doc, &head); err != nil {
			t.Fatalf("manifest %d: %v\n%s", n, err, doc)
		}
		if head.Kind == "" { // an empty document (comments only)
			continue
		}
		n++
		want := map[string]string{
			"StatefulSet": "apps/v1", "Service": "v1", "ConfigMap": "v1", "ServiceAccount": "v1",
			"PodDisruptionBudget": "policy/v1", "NetworkPolicy": "networking.k8s.io/v1",
			"ServiceMonitor": "monitoring.coreos.com/v1", "PrometheusRule": "monitoring.coreos.com/v1",
		}[head.Kind]
		if want == "" {
			t.Fatalf("unexpected kind %q in render:\n%s", head.Kind, doc)
		}
		if head.APIVersion != want {
			t.Errorf("%s: apiVersion %q, want %q", head.Kind, head.APIVersion, want)
		}
		var err2 error
		switch head.Kind {
		case "StatefulSet":
			var o appsv1.StatefulSet
			err2 = strictDecode(doc, &o)
			m.statefulSets = append(m.statefulSets, o)
		case "Service":
			var o corev1.Service
			err2 = strictDecode(doc, &o)
			m.services = append(m.services, o)
		case "ConfigMap":
			var o corev1.ConfigMap
			err2 = strictDecode(doc, &o)
			m.configMaps = append(m.configMaps, o)
		case "ServiceAccount":
			var o corev1.ServiceAccount
			err2 = strictDecode(doc, &o)
			m.serviceAccounts = append(m.serviceAccounts, o)
		case "PodDisruptionBudget":
			var o policyv1.PodDisruptionBudget
			err2 = strictDecode(doc, &o)
			m.pdbs = append(m.pdbs, o)
		case "NetworkPolicy":
			var o networkingv1.NetworkPolicy
			err2 = strictDecode(doc, &o)
			m.netpols = append(m.netpols, o)
		case "ServiceMonitor":
			var o serviceMonitor
			err2 = strictDecode(doc, &o)
			m.serviceMonitors = append(m.serviceMonitors, o)
		case "PrometheusRule":
			var o prometheusRule
			err2 = strictDecode(doc, &o)
			m.rules = append(m.rules, o)
		}
		if err2 != nil {
			t.Fatalf("%s: strict decode: %v\n%s", head.Kind, err2, doc)
		}
	}
	if n == 0 {
		t.Fatal("helm template rendered no manifests")
	}
	return m
}

func TestHelmTemplateCIValues(t *testing.T) {
	for _, f := range ciValues {
		t.Run(f, func(t *testing.T) {
			m := decodeAll(t, render(t, "-f", filepath.Join(chartDir, "ci", f)))
			var dashboards []corev1.ConfigMap
			m.configMaps = slices.DeleteFunc(m.configMaps, func(cm corev1.ConfigMap) bool {
				if strings.HasSuffix(cm.Name, "-dashboard") {
					dashboards = append(dashboards, cm)
					return true
				}
				return false
			})
			if got := len(dashboards) == 1; got != (f == "all-features-values.yaml") {
				t.Errorf("dashboard ConfigMap rendered: %v", got)
			}
			for _, cm := range dashboards {
				checkDashboardConfigMap(t, cm)
			}
			if len(m.statefulSets) != 1 || len(m.configMaps) != 1 || len(m.serviceAccounts) != 1 || len(m.services) != 2 {
				t.Fatalf("want 1 StatefulSet, 1 ConfigMap, 1 ServiceAccount, 2 Services; got %d, %d, %d, %d",
					len(m.statefulSets), len(m.configMaps), len(m.serviceAccounts), len(m.services))
			}
			cfg := checkConfigMap(t, m.configMaps[0])
			checkStatefulSet(t, m.statefulSets[0], m.configMaps[0].Name, cfg)
			checkServices(t, m)
			all := f == "all-features-values.yaml"
			if got := len(m.serviceMonitors) == 1; got != all {
				t.Errorf("ServiceMonitor rendered: %v, want %v", got, all)
			}
			if got := len(m.rules) == 1; got != all {
				t.Errorf("PrometheusRule rendered: %v, want %v", got, all)
			}
			if got := len(m.pdbs) == 1; got != all {
				t.Errorf("PodDisruptionBudget rendered: %v, want %v", got, all)
			}
			wantNetpol := all || f == "nats-creds-values.yaml"
			if got := len(m.netpols) == 1; got != wantNetpol {
				t.Errorf("NetworkPolicy rendered: %v, want %v", got, wantNetpol)
			}
			for _, sm := range m.serviceMonitors {
				checkServiceMonitor(t, sm, m, cfg)
			}
			for _, pr := range m.rules {
				checkPrometheusRule(t, pr)
			}
			for _, np := range m.netpols {
				checkNetworkPolicy(t, np)
			}
			for _, pdb := range m.pdbs {
				if !reflect.DeepEqual(pdb.Spec.Selector.MatchLabels, m.statefulSets[0].Spec.Selector.MatchLabels) {
					t.Errorf("PDB selector %v does not select the pod (%v)", pdb.Spec.Selector.MatchLabels, m.statefulSets[0].Spec.Selector.MatchLabels)
				}
				if pdb.Spec.MinAvailable != nil && pdb.Spec.MinAvailable.IntValue() >= 1 {
					t.Error("PDB minAvailable >= 1 with a single replica blocks every node drain")
				}
			}

			// Per-file expectations of the rendered config.
			switch f {
			case "kafka-sasl-tls-values.yaml":
				wantPaths(t, cfg, map[string]string{
					"kafka.sasl.password_file": secretsRoot + "kafka/sasl-password",
					"kafka.tls.ca_file":        secretsRoot + "kafka/tls/ca.crt",
					"kafka.tls.cert_file":      secretsRoot + "kafka/tls/tls.crt",
					"kafka.tls.key_file":       secretsRoot + "kafka/tls/tls.key",
					"admin.token_file":         secretsRoot + "admin/token",
					"kafka.sasl.mechanism":     "SCRAM-SHA-512",
				})
			case "nats-creds-values.yaml":
				wantPaths(t, cfg, map[string]string{
					"nats.creds_file":             secretsRoot + "nats/nats.creds",
					"nats.tls.ca_file":            secretsRoot + "nats/tls/ca.crt",
					"admin.allow_insecure_listen": "true",
					"nats.create":                 "true",
				})
				if _, ok := cfg["kafka"]; ok {
					t.Error("kafka block rendered although kafka is disabled")
				}
			case "all-features-values.yaml":
				wantPaths(t, cfg, map[string]string{"admin.pprof": "true"})
			case "default-values.yaml":
				if _, ok := cfg["nats"]; ok {
					t.Error("nats block rendered although nats is disabled")
				}
			}
		})
	}
}

// lookup follows a dotted path through a decoded YAML map.
func lookup(m map[string]any, path string) (any, bool) {
	var cur any = m
	for _, k := range strings.Split(path, ".") {
		mm, ok := cur.(map[string]any)
		if !ok {
			return nil, false
		}
		if cur, ok = mm[k]; !ok {
			return nil, false
		}
	}
	return cur, true
}

func wantPaths(t *testing.T, cfg map[string]any, want map[string]string) {
	t.Helper()
	for path, v := range want {
		got, ok := lookup(cfg, path)
		if !ok {
			t.Errorf("config.yaml: %s missing", path)
			continue
		}
		if fmt.Sprint(got) != v {
			t.Errorf("config.yaml: %s = %v, want %s", path, got, v)
		}
	}
}

// secretLike matches config keys that would hold a credential inline.
var secretLike = regexp.MustCompile(`(?i)(password|passwd|token|secret|creds|credential|private|nkey|seed|^key$)`)

func checkConfigMap(t *testing.T, cm corev1.ConfigMap) map[string]any {
	t.Helper()
	if len(cm.Data) != 1 || cm.Data["config.yaml"] == "" {
		t.Fatalf("ConfigMap data keys %v, want only config.yaml", slices.Sorted(maps.Keys(cm.Data)))
	}
	if len(cm.BinaryData) != 0 {
		t.Error("ConfigMap has binaryData")
	}
	raw := cm.Data["config.yaml"]
	var cfg map[string]any
	if err := yaml.UnmarshalStrict([]byte(raw), &cfg); err != nil {
		t.Fatalf("config.yaml does not parse: %v\n%s", err, raw)
	}
	// ":8080", not "0.0.0.0:8080": an empty host listens on every
	// interface, IPv6 included (dual-stack); 0.0.0.0 is IPv4 only, which
	// an IPv6-only or dual-stack pod network cannot reach.
	wantPaths(t, cfg, map[string]string{
		"data_dir":     "/var/lib/delaybridge",
		"admin.listen": ":8080",
	})
	if _, ok := lookup(cfg, "targets.allow"); !ok {
		t.Error("config.yaml: targets.allow missing (the chart must always state it)")
	}
	// No credential inline: every secret-looking key is a *_file path under
	// the secrets mount, and no chart-only key leaks into the config.
	var walk func(prefix string, v any)
	walk = func(prefix string, v any) {
		switch v := v.(type) {
		case map[string]any:
			for k, vv := range v {
				p := strings.TrimPrefix(prefix+"."+k, ".")
				if k == "enabled" && !strings.HasSuffix(prefix, "tls") {
					t.Errorf("config.yaml: chart-only key %s leaked", p)
				}
				if strings.HasSuffix(k, "_file") {
					s, _ := vv.(string)
					if !strings.HasPrefix(s, secretsRoot) {
						t.Errorf("config.yaml: %s = %q, want a file under %s", p, s, secretsRoot)
					}
					continue
				}
				if secretLike.MatchString(k) {
					t.Errorf("config.yaml: %s looks like an inline credential", p)
				}
				walk(p, vv)
			}
		case []any:
			for i, vv := range v {
				walk(fmt.Sprintf("%s[%d]", prefix, i), vv)
			}
		}
	}
	walk("", cfg)
	if strings.Contains(raw, "secretName") {
		t.Error("config.yaml mentions secretName: chart values leaked into the config")
	}
	return cfg
}

func probePath(t *testing.T, name string, p *corev1.Probe) string {
	t.Helper()
	if p == nil {
		t.Fatalf("%s probe missing", name)
	}
	if p.HTTPGet == nil {
		t.Fatalf("%s probe is not an HTTP GET", name)
	}
	if p.HTTPGet.Port.String() != "http" {
		t.Errorf("%s probe port %s, want the named port http", name, p.HTTPGet.Port.String())
	}
	return p.HTTPGet.Path
}

func checkStatefulSet(t *testing.T, sts appsv1.StatefulSet, configMap string, cfg map[string]any) {
	t.Helper()
	if sts.Spec.Replicas == nil || *sts.Spec.Replicas != 1 {
		t.Errorf("replicas %v, want 1 (single instance per consumer group)", sts.Spec.Replicas)
	}
	// OrderedReady would never replace a pod that is not ready, so an
	// upgrade fixing a bridge stuck not-ready would not roll it.
	if sts.Spec.PodManagementPolicy != appsv1.ParallelPodManagement {
		t.Errorf("podManagementPolicy %q, want Parallel", sts.Spec.PodManagementPolicy)
	}
	pod := sts.Spec.Template.Spec
	if len(pod.Containers) != 1 {
		t.Fatalf("%d containers, want 1", len(pod.Containers))
	}
	c := pod.Containers[0]
	if want := []string{"run", "--config", "/etc/delaybridge/config.yaml"}; !slices.Equal(c.Args, want) {
		t.Errorf("args %q, want %q", c.Args, want)
	}
	if len(c.Command) != 0 {
		t.Errorf("command %q overrides the image entrypoint", c.Command)
	}
	if len(c.Ports) != 1 || c.Ports[0].Name != "http" || c.Ports[0].ContainerPort != 8080 {
		t.Errorf("ports %+v, want one port http/8080", c.Ports)
	}

	// Security: non-root, read-only root fs, nothing to escalate.
	psc := pod.SecurityContext
	if psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || psc.RunAsUser == nil || *psc.RunAsUser != 65532 ||
		psc.FSGroup == nil || psc.SeccompProfile == nil || psc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("pod securityContext %+v: want runAsNonRoot, runAsUser 65532, fsGroup, seccomp RuntimeDefault", psc)
	}
	sc := c.SecurityContext
	if sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
		sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
		sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot ||
		sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) ||
		sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("container securityContext %+v: want readOnlyRootFilesystem, no privilege escalation, non-root, drop ALL, seccomp RuntimeDefault", sc)
	}
	if pod.AutomountServiceAccountToken == nil || *pod.AutomountServiceAccountToken {
		t.Error("the service account token is mounted; the bridge never talks to the API server")
	}

	// Probes.
	if got := probePath(t, "liveness", c.LivenessProbe); got != "/healthz" {
		t.Errorf("liveness probe path %q, want /healthz", got)
	}
	if got := probePath(t, "readiness", c.ReadinessProbe); got != "/readyz" {
		t.Errorf("readiness probe path %q, want /readyz", got)
	}
	probePath(t, "startup", c.StartupProbe)
	if budget := time.Duration(c.StartupProbe.FailureThreshold*c.StartupProbe.PeriodSeconds) * time.Second; budget < 5*time.Minute {
		t.Errorf("startup probe allows %s for recovery, want at least 5m", budget)
	}

	// Resources.
	if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() || c.Resources.Limits.Memory().IsZero() {
		t.Errorf("resources %+v: want cpu/memory requests and a memory limit", c.Resources)
	}

	// GOMEMLIMIT: 90% of the memory limit, below the OOM killer; the
	// image is built without cgo, so the store's cache is Go heap too.
	gomem := ""
	seen := map[string]bool{}
	for _, e := range c.Env {
		if seen[e.Name] {
			t.Errorf("env %s rendered twice (Kubernetes keeps the last silently)", e.Name)
		}
		seen[e.Name] = true
		if e.Name == "GOMEMLIMIT" {
			gomem = e.Value
		}
	}
	if limit := c.Resources.Limits.Memory().Value(); limit > 0 {
		n, err := strconv.ParseInt(gomem, 10, 64)
		if want := limit * 9 / 10; err != nil || n < want-1 || n > want+1 {
			t.Errorf("GOMEMLIMIT %q, want 90%% of the %d byte limit (%d)", gomem, limit, want)
		}
	}

	// Graceful shutdown fits in the grace period.
	if pod.TerminationGracePeriodSeconds == nil {
		t.Fatal("terminationGracePeriodSeconds not set")
	}
	grace := time.Duration(*pod.TerminationGracePeriodSeconds) * time.Second
	if st, ok := lookup(cfg, "shutdown_timeout"); ok {
		d, err := time.ParseDuration(fmt.Sprint(st))
		if err != nil {
			t.Errorf("shutdown_timeout %v: %v", st, err)
		} else if d >= grace {
			t.Errorf("shutdown_timeout %s >= terminationGracePeriodSeconds %s", d, grace)
		}
	}

	// Volumes: data from the claim template, config from the ConfigMap,
	// credentials from the projected Secret volume.
	mounts := map[string]corev1.VolumeMount{}
	for _, vm := range c.VolumeMounts {
		mounts[vm.Name] = vm
	}
	if mounts["data"].MountPath != "/var/lib/delaybridge" {
		t.Errorf("data mounted at %q, want /var/lib/delaybridge", mounts["data"].MountPath)
	}
	if len(sts.Spec.VolumeClaimTemplates) != 1 || sts.Spec.VolumeClaimTemplates[0].Name != "data" {
		t.Errorf("volumeClaimTemplates %+v, want one named data", sts.Spec.VolumeClaimTemplates)
	} else if sts.Spec.VolumeClaimTemplates[0].Spec.Resources.Requests.Storage().IsZero() {
		t.Error("volume claim template requests no storage")
	}
	if vm := mounts["config"]; vm.MountPath != "/etc/delaybridge/config.yaml" || vm.SubPath != "config.yaml" || !vm.ReadOnly {
		t.Errorf("config mount %+v", vm)
	}
	files := map[string]bool{}
	for _, v := range pod.Volumes {
		switch v.Name {
		case "config":
			if v.ConfigMap == nil || v.ConfigMap.Name != configMap {
				t.Errorf("config volume %+v does not use ConfigMap %s", v.VolumeSource, configMap)
			}
		case "secrets":
			if v.Projected == nil {
				t.Fatalf("secrets volume is not projected: %+v", v.VolumeSource)
			}
			if m := v.Projected.DefaultMode; m == nil || *m&0o007 != 0 {
				t.Errorf("secret files mode %v readable by others", m)
			}
			if mounts["secrets"].MountPath+"/" != secretsRoot || !mounts["secrets"].ReadOnly {
				t.Errorf("secrets mount %+v, want read-only at %s", mounts["secrets"], secretsRoot)
			}
			for _, src := range v.Projected.Sources {
				if src.Secret == nil || src.Secret.Name == "" {
					t.Errorf("projected source %+v is not a named Secret", src)
					continue
				}
				for _, it := range src.Secret.Items {
					files[secretsRoot+it.Path] = true
				}
			}
		}
	}
	// Every *_file in the config exists in the pod, and every mounted
	// credential is used by the config.
	used := map[string]bool{}
	var walk func(v any)
	walk = func(v any) {
		switch v := v.(type) {
		case map[string]any:
			for k, vv := range v {
				if s, ok := vv.(string); ok && strings.HasSuffix(k, "_file") {
					used[s] = true
					if !files[s] {
						t.Errorf("config %s = %s, but no Secret is mounted there", k, s)
					}
				}
				walk(vv)
			}
		case []any:
			for _, vv := range v {
				walk(vv)
			}
		}
	}
	walk(cfg)
	for f := range files {
		if !used[f] {
			t.Errorf("Secret mounted at %s but the config does not reference it", f)
		}
	}
	if sel := sts.Spec.Selector.MatchLabels; !labelsMatch(sel, sts.Spec.Template.Labels) {
		t.Errorf("selector %v does not match pod labels %v", sel, sts.Spec.Template.Labels)
	}
}

func labelsMatch(sel, labels map[string]string) bool {
	if len(sel) == 0 {
		return false
	}
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}

func checkServices(t *testing.T, m manifests) {
	t.Helper()
	podLabels := m.statefulSets[0].Spec.Template.Labels
	headless := 0
	for _, s := range m.services {
		if len(s.Spec.Ports) != 1 || s.Spec.Ports[0].Name != "http" || s.Spec.Ports[0].Port != 8080 || s.Spec.Ports[0].TargetPort.String() != "http" {
			t.Errorf("Service %s ports %+v, want http 8080 -> http", s.Name, s.Spec.Ports)
		}
		if !labelsMatch(s.Spec.Selector, podLabels) {
			t.Errorf("Service %s selector %v does not select the pod", s.Name, s.Spec.Selector)
		}
		if s.Spec.ClusterIP == corev1.ClusterIPNone {
			headless++
			if m.statefulSets[0].Spec.ServiceName != s.Name {
				t.Errorf("StatefulSet serviceName %q, headless Service %q", m.statefulSets[0].Spec.ServiceName, s.Name)
			}
		}
	}
	if headless != 1 {
		t.Errorf("%d headless Services, want 1", headless)
	}
}

func checkServiceMonitor(t *testing.T, sm serviceMonitor, m manifests, cfg map[string]any) {
	t.Helper()
	// With an admin token the bridge asks for a token on /metrics too:
	// the metrics token when there is one, so that Prometheus holds no
	// admin credential.
	if _, ok := lookup(cfg, "admin.token_file"); ok && len(sm.Spec.Endpoints) == 1 {
		a := sm.Spec.Endpoints[0].Authorization
		if a == nil || a.Type != "Bearer" || a.Credentials.Name == "" || a.Credentials.Key == "" {
			t.Errorf("ServiceMonitor scrapes without the admin token (authorization %+v) but /metrics requires it", a)
		}
		if _, metrics := lookup(cfg, "admin.metrics_token_file"); metrics && a != nil && a.Credentials.Name != "delaybridge-metrics" {
			t.Errorf("ServiceMonitor scrapes with Secret %q, want the metrics token's (delaybridge-metrics)", a.Credentials.Name)
		}
	}
	if len(sm.Spec.Endpoints) != 1 || sm.Spec.Endpoints[0].Port != "http" || sm.Spec.Endpoints[0].Path != "/metrics" {
		t.Errorf("ServiceMonitor endpoints %+v, want port http path /metrics", sm.Spec.Endpoints)
	}
	if !slices.Equal(sm.Spec.NamespaceSelector.MatchNames, []string{namespace}) {
		t.Errorf("ServiceMonitor namespaceSelector %+v", sm.Spec.NamespaceSelector)
	}
	// Exactly one Service is scraped, not the headless twin as well.
	n := 0
	for _, s := range m.services {
		if labelsMatch(sm.Spec.Selector.MatchLabels, s.Labels) {
			n++
		}
	}
	if n != 1 {
		t.Errorf("ServiceMonitor selects %d Services, want 1", n)
	}
}

func checkPrometheusRule(t *testing.T, pr prometheusRule) {
	t.Helper()
	raw, err := os.ReadFile("prometheus/alerts.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var want ruleGroups
	if err := strictDecode(raw, &want); err != nil {
		t.Fatalf("prometheus/alerts.yaml: %v", err)
	}
	if !reflect.DeepEqual(pr.Spec, want) {
		t.Errorf("PrometheusRule spec differs from prometheus/alerts.yaml")
	}
}

func checkNetworkPolicy(t *testing.T, np networkingv1.NetworkPolicy) {
	t.Helper()
	if !slices.Equal(np.Spec.PolicyTypes, []networkingv1.PolicyType{networkingv1.PolicyTypeIngress, networkingv1.PolicyTypeEgress}) {
		t.Errorf("policyTypes %v, want Ingress and Egress", np.Spec.PolicyTypes)
	}
	if len(np.Spec.Ingress) != 1 || len(np.Spec.Ingress[0].Ports) != 1 || np.Spec.Ingress[0].Ports[0].Port.String() != "http" {
		t.Errorf("ingress %+v, want only the admin port http", np.Spec.Ingress)
	}
	dns := false
	for _, e := range np.Spec.Egress {
		for _, p := range e.Ports {
			if p.Port != nil && p.Port.IntValue() == 53 {
				dns = true
			}
		}
	}
	if !dns {
		t.Error("egress does not allow DNS")
	}
	if len(np.Spec.Egress) < 2 {
		t.Error("egress allows no broker traffic")
	}
}

// TestHelmTemplateRefuses checks the renders the chart must refuse, with the
// message that tells the operator what to do.
func TestHelmTemplateRefuses(t *testing.T) {
	kafka := []string{"--set", "config.kafka.enabled=true", "--set", "config.kafka.brokers={k:9092}",
		"--set", "config.kafka.sources[0].topic=delay", "--set", "config.kafka.sources[0].dlq=delay.dlq"}
	withToken := append([]string{"--set", "secrets.adminToken.secretName=admin"}, kafka...)
	cases := []struct {
		name string
		args []string
		want string
	}{
		{"default values: no admin token decision", nil,
			"needs an explicit auth decision: set secrets.adminToken.secretName"},
		{"kafka but no admin token decision", kafka,
			"needs an explicit auth decision"},
		{"unknown top-level key", append([]string{"--set", "bogus=1"}, withToken...),
			"additional properties 'bogus' not allowed"},
		{"unknown config key", append([]string{"--set", "config.max_dealy=1h"}, withToken...),
			"additional properties 'max_dealy' not allowed"},
		{"inline secret in config", append([]string{"--set", "config.kafka.sasl.password=hunter2"}, withToken...),
			"additional properties 'password' not allowed"},
		{"chart-owned key data_dir", append([]string{"--set", "config.data_dir=/tmp"}, withToken...),
			"additional properties 'data_dir' not allowed"},
		{"two replicas", append([]string{"--set", "replicaCount=2"}, withToken...),
			"replicaCount"},
		{"nats replicas without create", append([]string{"--set", "config.nats.enabled=true", "--set", "config.nats.sources[0].subject=delay.>",
			"--set", "config.nats.sources[0].dlq=dlq.delay", "--set", "config.nats.replicas=3"}, withToken...),
			"config.nats.replicas is set but config.nats.create is false"},
		{"nats replicas over 5", append([]string{"--set", "config.nats.enabled=true", "--set", "config.nats.sources[0].subject=delay.>",
			"--set", "config.nats.sources[0].dlq=dlq.delay", "--set", "config.nats.create=true", "--set", "config.nats.replicas=7"}, withToken...),
			"replicas"},
		{"no transport", []string{"--set", "secrets.adminToken.secretName=admin"},
			"enable at least one transport"},
		{"sasl without password secret", append([]string{"--set", "config.kafka.sasl.mechanism=PLAIN"}, withToken...),
			"secrets.kafkaSaslPassword.secretName is empty"},
		{"shutdown_timeout over grace period", append([]string{"--set", "config.shutdown_timeout=40s"}, withToken...),
			"must be below terminationGracePeriodSeconds"},
		// Not only plain seconds: Kubernetes kills a bridge whose
		// shutdown_timeout, in any unit, is not below the grace period.
		{"shutdown_timeout in minutes over grace period", append([]string{"--set", "config.shutdown_timeout=1m"}, withToken...),
			"config.shutdown_timeout (1m) must be below terminationGracePeriodSeconds (30)"},
		{"shutdown_timeout in mixed units over grace period", append([]string{"--set", "config.shutdown_timeout=29s1000ms"}, withToken...),
			"config.shutdown_timeout (29s1000ms) must be below terminationGracePeriodSeconds (30)"},
		{"shutdown_timeout in days", append([]string{"--set", "config.shutdown_timeout=1d"}, withToken...),
			"config.shutdown_timeout (1d) must be below terminationGracePeriodSeconds (30)"},
		{"binary default shutdown_timeout over grace period", append([]string{"--set", "config.shutdown_timeout=null", "--set", "terminationGracePeriodSeconds=10"}, withToken...),
			"config.shutdown_timeout (10s, the default) must be below terminationGracePeriodSeconds (10)"},
		{"memory limit below the store cache", append([]string{"--set", "resources.limits.memory=768Mi"}, withToken...),
			"resources.limits.memory 768Mi gives a GOMEMLIMIT (90% of it) that leaves less than 128Mi beside config.store.cache_mb (768 MiB)"},
		{"memtable over the schema bound", append([]string{"--set", "config.store.memtable_mb=2"}, withToken...),
			"memtable_mb"},
		{"negative reserve", append([]string{"--set", "config.store.reserve_mb=-1"}, withToken...),
			"reserve_mb"},
		// extraEnv would slip past the chart's own checks and wiring.
		{"extraEnv admin.listen", append([]string{"--set", "extraEnv[0].name=DELAYBRIDGE_ADMIN_LISTEN", "--set", "extraEnv[0].value=:9090"}, withToken...),
			"extraEnv DELAYBRIDGE_ADMIN_LISTEN would override a key the chart owns or checks"},
		{"extraEnv shutdown_timeout", append([]string{"--set", "extraEnv[0].name=GOGC", "--set", "extraEnv[0].value=50",
			"--set", "extraEnv[1].name=DELAYBRIDGE_SHUTDOWN_TIMEOUT", "--set", "extraEnv[1].value=1m"}, withToken...),
			"extraEnv DELAYBRIDGE_SHUTDOWN_TIMEOUT would override"},
		{"extraEnv store cache", append([]string{"--set", "extraEnv[0].name=DELAYBRIDGE_STORE_CACHE_MB", "--set", "extraEnv[0].value=4096"}, withToken...),
			"extraEnv DELAYBRIDGE_STORE_CACHE_MB would override"},
		{"a duration as a non-zero integer", append([]string{"--set", "config.max_delay=5"}, withToken...),
			"max_delay"},
		{"unknown SASL mechanism", append([]string{"--set", "config.kafka.sasl.mechanism=GSSAPI"}, withToken...),
			"mechanism"},
		{"metrics token without an admin token", []string{"--set", "secrets.metricsToken.secretName=m", "--set", "config.admin.allow_insecure_listen=true"},
			"secrets.metricsToken needs secrets.adminToken"},
		{"credentials in the NATS url", []string{"--set", "secrets.adminToken.secretName=admin", "--set", "config.nats.enabled=true",
			"--set", "config.nats.url=nats://alice:pw@nats:4222", "--set", "config.nats.sources[0].subject=delay.>", "--set", "config.nats.sources[0].dlq=dlq.delay"},
			"config.nats.url carries credentials"},
		// Values the bridge refuses at start fail the render, so the pod
		// does not crash-loop on them (found by an operator's bug hunt).
		{"memtable over half the cache", append([]string{"--set", "config.store.memtable_mb=500"}, withToken...),
			"config.store.memtable_mb (500) must be at most config.store.cache_mb/2 (384)"},
		{"memtable over half a smaller cache", append([]string{"--set", "config.store.cache_mb=128", "--set", "config.store.memtable_mb=65"}, withToken...),
			"config.store.memtable_mb (65) must be at most config.store.cache_mb/2 (64)"},
		{"horizon 0s", append([]string{"--set", "config.horizon=0s"}, withToken...),
			"config.horizon (0s) must be at least 1s"},
		{"horizon 999ms", append([]string{"--set", "config.horizon=999ms"}, withToken...),
			"config.horizon (999ms) must be at least 1s"},
		{"shutdown_timeout 0s", append([]string{"--set", "config.shutdown_timeout=0s"}, withToken...),
			"config.shutdown_timeout (0s) must be positive"},
		{"retry.max over 365d", append([]string{"--set", "config.retry.max=366d"}, withToken...),
			"config.retry.max (366d) must be at most 365d"},
		{"retry.initial over the default max", append([]string{"--set", "config.retry.initial=10m"}, withToken...),
			"config.retry.max (5m) must be at least config.retry.initial (10m"},
		{"retry.initial 0", append([]string{"--set", "config.retry.initial=0s"}, withToken...),
			"config.retry.initial (0s) must be positive"},
		// The integer 0, which the schema takes as a duration, is not
		// "unset" (found by a review: with and default skipped it).
		{"horizon integer 0", append([]string{"--set", "config.horizon=0"}, withToken...),
			"config.horizon (0) must be at least 1s"},
		{"retry.initial integer 0", append([]string{"--set", "config.retry.initial=0"}, withToken...),
			"config.retry.initial (0) must be positive"},
		{"retry.max integer 0", append([]string{"--set", "config.retry.max=0"}, withToken...),
			"config.retry.max (0) must be at least config.retry.initial (500ms"},
		// (after withToken, whose topic and dlq they replace)
		{"kafka topic with a space", append(slices.Clone(withToken), "--set", "config.kafka.sources[0].topic=bad topic"),
			"topic"},
		{"kafka dlq ..", append(slices.Clone(withToken), "--set", "config.kafka.sources[0].dlq=.."),
			"dlq"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			out, stderr, err := helm(t, renderArgs(tc.args...)...)
			if err == nil {
				t.Fatalf("helm template succeeded, want an error containing %q\n%s", tc.want, out)
			}
			if !strings.Contains(stderr, tc.want) {
				t.Fatalf("helm template error does not contain %q:\n%s", tc.want, stderr)
			}
		})
	}

	// The same kafka values with the decision made render fine, so the
	// cases above fail for their stated reason only.
	decodeAll(t, render(t, withToken...))
	// The bounds themselves render, and the bridge takes what they render.
	m := decodeAll(t, render(t, append([]string{"--set", "config.store.memtable_mb=384", "--set", "config.store.reserve_mb=0", "--set", "config.horizon=1s",
		"--set", "config.retry.initial=5m", "--set", "config.retry.max=365d"}, append(slices.Clone(withToken), "--set", "config.kafka.sources[0].topic=a_b-C.9")...)...))
	if cfg := loadRendered(t, m, nil); cfg.Store.MemtableMB != 384 || cfg.Store.ReserveMB != 0 || cfg.Horizon.Std() != time.Second || cfg.Retry.Max.Std() != 365*24*time.Hour || cfg.Kafka.Sources[0].Topic != "a_b-C.9" {
		t.Errorf("bounds rendered and loaded: memtable %d, reserve %d, horizon %s, retry.max %s, sources %v", cfg.Store.MemtableMB, cfg.Store.ReserveMB, cfg.Horizon, cfg.Retry.Max, cfg.Kafka.Sources)
	}
	for _, st := range []string{"29s999ms", "0.4m", "1m", "1h"} {
		decodeAll(t, render(t, append([]string{"--set", "config.shutdown_timeout=" + st, "--set", "terminationGracePeriodSeconds=3601"}, withToken...)...))
	}
	decodeAll(t, render(t, append([]string{"--set", "config.shutdown_timeout=29s999ms"}, withToken...)...))
	decodeAll(t, render(t, append([]string{"--set", "config.shutdown_timeout=null", "--set", "terminationGracePeriodSeconds=11"}, withToken...)...))
	// The cache is Go heap: its size does not change the limit.
	m = decodeAll(t, render(t, append([]string{"--set", "config.store.cache_mb=512", "--set", "resources.limits.memory=1Gi"}, withToken...)...))
	var gomem string
	for _, e := range m.statefulSets[0].Spec.Template.Spec.Containers[0].Env {
		if e.Name == "GOMEMLIMIT" {
			gomem = e.Value
		}
	}
	if want := strconv.FormatInt((1<<30)*9/10, 10); gomem != want {
		t.Errorf("GOMEMLIMIT %q with a 1Gi limit and a 512 MiB cache, want 90%% of the limit, %s", gomem, want)
	}
	decodeAll(t, render(t, append([]string{"--set", "config.admin.allow_insecure_listen=true"}, kafka...)...))
	// Other extraEnv names are the user's; 0 as an integer is a duration
	// the bridge takes ("no bound" for max_delay).
	m = decodeAll(t, render(t, append([]string{"--set", "extraEnv[0].name=DELAYBRIDGE_KAFKA_GROUP", "--set", "extraEnv[0].value=g2",
		"--set", "config.max_delay=0"}, withToken...)...))
	if cfg := loadRendered(t, m, nil); cfg.Kafka == nil || cfg.Kafka.Group != "g2" || cfg.MaxDelay != 0 {
		t.Errorf("extraEnv DELAYBRIDGE_KAFKA_GROUP and max_delay 0: loaded group %v, max_delay %v", cfg.Kafka, cfg.MaxDelay)
	}
}

func TestHelmDefaultsDenyAllTargets(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join(chartDir, "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var v struct {
		Config struct {
			Targets struct {
				Allow []string `json:"allow"`
			} `json:"targets"`
		} `json:"config"`
	}
	if err := yaml.Unmarshal(raw, &v); err != nil {
		t.Fatal(err)
	}
	if v.Config.Targets.Allow == nil || len(v.Config.Targets.Allow) != 0 {
		t.Errorf("values.yaml config.targets.allow = %v, want an explicit empty list (deny all)", v.Config.Targets.Allow)
	}
	cm := decodeAll(t, render(t, "--set", "secrets.adminToken.secretName=admin", "--set", "config.kafka.enabled=true",
		"--set", "config.kafka.brokers={k:9092}", "--set", "config.kafka.sources[0].topic=d", "--set", "config.kafka.sources[0].dlq=d.dlq")).configMaps[0]
	var cfg map[string]any
	if err := yaml.Unmarshal([]byte(cm.Data["config.yaml"]), &cfg); err != nil {
		t.Fatal(err)
	}
	allow, ok := lookup(cfg, "targets.allow")
	if l, isList := allow.([]any); !ok || !isList || len(l) != 0 {
		t.Errorf("rendered targets.allow = %#v, want []", allow)
	}
}

// TestCopiesInChart keeps the chart's copies of the alert rules and the
// dashboard (a chart cannot read files outside its directory) identical to
// the canonical files.
func TestCopiesInChart(t *testing.T) {
	for _, f := range []string{"prometheus/alerts.yaml", "grafana/delaybridge-dashboard.json"} {
		a, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		cp := filepath.Join(chartDir, "files", filepath.Base(f))
		b, err := os.ReadFile(cp)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(a, b) {
			t.Errorf("%s differs from %s: cp %s %s", cp, f, f, cp)
		}
	}
}

// exported lists the bridge's metric families and their labels, read from
// the descriptors of the real instruments.
func exported(t *testing.T) map[string][]string {
	t.Helper()
	m := metrics.New(nil)
	descRe := regexp.MustCompile(`fqName: "([^"]+)".*variableLabels: \{([^}]*)\}`)
	out := map[string][]string{}
	v := reflect.ValueOf(m).Elem()
	for i := range v.NumField() {
		c, ok := v.Field(i).Interface().(prometheus.Collector)
		if !ok {
			continue
		}
		ch := make(chan *prometheus.Desc, 4)
		go func() { c.Describe(ch); close(ch) }()
		for d := range ch {
			sm := descRe.FindStringSubmatch(d.String())
			if sm == nil {
				t.Fatalf("cannot parse %s", d)
			}
			var labels []string
			if sm[2] != "" {
				labels = strings.Split(sm[2], ",")
			}
			name := sm[1]
			out[name] = labels
			if _, isHist := c.(prometheus.ObserverVec); isHist {
				for _, s := range []string{"_bucket", "_sum", "_count"} {
					out[name+s] = append(slices.Clone(labels), "le")
				}
			}
		}
	}
	if len(out) == 0 {
		t.Fatal("no metrics found in package metrics")
	}
	return out
}

var (
	metricRe = regexp.MustCompile(`\bdelaybridge_[a-z0-9_]+\b`)
	byRe     = regexp.MustCompile(`\b(?:by|without)\s*\(([^)]*)\)`)
)

// checkExpr fails when expr names a metric the bridge does not export, or
// groups by a label none of its metrics carries.
func checkExpr(t *testing.T, where, expr string, known map[string][]string) []string {
	t.Helper()
	names := metricRe.FindAllString(expr, -1)
	if len(names) == 0 {
		t.Errorf("%s: expression uses no delaybridge metric: %s", where, expr)
	}
	labels := map[string]bool{"le": true, "job": true, "instance": true, "namespace": true, "pod": true}
	for _, n := range names {
		ls, ok := known[n]
		if !ok {
			t.Errorf("%s: metric %s is not exported by package metrics", where, n)
		}
		for _, l := range ls {
			labels[l] = true
		}
	}
	for _, g := range byRe.FindAllStringSubmatch(expr, -1) {
		for _, l := range strings.Split(g[1], ",") {
			if l = strings.TrimSpace(l); l != "" && !labels[l] {
				t.Errorf("%s: label %q is not on %v", where, l, names)
			}
		}
	}
	return names
}

// TestAlertsPromtool runs the rule unit tests of testdata/alerts_*_test.yaml
// with promtool (Debian: apt-get install prometheus) when it is on PATH;
// TestAlertRules checks the rules without it.
func TestAlertsPromtool(t *testing.T) {
	files, err := filepath.Glob("testdata/alerts_*_test.yaml")
	if err != nil || len(files) < 2 {
		t.Fatalf("rule tests %v (%v): want alerts_target_test.yaml and alerts_disk_test.yaml at least", files, err)
	}
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		if os.Getenv("CI") != "" {
			// .ci/run installs it: a CI run that skips here tests no alert.
			t.Fatal("promtool not on PATH under CI (Debian: apt-get install prometheus)")
		}
		t.Skip("promtool not on PATH")
	}
	for _, f := range files {
		cmd := exec.Command(promtool, "test", "rules", filepath.Base(f))
		cmd.Dir = "testdata"
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("promtool test rules %s: %v\n%s", f, err, out)
		}
	}
}

func TestAlertRules(t *testing.T) {
	raw, err := os.ReadFile("prometheus/alerts.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var rg ruleGroups
	if err := strictDecode(raw, &rg); err != nil {
		t.Fatalf("prometheus/alerts.yaml: %v", err)
	}
	known := exported(t)
	alerts := map[string]string{}
	for _, g := range rg.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" || r.Expr == "" || r.Labels["severity"] == "" || r.Annotations["summary"] == "" {
				t.Errorf("rule %+v: want alert, expr, severity label and summary", r)
			}
			if r.For != "" {
				if _, err := time.ParseDuration(r.For); err != nil {
					t.Errorf("%s: for %q: %v", r.Alert, r.For, err)
				}
			}
			checkExpr(t, r.Alert, r.Expr, known)
			alerts[r.Alert] = r.Expr + " for " + r.For
		}
	}
	for name, want := range map[string]string{
		"DelaybridgeNotReady": "delaybridge_ready == 0 for 5m",
		// Down, crash-looping or recovering: no delaybridge_ready at all.
		"DelaybridgeDown": "up == 0",
		// No target at all (a Pending or lost pod): up is absent.
		"DelaybridgeTargetGone":       "unless on (job, namespace, pod) up",
		"DelaybridgeFireLatenessHigh": "histogram_quantile(0.99",
		"DelaybridgeDeadLettering":    "delaybridge_dead_lettered_total",
		// A DLQ failing as a whole, not only not ready (hunt H202).
		"DelaybridgeDeadLettersFailing": "delaybridge_dead_letters_failing > 0 for 5m",
		"DelaybridgeStoreErrors":        "delaybridge_store_errors_total",
		// Before the volume is full (hunt H151): bytes against the
		// reserve and the size, and inodes.
		"DelaybridgeStoreDiskLow": "delaybridge_store_disk_free_inodes < 0.05 * delaybridge_store_disk_inodes",
		// Falling behind, not catching up (hunt H170).
		"DelaybridgeSourceBehind": "offset 15m",
		// A forgotten pause holds every delivery, across restarts.
		"DelaybridgeFiringPausedByOperator": "time() - delaybridge_firing_paused_by_operator_since_seconds > 7200",
	} {
		if !strings.Contains(alerts[name], want) {
			t.Errorf("alert %s = %q, want it to contain %q", name, alerts[name], want)
		}
	}
	if !strings.Contains(alerts["DelaybridgeFireLatenessHigh"], "> 1") {
		t.Error("DelaybridgeFireLatenessHigh does not fire above 1 s")
	}
}

func TestGrafanaDashboard(t *testing.T) {
	raw, err := os.ReadFile("grafana/delaybridge-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	type target struct {
		Datasource struct {
			Type string `json:"type"`
			UID  string `json:"uid"`
		} `json:"datasource"`
		Expr string `json:"expr"`
	}
	type panel struct {
		ID      int                      `json:"id"`
		Type    string                   `json:"type"`
		Title   string                   `json:"title"`
		GridPos struct{ X, Y, W, H int } `json:"gridPos"`
		Targets []target                 `json:"targets"`
	}
	var d struct {
		UID           string  `json:"uid"`
		Title         string  `json:"title"`
		SchemaVersion int     `json:"schemaVersion"`
		Panels        []panel `json:"panels"`
		Templating    struct {
			List []struct {
				Name  string `json:"name"`
				Type  string `json:"type"`
				Query any    `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatalf("dashboard JSON: %v", err)
	}
	if d.SchemaVersion < 36 || d.UID == "" || d.Title == "" {
		t.Errorf("schemaVersion %d uid %q title %q", d.SchemaVersion, d.UID, d.Title)
	}
	dsVar := false
	for _, v := range d.Templating.List {
		if v.Name == "DS_PROMETHEUS" && v.Type == "datasource" && v.Query == "prometheus" {
			dsVar = true
		}
	}
	if !dsVar {
		t.Error("no datasource variable DS_PROMETHEUS of type prometheus")
	}
	known := exported(t)
	ids := map[int]bool{}
	used := map[string]bool{}
	for _, p := range d.Panels {
		if ids[p.ID] {
			t.Errorf("panel id %d used twice", p.ID)
		}
		ids[p.ID] = true
		if p.GridPos.W <= 0 || p.GridPos.X+p.GridPos.W > 24 {
			t.Errorf("panel %q: gridPos %+v outside 24 columns", p.Title, p.GridPos)
		}
		if p.Type == "row" {
			continue
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no queries", p.Title)
		}
		for _, tg := range p.Targets {
			if tg.Datasource.UID != "${DS_PROMETHEUS}" {
				t.Errorf("panel %q: datasource %q, want ${DS_PROMETHEUS}", p.Title, tg.Datasource.UID)
			}
			for _, n := range checkExpr(t, p.Title, tg.Expr, known) {
				used[n] = true
			}
		}
	}
	for _, want := range []string{
		"delaybridge_ingested_total", "delaybridge_fired_total", "delaybridge_pending_tasks",
		"delaybridge_fire_lateness_seconds_bucket", "delaybridge_dead_lettered_total",
		"delaybridge_store_commit_seconds_bucket", "delaybridge_publish_retries_total",
		"delaybridge_ready", "delaybridge_best_effort_deliveries_total",
		// What keeps the bridge not ready with an alert of its own, and
		// the catch-up pause (hunt H200: on no panel).
		"delaybridge_dead_letters_parked", "delaybridge_dead_letters_failing", "delaybridge_undecodable_entries", "delaybridge_firing_paused", "delaybridge_firing_paused_by_operator",
		"delaybridge_store_disk_free_inodes",
	} {
		if !used[want] {
			t.Errorf("no panel shows %s", want)
		}
	}
	var missing []string
	for n := range known {
		if !used[n] && !strings.HasSuffix(n, "_sum") && !strings.HasSuffix(n, "_count") && !strings.HasSuffix(n, "_bucket") && !used[n+"_bucket"] {
			missing = append(missing, n)
		}
	}
	sort.Strings(missing)
	if len(missing) > 0 {
		t.Logf("metrics not on the dashboard: %v", missing)
	}
}

// renderNotes renders NOTES.txt, which `helm template` leaves out: a copy
// of the chart gets a ConfigMap template holding `tpl` of the notes.
func renderNotes(t *testing.T, extra ...string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "delaybridge")
	if err := os.CopyFS(dir, os.DirFS(chartDir)); err != nil {
		t.Fatal(err)
	}
	notes, err := os.ReadFile(filepath.Join(dir, "templates", "NOTES.txt"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "files", "NOTES.txt"), notes, 0o644); err != nil {
		t.Fatal(err)
	}
	wrapper := "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n  NOTES.txt: {{ tpl (.Files.Get \"files/NOTES.txt\") . | quote }}\n"
	if err := os.WriteFile(filepath.Join(dir, "templates", "zz-notes.yaml"), []byte(wrapper), 0o644); err != nil {
		t.Fatal(err)
	}
	args := append([]string{"template", releaseName, dir, "--namespace", namespace, "--show-only", "templates/zz-notes.yaml"}, extra...)
	out, stderr, err := helm(t, args...)
	if err != nil {
		t.Fatalf("render NOTES.txt: %v\n%s", err, stderr)
	}
	var cm corev1.ConfigMap
	if err := strictDecode([]byte(out), &cm); err != nil {
		t.Fatal(err)
	}
	return cm.Data["NOTES.txt"]
}

func TestHelmNotes(t *testing.T) {
	all := renderNotes(t, "-f", filepath.Join(chartDir, "ci", "all-features-values.yaml"))
	for _, want := range []string{
		"exec db-delaybridge-0 -- /delaybridge firing pause --config /etc/delaybridge/config.yaml",
		"single-instance per consumer group",
		"kcat -P -b kafka:9092 -t delay", "-H delay-after=30s", "-H delay-at=", "-H delay-target=orders.expire",
		"nats --server nats://nats:4222 pub delay.reminder", "-H delay-after:15m", "-H delay-at:", "-H delay-target:reminders.send",
		"port-forward svc/db-delaybridge 8080:http", "/v1/stats", "/v1/stuck", "DELETE /v1/stuck/SHARD/SEQ", "Authorization: Bearer",
	} {
		if !strings.Contains(all, want) {
			t.Errorf("NOTES.txt (all features) does not contain %q:\n%s", want, all)
		}
	}
	if strings.Contains(all, "WARNING") {
		t.Errorf("NOTES.txt warns although targets are allowed and a token is set:\n%s", all)
	}
	// The delay-at examples are due after the install, not at a date that
	// has passed (the cancel example: TestKcatCancelExamples).
	ats := regexp.MustCompile(`delay-at[=:](\S+)`).FindAllStringSubmatch(all, -1)
	if len(ats) != 2 {
		t.Errorf("NOTES.txt has %d delay-at examples, want 2 (Kafka and NATS):\n%s", len(ats), all)
	}
	for _, m := range ats {
		at, err := time.Parse(time.RFC3339, m[1])
		if err != nil || !at.After(time.Now()) {
			t.Errorf("NOTES.txt example delay-at %q: %v; want an RFC 3339 time after now", m[1], err)
		}
	}
	if !strings.Contains(all, "a target subject without a JetStream stream is best effort") {
		t.Errorf("NOTES.txt with nats.core_targets does not say a subject without a stream is best effort:\n%s", all)
	}
	if !strings.Contains(all, "PVC data-db-delaybridge-0") {
		t.Errorf("NOTES.txt with persistence does not name the PVC:\n%s", all)
	}
	// Without persistence the store is an emptyDir: the notes say so and
	// warn that the pending tasks go with the pod, rather than name a PVC
	// that does not exist.
	ephemeral := renderNotes(t, "-f", filepath.Join(chartDir, "ci", "all-features-values.yaml"), "--set", "persistence.enabled=false")
	for _, want := range []string{"(an emptyDir at", "WARNING: persistence.enabled=false", "Every pending task", "set persistence.enabled=true"} {
		if !strings.Contains(ephemeral, want) {
			t.Errorf("NOTES.txt without persistence does not contain %q:\n%s", want, ephemeral)
		}
	}
	if strings.Contains(ephemeral, "PVC") {
		t.Errorf("NOTES.txt without persistence names a PVC:\n%s", ephemeral)
	}
	insecure := renderNotes(t, "--set", "config.admin.allow_insecure_listen=true", "--set", "config.nats.enabled=true",
		"--set", "config.nats.sources[0].subject=delay.>", "--set", "config.nats.sources[0].dlq=dlq.delay",
		"--set", "networkPolicy.enabled=true", "--set", "serviceMonitor.enabled=true")
	for _, want := range []string{"config.targets.allow is empty, so NO delay-target is allowed", "is served without a",
		"dead-lettered as publish-failed: config.nats.core_targets is false",
		"networkPolicy.ingressFrom admits only pods of namespace"} {
		if !strings.Contains(insecure, want) {
			t.Errorf("NOTES.txt does not warn %q:\n%s", want, insecure)
		}
	}
}

// TestHelmAdminBlock checks the admin block the chart renders, as the
// bridge loads it: the listen address follows service.port on every
// interface (dual-stack), and config.admin.pprof is off unless set.
func TestHelmAdminBlock(t *testing.T) {
	base := []string{"-f", filepath.Join(chartDir, "ci", "default-values.yaml")}
	for _, tc := range []struct {
		name   string
		args   []string
		listen string
		pprof  bool
	}{
		{"defaults", nil, ":8080", false},
		{"another port", []string{"--set", "service.port=9090"}, ":9090", false},
		{"pprof", []string{"--set", "config.admin.pprof=true"}, ":8080", true},
		{"pprof off", []string{"--set", "config.admin.pprof=false"}, ":8080", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := decodeAll(t, render(t, append(base, tc.args...)...))
			cfg := loadRendered(t, m, nil)
			if cfg.Admin.Listen != tc.listen || cfg.Admin.Pprof != tc.pprof {
				t.Errorf("admin.listen %q, admin.pprof %v; want %q, %v\n%s", cfg.Admin.Listen, cfg.Admin.Pprof, tc.listen, tc.pprof, m.configMaps[0].Data["config.yaml"])
			}
		})
	}
	// The schema takes only a boolean.
	_, stderr, err := helm(t, renderArgs(append(base, "--set", "config.admin.pprof=yes")...)...)
	if err == nil || !strings.Contains(stderr, "/config/admin/pprof") {
		t.Errorf("config.admin.pprof=yes: want a schema error naming /config/admin/pprof, got %v\n%s", err, stderr)
	}
}

// TestHelmGoMemLimitQuantities renders resources.limits.memory in the forms
// Kubernetes accepts and checks GOMEMLIMIT is 90% of the limit, read as
// Kubernetes reads it (resource.Quantity, fractional bytes rounded up),
// whatever the store's cache (Go heap in the image). A limit the chart
// cannot read fails the render rather than leave the heap unbounded.
func TestHelmGoMemLimitQuantities(t *testing.T) {
	base := []string{"-f", filepath.Join(chartDir, "ci", "default-values.yaml")}
	const valuesFile = "values file: " // the rest of the argument is written to a file passed with -f
	for _, tc := range []struct {
		name    string
		limit   string   // the limit as Kubernetes reads it; "" for an error case
		args    []string // set resources.limits.memory (and more)
		cacheMB int64
		wantErr string
	}{
		{"Mi", "1536Mi", []string{"--set-string", "resources.limits.memory=1536Mi"}, 768, ""},
		{"decimal Gi", "1.5Gi", []string{"--set-string", "resources.limits.memory=1.5Gi"}, 768, ""},
		{"decimal Gi rounded up", "1.1Gi", []string{"--set-string", "resources.limits.memory=1.1Gi"}, 768, ""},
		{"M", "1536M", []string{"--set-string", "resources.limits.memory=1536M"}, 768, ""},
		{"G", "2G", []string{"--set-string", "resources.limits.memory=2G"}, 768, ""},
		{"decimal G", "2.5G", []string{"--set-string", "resources.limits.memory=2.5G"}, 768, ""},
		{"k", "2000000k", []string{"--set-string", "resources.limits.memory=2000000k"}, 768, ""},
		{"Ti", "1Ti", []string{"--set-string", "resources.limits.memory=1Ti"}, 768, ""},
		{"plain bytes string", "1610612736", []string{"--set-string", "resources.limits.memory=1610612736"}, 768, ""},
		{"plain bytes int", "1610612736", []string{"--set", "resources.limits.memory=1610612736"}, 768, ""},
		{"exponent", "1.2e9", []string{"--set-string", "resources.limits.memory=1.2e9"}, 768, ""},
		{"signed exponent", "2E+09", []string{"--set-string", "resources.limits.memory=2E+09"}, 768, ""},
		{"leading plus", "+2Gi", []string{"--set-string", "resources.limits.memory=+2Gi"}, 768, ""},
		{"milli", "1610612736000m", []string{"--set-string", "resources.limits.memory=1610612736000m"}, 768, ""},
		{"exa", "2E", []string{"--set-string", "resources.limits.memory=2E"}, 768, ""},
		{"smaller cache", "1.5Gi", []string{"--set-string", "resources.limits.memory=1.5Gi", "--set", "config.store.cache_mb=256"}, 256, ""},
		// In a values file a bare number is a YAML number, which Helm
		// holds as a float64 and prints in exponent form.
		{"plain bytes YAML number", "1610612736", []string{valuesFile + "resources: {limits: {memory: 1610612736}}"}, 768, ""},
		{"exponent YAML number", "2e9", []string{valuesFile + "resources: {limits: {memory: 2e9}}"}, 768, ""},
		{"lower-case suffix", "", []string{"--set-string", "resources.limits.memory=1.5gi"}, 0,
			`resources.limits.memory "1.5gi" is not a Kubernetes quantity the chart can read`},
		{"space before the suffix", "", []string{"--set-string", "resources.limits.memory=1536 Mi"}, 0,
			"write it in Mi or Gi, or set goMemLimitFromResources: false and GOMEMLIMIT yourself through extraEnv"},
		{"exponent and suffix", "", []string{"--set-string", "resources.limits.memory=1e3Mi"}, 0,
			`resources.limits.memory "1e3Mi" is not a Kubernetes quantity`},
		{"negative", "", []string{"--set-string", "resources.limits.memory=-2Gi"}, 0,
			`resources.limits.memory "-2Gi" is not a Kubernetes quantity`},
		{"decimal unit below the cache", "", []string{"--set-string", "resources.limits.memory=900M"}, 0,
			"resources.limits.memory 900M gives a GOMEMLIMIT (90% of it) that leaves less than 128Mi beside config.store.cache_mb (768 MiB)"},
		// 90% of 995Mi is 895.5Mi, under 768+128: the GC would thrash
		// once the cache filled (review finding: 896Mi-995Mi rendered).
		{"limit whose 90% is under cache + 128Mi", "", []string{"--set-string", "resources.limits.memory=995Mi"}, 0,
			"resources.limits.memory 995Mi gives a GOMEMLIMIT (90% of it) that leaves less than 128Mi beside config.store.cache_mb (768 MiB)"},
		{"smallest limit whose 90% leaves 128Mi", "996Mi", []string{"--set-string", "resources.limits.memory=996Mi"}, 768, ""},
		{"too large", "", []string{"--set-string", "resources.limits.memory=1e30"}, 0,
			"resources.limits.memory 1e30 is too large for GOMEMLIMIT"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := slices.Clone(base)
			for _, a := range tc.args {
				if body, ok := strings.CutPrefix(a, valuesFile); ok {
					p := filepath.Join(t.TempDir(), "values.yaml")
					if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
						t.Fatal(err)
					}
					args = append(args, "-f", p)
				} else {
					args = append(args, a)
				}
			}
			if tc.wantErr != "" {
				out, stderr, err := helm(t, renderArgs(args...)...)
				if err == nil {
					t.Fatalf("helm template succeeded, want an error containing %q\n%s", tc.wantErr, out)
				}
				if !strings.Contains(stderr, tc.wantErr) {
					t.Fatalf("helm template error does not contain %q:\n%s", tc.wantErr, stderr)
				}
				return
			}
			m := decodeAll(t, render(t, args...))
			c := m.statefulSets[0].Spec.Template.Spec.Containers[0]
			limit := resource.MustParse(tc.limit)
			if got := c.Resources.Limits.Memory(); got.Cmp(limit) != 0 {
				t.Fatalf("rendered memory limit %s, want %s", got, tc.limit)
			}
			var gomem *corev1.EnvVar
			for i, e := range c.Env {
				if e.Name == "GOMEMLIMIT" {
					gomem = &c.Env[i]
				}
			}
			v := limit.Value()
			want := strconv.FormatInt(v/10*9+v%10*9/10, 10) // 9*v/10 without overflow
			if gomem == nil || gomem.ValueFrom != nil || gomem.Value != want {
				t.Errorf("GOMEMLIMIT %+v with a %s limit and a %d MiB cache, want value %s", gomem, tc.limit, tc.cacheMB, want)
			}
		})
	}
}

// TestHelmGoMemLimitExtraEnv: a GOMEMLIMIT the user sets through extraEnv
// wins over the one goMemLimitFromResources computes, which is then not
// rendered (the variable twice in one container, Kubernetes silently keeps
// the last) nor computed (a limit the chart cannot read or one below the
// cache does not fail the render: the user has taken the limit on). Any
// other extraEnv leaves the computed one in place.
func TestHelmGoMemLimitExtraEnv(t *testing.T) {
	base := []string{"-f", filepath.Join(chartDir, "ci", "default-values.yaml")}
	computed := strconv.FormatInt((1536<<20)*9/10, 10) // 90% of the default 1536Mi limit
	for _, tc := range []struct {
		name   string
		values string // written to a file passed with -f after base
		want   corev1.EnvVar
	}{
		{"user value", `
extraEnv:
  - {name: DELAYBRIDGE_LOG_LEVEL, value: debug}
  - {name: GOMEMLIMIT, value: 600MiB}
`, corev1.EnvVar{Name: "GOMEMLIMIT", Value: "600MiB"}},
		{"user valueFrom", `
extraEnv:
  - name: GOMEMLIMIT
    valueFrom: {configMapKeyRef: {name: tuning, key: gomemlimit}}
`, corev1.EnvVar{Name: "GOMEMLIMIT", ValueFrom: &corev1.EnvVarSource{ConfigMapKeyRef: &corev1.ConfigMapKeySelector{
			LocalObjectReference: corev1.LocalObjectReference{Name: "tuning"}, Key: "gomemlimit"}}}},
		{"user value with a limit below the cache", `
resources: {limits: {memory: 900M}}
extraEnv:
  - {name: GOMEMLIMIT, value: 100MiB}
`, corev1.EnvVar{Name: "GOMEMLIMIT", Value: "100MiB"}},
		{"user value without goMemLimitFromResources", `
goMemLimitFromResources: false
extraEnv:
  - {name: GOMEMLIMIT, value: 600MiB}
`, corev1.EnvVar{Name: "GOMEMLIMIT", Value: "600MiB"}},
		{"other extraEnv", `
extraEnv:
  - {name: DELAYBRIDGE_LOG_LEVEL, value: debug}
  - {name: GOMEMLIMIT_NOTE, value: not the Go runtime's}
`, corev1.EnvVar{Name: "GOMEMLIMIT", Value: computed}},
		{"no extraEnv", "", corev1.EnvVar{Name: "GOMEMLIMIT", Value: computed}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "values.yaml")
			if err := os.WriteFile(p, []byte(tc.values), 0o600); err != nil {
				t.Fatal(err)
			}
			m := decodeAll(t, render(t, append(slices.Clone(base), "-f", p)...))
			c := m.statefulSets[0].Spec.Template.Spec.Containers[0]
			var got []corev1.EnvVar
			for _, e := range c.Env {
				if e.Name == "GOMEMLIMIT" {
					got = append(got, e)
				}
			}
			if len(got) != 1 || !reflect.DeepEqual(got[0], tc.want) {
				t.Errorf("GOMEMLIMIT rendered as %+v, want exactly %+v", got, tc.want)
			}
			if strings.Contains(tc.values, "DELAYBRIDGE_LOG_LEVEL") && !slices.ContainsFunc(c.Env, func(e corev1.EnvVar) bool {
				return e.Name == "DELAYBRIDGE_LOG_LEVEL" && e.Value == "debug"
			}) {
				t.Errorf("env %+v lacks the extraEnv DELAYBRIDGE_LOG_LEVEL=debug", c.Env)
			}
		})
	}
}

// TestHelmTemplateVariants renders the less common switches and decodes them
// strictly: no persistence, an image digest, an existing service account,
// no memory limit.
func TestHelmTemplateVariants(t *testing.T) {
	base := []string{"-f", filepath.Join(chartDir, "ci", "default-values.yaml")}
	m := decodeAll(t, render(t, append(base,
		"--set", "persistence.enabled=false",
		"--set", "image.digest=sha256:"+strings.Repeat("ab", 32),
		"--set", "serviceAccount.create=false", "--set", "serviceAccount.name=existing",
		"--set", "resources.limits=null",
	)...))
	if len(m.serviceAccounts) != 0 {
		t.Error("ServiceAccount rendered with serviceAccount.create=false")
	}
	sts := m.statefulSets[0]
	pod := sts.Spec.Template.Spec
	if pod.ServiceAccountName != "existing" {
		t.Errorf("serviceAccountName %q, want existing", pod.ServiceAccountName)
	}
	if len(sts.Spec.VolumeClaimTemplates) != 0 || sts.Spec.PersistentVolumeClaimRetentionPolicy != nil {
		t.Error("volume claim template rendered with persistence.enabled=false")
	}
	data := false
	for _, v := range pod.Volumes {
		if v.Name == "data" && v.EmptyDir != nil {
			data = true
		}
	}
	if !data {
		t.Error("no emptyDir data volume without persistence")
	}
	c := pod.Containers[0]
	if !strings.HasSuffix(c.Image, "@sha256:"+strings.Repeat("ab", 32)) {
		t.Errorf("image %q does not use the digest", c.Image)
	}
	for _, e := range c.Env {
		if e.Name == "GOMEMLIMIT" {
			t.Error("GOMEMLIMIT set without a memory limit")
		}
	}
}

func checkDashboardConfigMap(t *testing.T, cm corev1.ConfigMap) {
	t.Helper()
	if cm.Labels["grafana_dashboard"] != "1" || cm.Namespace != "monitoring" {
		t.Errorf("dashboard ConfigMap %s/%s labels %v: want namespace monitoring and grafana_dashboard=1", cm.Namespace, cm.Name, cm.Labels)
	}
	want, err := os.ReadFile("grafana/delaybridge-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var a, b any
	if err := json.Unmarshal(want, &a); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal([]byte(cm.Data["delaybridge-dashboard.json"]), &b); err != nil {
		t.Fatalf("dashboard in ConfigMap is not JSON: %v", err)
	}
	if !reflect.DeepEqual(a, b) {
		t.Error("dashboard in ConfigMap differs from grafana/delaybridge-dashboard.json")
	}
}

// Long names stay within Kubernetes' limits: the StatefulSet's pods get a
// controller-revision-hash label of its name plus 11 characters (at most
// 63), and the headless Service's name is the full name plus "-headless".
func TestHelmLongNames(t *testing.T) {
	base := []string{"-f", filepath.Join(chartDir, "ci", "default-values.yaml")}
	long := strings.Repeat("a", 60)
	for _, args := range [][]string{
		{"--set", "fullnameOverride=" + long},
		{"--set", "nameOverride=" + long},
	} {
		m := decodeAll(t, render(t, append(base, args...)...))
		if n := m.statefulSets[0].Name; len(n)+11 > 63 {
			t.Errorf("%v: StatefulSet %q (%d characters) gives a revision-hash label over 63", args, n, len(n))
		}
		for _, s := range m.services {
			if len(s.Name) > 63 {
				t.Errorf("%v: Service %q over 63 characters", args, s.Name)
			}
		}
	}
}

// The schema takes a SASL mechanism in any case, as the binary does.
func TestHelmSASLMechanismAnyCase(t *testing.T) {
	base := []string{"-f", filepath.Join(chartDir, "ci", "kafka-sasl-tls-values.yaml")}
	for _, mech := range []string{"Scram-Sha-256", "plain", "SCRAM-SHA-512"} {
		render(t, append(base, "--set", "config.kafka.sasl.mechanism="+mech)...)
	}
}

// The NetworkPolicy lets in the listed peers only: an empty list lets no
// peer in (a rule without "from" would let every peer in).
func TestHelmNetworkPolicyPeers(t *testing.T) {
	base := []string{"-f", filepath.Join(chartDir, "ci", "default-values.yaml"), "--set", "networkPolicy.enabled=true"}
	m := decodeAll(t, render(t, append(base, "--set", "networkPolicy.ingressFrom[0].namespaceSelector.matchLabels.team=obs")...))
	if in := m.netpols[0].Spec.Ingress; len(in) != 1 || len(in[0].From) != 1 {
		t.Fatalf("ingress %+v, want one rule from the listed peer", in)
	}
	m = decodeAll(t, render(t, append(base, "--set", "networkPolicy.ingressFrom=null")...))
	if in := m.netpols[0].Spec.Ingress; len(in) != 0 {
		t.Fatalf("ingress %+v with no peers listed, want none (deny all)", in)
	}
}
