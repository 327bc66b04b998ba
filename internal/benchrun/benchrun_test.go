package benchrun

import (
	"bytes"
	"context"
	"encoding/json"
	"image/png"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

func TestSummarize(t *testing.T) {
	xs := make([]float64, 1000)
	for i := range xs {
		xs[i] = float64(i + 1) // 1..1000
	}
	s := summarize(xs)
	if s.P50 != 500 || s.P99 != 990 || s.P999 != 999 || s.Max != 1000 || s.Mean != 500.5 {
		t.Fatalf("summarize = %+v", s)
	}
	if summarize(nil) != nil {
		t.Fatal("summary of nothing")
	}
}

func TestChartIsPNG(t *testing.T) {
	b, err := latencyCDF([]series{{name: "kafka paced 5000/s", xs: []float64{-0.2, 0.5, 3, 40, 900}, col: palette[0]}})
	if err != nil {
		t.Fatal(err)
	}
	img, err := png.Decode(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	if r := img.Bounds(); r.Dx() < 100 || r.Dy() < 100 {
		t.Fatalf("chart is %v", r)
	}
}

// TestSmallReport runs the engine-level recovery child in process (the
// parts that need the binary are exercised by `delaybridge bench`) and the
// throughput runs on tiny sizes, and checks the report renders.
func TestSmallReport(t *testing.T) {
	if testing.Short() {
		t.Skip("starts brokers")
	}
	out := t.TempDir()
	o := Defaults(true)
	o.N, o.PacedN, o.Rate, o.Out, o.WorkDir = 500, 500, 2000, out, t.TempDir()
	o.Parts = []string{"throughput", "lateness"}
	r, err := Run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Errors) > 0 {
		t.Fatalf("errors: %v", r.Errors)
	}
	if len(r.Runs) != 10 {
		t.Fatalf("%d runs, want 10", len(r.Runs))
	}
	for _, run := range r.Runs {
		if run.Rate <= 0 || run.BenchCPUUs <= 0 {
			t.Errorf("%s %s: rate %v, bench CPU %v µs/msg", run.Transport, run.Mode, run.Rate, run.BenchCPUUs)
		}
	}
	if runtime.GOOS == "linux" && r.Machine.FreshPageUs <= 0 {
		t.Errorf("fresh page cost %v µs, want it measured", r.Machine.FreshPageUs)
	}
	md := r.Markdown()
	for _, want := range []string{"bridge page faults /msg", "| kafka | bridge, delay 1000 ms, unpaced, after 500 through the same process |",
		"bridge after 500 through the same process / raw pipe, both read at a target consumer | nats", "bridge / raw pipe throughput", "both read at a target consumer", "| nats | raw pipe, rate at a consumer", "p99 lateness at 2000 msg/s", "| kafka | raw pipe"} {
		if !strings.Contains(md, want) {
			t.Errorf("report lacks %q:\n%s", want, md)
		}
	}
	for _, f := range []string{"report.json", "report.md", "lateness.png"} {
		if _, err := os.Stat(filepath.Join(out, f)); err != nil {
			t.Error(err)
		}
	}
}

func TestCapacityChild(t *testing.T) {
	var out bytes.Buffer
	if err := Child(context.Background(), "capacity", t.TempDir(), 3000, 100, &out); err != nil {
		t.Fatal(err)
	}
	line, ok := strings.CutPrefix(strings.TrimSpace(out.String()), "RESULT ")
	if !ok {
		t.Fatalf("child output %q", out.String())
	}
	var c Capacity
	if err := json.Unmarshal([]byte(line), &c); err != nil {
		t.Fatal(err)
	}
	if c.Tasks != 3000 || c.Pending != 3000 || c.PeakRSSMB <= 0 || c.DiskGB <= 0 {
		t.Fatalf("capacity result %+v", c)
	}
}

func TestStatMinorFaults(t *testing.T) {
	tests := []struct {
		name, stat string
		want       float64
	}{
		{"plain", "4242 (delaybridge) S 1 4242 4242 0 -1 4194560 180321 0 0 0 700 80 0 0 20 0 9 0", 180321},
		{"command with spaces and parentheses", "77 (a (b) c) R 1 77 77 0 -1 0 12 5 0 0", 12},
		{"too few fields", "77 (x) R 1 77", 0},
		{"no command", "77 x R 1 77 77 0 -1 0 12", 0},
		{"not a number", "77 (x) R 1 77 77 0 -1 0 many 0", 0},
		{"empty", "", 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := statMinorFaults(tt.stat); got != tt.want {
				t.Fatalf("statMinorFaults(%q) = %v, want %v", tt.stat, got, tt.want)
			}
		})
	}
	if runtime.GOOS != "linux" {
		return
	}
	before := selfMinorFaults()
	b, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		t.Fatal(err)
	}
	after := selfMinorFaults()
	if got := statMinorFaults(string(b)); got <= 0 || got < before || got > after {
		t.Fatalf("this process: %v minor faults from /proc/self/stat, getrusage %v before and %v after", got, before, after)
	}
}

