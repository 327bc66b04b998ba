package deploy

import (
	"encoding/json"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/delaybridge/delaybridge/metrics"
)

// targetLabels are the labels Prometheus adds to every series of a scrape
// (job, instance; namespace and pod with Kubernetes service discovery).
var targetLabels = []string{"job", "instance", "namespace", "pod"}

var (
	valuesOnce sync.Once
	valuesOf   map[string]map[string][]string // family, label: the values it takes
)

// exportedValues returns, per metric family, the values each label takes
// where the bridge fixes them at start: dead-letter reasons, stuck states,
// fired kinds, drop reasons, and the transports (InitSeries with both).
// Labels fed by the config (source) or the store (shard, op) are absent.
func exportedValues(t *testing.T) map[string]map[string][]string {
	t.Helper()
	valuesOnce.Do(func() {
		reg := prometheus.NewRegistry()
		m := metrics.New(reg)
		m.InitSeries([]string{"any-source"}, []string{"kafka", "nats"})
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatalf("gather: %v", err)
		}
		valuesOf = map[string]map[string][]string{}
		for _, mf := range mfs {
			byLabel := map[string][]string{}
			for _, mt := range mf.GetMetric() {
				for _, lp := range mt.GetLabel() {
					if lp.GetName() == "source" {
						continue
					}
					if !slices.Contains(byLabel[lp.GetName()], lp.GetValue()) {
						byLabel[lp.GetName()] = append(byLabel[lp.GetName()], lp.GetValue())
					}
				}
			}
			valuesOf[mf.GetName()] = byLabel
		}
	})
	return valuesOf
}

var (
	selectorRe = regexp.MustCompile(`\b(delaybridge_[a-z0-9_]+)\s*\{([^}]*)\}`)
	matcherRe  = regexp.MustCompile(`^\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"\s*$`)
	joinRe     = regexp.MustCompile(`\b(?:on|ignoring)\s*\(([^)]*)\)`)
)

// family is the metric family of a series name: a histogram's _bucket,
// _sum and _count series belong to the name without the suffix.
func family(name string, known map[string][]string) string {
	for _, s := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(name, s); ok {
			if _, isMetric := known[base]; isMetric {
				return base
			}
		}
	}
	return name
}

// checkSelectors fails when a selector of expr matches on a label its
// metric does not carry, an equality matcher names a value the label
// never takes (kind="tasks", a reason that is no delay-error code), or
// an on()/ignoring() names a label none of the expression's metrics has.
func checkSelectors(t *testing.T, where, expr string, known map[string][]string) {
	t.Helper()
	values := exportedValues(t)
	all := map[string]bool{}
	for _, l := range targetLabels {
		all[l] = true
	}
	for _, sm := range selectorRe.FindAllStringSubmatch(expr, -1) {
		name := sm[1]
		labels := append(slices.Clone(targetLabels), known[name]...)
		for _, l := range labels {
			all[l] = true
		}
		for _, m := range strings.Split(sm[2], ",") {
			if strings.TrimSpace(m) == "" {
				continue
			}
			mm := matcherRe.FindStringSubmatch(m)
			if mm == nil {
				t.Errorf("%s: cannot read matcher %q of %s", where, m, name)
				continue
			}
			label, op, value := mm[1], mm[2], mm[3]
			if !slices.Contains(labels, label) {
				t.Errorf("%s: %s has no label %q (it has %v)", where, name, label, labels)
				continue
			}
			if vs := values[family(name, known)][label]; op == "=" && len(vs) > 0 && !slices.Contains(vs, value) {
				t.Errorf("%s: %s{%s=%q}: %s takes only %v", where, name, label, value, label, vs)
			}
		}
	}
	for _, n := range metricRe.FindAllString(expr, -1) {
		for _, l := range known[n] {
			all[l] = true
		}
	}
	for _, g := range joinRe.FindAllStringSubmatch(expr, -1) {
		for _, l := range strings.Split(g[1], ",") {
			if l = strings.TrimSpace(l); l != "" && !all[l] {
				t.Errorf("%s: on/ignoring label %q is on none of the expression's series", where, l)
			}
		}
	}
}

var (
	aggByRe      = regexp.MustCompile(`^(?:sum|max|min|avg|count|group)\s+by\s*\(([^)]*)\)`)
	aggWithoutRe = regexp.MustCompile(`^(?:sum|max|min|avg|count|group)\s+without\s*\(([^)]*)\)`)
	quantileRe   = regexp.MustCompile(`^histogram_quantile\s*\(\s*[0-9.]+\s*,\s*`)
	// leadingMetricRe: the expression starts with a bridge metric, maybe
	// inside functions that keep its labels (rate, increase, ...).
	leadingMetricRe = regexp.MustCompile(`^(?:[a-z_]+\s*\()*delaybridge_`)
)

// outputLabels are the labels of the series expr returns, as far as its
// outermost aggregation says: by (L) keeps L, without (L) drops L from
// its metric's labels, histogram_quantile drops le; with no aggregation
// the series keep the labels of the metric they start with (a non-bridge
// metric such as up: the target labels).
func outputLabels(expr string, known map[string][]string) map[string]bool {
	e := strings.TrimSpace(expr)
	quantile := false
	if loc := quantileRe.FindStringIndex(e); loc != nil {
		e, quantile = e[loc[1]:], true
	}
	out := map[string]bool{}
	if sm := aggByRe.FindStringSubmatch(e); sm != nil {
		for _, l := range strings.Split(sm[1], ",") {
			if l = strings.TrimSpace(l); l != "" {
				out[l] = true
			}
		}
	} else {
		for _, l := range targetLabels {
			out[l] = true
		}
		if leadingMetricRe.MatchString(e) || aggWithoutRe.MatchString(e) {
			for _, l := range known[metricRe.FindString(e)] {
				out[l] = true
			}
		}
		if sm := aggWithoutRe.FindStringSubmatch(e); sm != nil {
			for _, l := range strings.Split(sm[1], ",") {
				delete(out, strings.TrimSpace(l))
			}
		}
	}
	if quantile {
		delete(out, "le")
	}
	return out
}

var (
	legendRe     = regexp.MustCompile(`\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}`)
	labelsUsedRe = regexp.MustCompile(`\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)`)
)

// TestQueryLabels: the dashboard's and the alerts' selectors match on
// labels their metrics carry, with values those labels take; a panel's
// legend and an alert's annotations name only labels its query returns
// (else the legend or summary is blank where the operator reads it).
func TestQueryLabels(t *testing.T) {
	known := exported(t)

	raw, err := os.ReadFile("grafana/delaybridge-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr         string `json:"expr"`
				LegendFormat string `json:"legendFormat"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatalf("dashboard JSON: %v", err)
	}
	queries := 0
	for _, p := range d.Panels {
		for _, tg := range p.Targets {
			queries++
			checkSelectors(t, "panel "+p.Title, tg.Expr, known)
			out := outputLabels(tg.Expr, known)
			for _, sm := range legendRe.FindAllStringSubmatch(tg.LegendFormat, -1) {
				if !out[sm[1]] {
					t.Errorf("panel %q: legend %q names %s, which %s does not return", p.Title, tg.LegendFormat, sm[1], tg.Expr)
				}
			}
		}
	}

	raw, err = os.ReadFile("prometheus/alerts.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var rg ruleGroups
	if err := strictDecode(raw, &rg); err != nil {
		t.Fatalf("prometheus/alerts.yaml: %v", err)
	}
	for _, g := range rg.Groups {
		for _, r := range g.Rules {
			queries++
			checkSelectors(t, "alert "+r.Alert, r.Expr, known)
			out := outputLabels(r.Expr, known)
			for _, a := range []string{r.Annotations["summary"], r.Annotations["description"]} {
				for _, sm := range labelsUsedRe.FindAllStringSubmatch(a, -1) {
					if !out[sm[1]] {
						t.Errorf("alert %s: an annotation names $labels.%s, which its expression does not return", r.Alert, sm[1])
					}
				}
			}
		}
	}
	if queries < 30 {
		t.Fatalf("%d queries read, want the dashboard's and the alerts'", queries)
	}
}

var docMetricRe = regexp.MustCompile(`\bdelaybridge_[a-z0-9_]*[a-z0-9](?:\{([a-z_,]+)\})?`)

// TestMetricsDocumented: the README names every metric the bridge exports,
// with its labels where it lists them (name{a,b}) exactly as exported, and
// the READMEs and docs name no metric the bridge does not export.
func TestMetricsDocumented(t *testing.T) {
	known := exported(t)
	named := map[string]bool{}
	for _, f := range []string{"../README.md", "README.md", "../docs/design.md", "../docs/benchmarks.md"} {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, sm := range docMetricRe.FindAllStringSubmatch(string(raw), -1) {
			name, _, _ := strings.Cut(sm[0], "{")
			ls, ok := known[name]
			if !ok {
				t.Errorf("%s names %s, which package metrics does not export", f, name)
				continue
			}
			if f != "../README.md" {
				continue
			}
			named[family(name, known)] = true
			if sm[1] == "" {
				continue
			}
			doc := strings.Split(sm[1], ",")
			slices.Sort(doc)
			want := slices.Clone(ls)
			slices.Sort(want)
			if !slices.Equal(doc, want) {
				t.Errorf("README: %s: labels %v, exported with %v", sm[0], doc, want)
			}
		}
	}
	for name := range known {
		if family(name, known) == name && !named[name] {
			t.Errorf("README does not name %s (exported by package metrics)", name)
		}
	}
	if len(named) < 30 {
		t.Fatalf("README names %d metrics", len(named))
	}
}