// The goals table holds a row per goal of the parts that ran, and is
// there whichever parts ran (with -only capacity,recovery it was left out
// with the throughput tables).
func TestGoalRows(t *testing.T) {
	tests := []struct {
		name string
		r    Report
		want []string // rows, in order
	}{
		{"nothing ran", Report{}, nil},
		{"capacity and recovery", Report{
			Capacity: &Capacity{Tasks: 10_000_000, PeakRSSMB: 1157},
			Recovery: &Recovery{Pending: 1_000_000, ReadySecs: 1.16},
		}, []string{
			"| peak RSS with 10000000 pending | engine | 1157 MB | < 1024 MB (store cache + 256) | **missed** |",
			"| ready after kill -9 with 1000000 pending (process start to open) | engine | 1.16 s | <= 3 s | met |",
			"| acknowledged tasks lost at the kill -9 | engine | 0 | 0 | met |",
		}},
		{"a slow recovery that lost tasks", Report{Recovery: &Recovery{Pending: 1_000_000, ReadySecs: 3.5, Lost: 2}}, []string{
			"| ready after kill -9 with 1000000 pending (process start to open) | engine | 3.50 s | <= 3 s | **missed** |",
			"| acknowledged tasks lost at the kill -9 | engine | 2 | 0 | **missed** |",
		}},
		{"a small recovery run: its time is for information", Report{Recovery: &Recovery{Pending: 100_000, ReadySecs: 0.5}}, []string{
			"| ready after kill -9 with 100000 pending (process start to open) | engine | 0.50 s | (<= 3 s at 1 M) | for information |",
			"| acknowledged tasks lost at the kill -9 | engine | 0 | 0 | met |",
		}},
		{"throughput and lateness", Report{Runs: []*Measurement{
			{Transport: Kafka, Mode: "raw", Rate: 1000},
			{Transport: Kafka, Mode: "raw-read", Rate: 800},
			{Transport: Kafka, Mode: "bridge", Rate: 450},
			{Transport: Kafka, Mode: "paced", PublishRate: 5000, Lateness: &Summary{P99: 51}},
		}}, []string{
			"| bridge / raw pipe throughput | kafka | 0.45 | >= 0.5 | **missed** |",
			"| bridge / raw pipe throughput, both read at a target consumer | kafka | 0.56 | >= 0.5 | met |",
			"| p99 lateness at 5000 msg/s | kafka | 51.0 ms | <= 50 ms | **missed** |",
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := tt.r.goalRows()
			if len(tt.want) == 0 {
				if got != "" {
					t.Fatalf("goal rows %q, want none", got)
				}
				if strings.Contains(tt.r.Markdown(), "| goal |") {
					t.Fatal("a goals table without rows")
				}
				return
			}
			if want := strings.Join(tt.want, "\n") + "\n"; got != want {
				t.Fatalf("goal rows:\n%s\nwant:\n%s", got, want)
			}
			md := tt.r.Markdown()
			if !strings.Contains(md, "### Goals\n\n| goal | transport | value | goal | verdict |\n|---|---|---:|---:|---|\n"+strings.Join(tt.want, "\n")+"\n") {
				t.Fatalf("the report lacks the goals table:\n%s", md)
			}
		})
	}
}

func TestCrossing(t *testing.T) {
	t0 := time.Unix(100, 0)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	for _, tc := range []struct {
		name              string
		prev2, prev, last poll
		want              float64
		wantAt            time.Time
	}{
		// 500/s before: the last 50 took 100 ms after prev.
		{"carried on at the rate before", poll{at(0), 0}, poll{at(200), 100}, poll{at(400), 150}, 150, at(300)},
		{"the estimate past the last poll: the last poll", poll{at(0), 0}, poll{at(200), 10}, poll{at(400), 150}, 150, at(400)},
		{"first poll already at want", poll{at(0), 0}, poll{at(0), 0}, poll{at(200), 150}, 150, at(200)},
		{"stalled before", poll{at(0), 100}, poll{at(200), 100}, poll{at(400), 150}, 150, at(400)},
		{"went back (a restarted bridge)", poll{at(0), 120}, poll{at(200), 100}, poll{at(400), 150}, 150, at(400)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := crossing(tc.prev2, tc.prev, tc.last, tc.want); !got.Equal(tc.wantAt) {
				t.Fatalf("crossing = %v after t0, want %v", got.Sub(t0), tc.wantAt.Sub(t0))
			}
		})
	}
}

// TestChildScrapeFiltered: the benchmark's polling of a child bridge asks
// for the one family it reads, uncompressed, so it costs the measured
// bridge no encoding or gzip of the rest.
func TestChildScrapeFiltered(t *testing.T) {
	reg := prometheus.NewRegistry()
	ing := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "delaybridge_ingested_total"}, []string{"source"})
	other := prometheus.NewCounter(prometheus.CounterOpts{Name: "delaybridge_ingested_total_other"})
	reg.MustRegister(ing, other)
	ing.WithLabelValues("a").Add(3)
	ing.WithLabelValues("b").Add(4)
	other.Add(100)
	var queries, encodings []string
	var mu sync.Mutex
	h := promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		queries = append(queries, r.URL.RawQuery)
		encodings = append(encodings, r.Header.Get("Accept-Encoding"))
		mu.Unlock()
		h.ServeHTTP(w, r)
	}))
	defer srv.Close()
	cb := &childBridge{admin: strings.TrimPrefix(srv.URL, "http://")}
	if got := cb.counter("delaybridge_ingested_total"); got != 7 {
		t.Fatalf("counter = %v, want 7", got)
	}
	if got := cb.metrics("delaybridge_ingested_total"); len(got) != 2 {
		t.Fatalf("filtered scrape returned %d series, want the 2 of the family: %v", len(got), got)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(queries) != 2 || queries[0] != "name%5B%5D=delaybridge_ingested_total" || encodings[0] != "" {
		t.Fatalf("scrapes: queries %q, Accept-Encoding %q", queries, encodings)
	}
}
