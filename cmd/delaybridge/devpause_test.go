package main

import (
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/delaybridge/delaybridge/admin"
	"github.com/delaybridge/delaybridge/shard"
)

// TestDevBannerPauseExamples: the banner's curl examples pause and resume
// firing when sent, as curl would, to the admin API of a real engine.
func TestDevBannerPauseExamples(t *testing.T) {
	e, err := shard.Open(shard.Options{Dir: t.TempDir(), Shards: 2, Logger: zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel))})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	srv := httptest.NewServer(admin.NewHandler(admin.Options{Engine: e}))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	banner := devBanner("127.0.0.1:9092", "nats://127.0.0.1:4222", host, time.Now(), "")
	curlRe := regexp.MustCompile(`^curl -X POST(?: -d '([^']*)')? (http://\S+)$`)
	var paused []bool
	for _, line := range strings.Split(banner, "\n") {
		line = strings.TrimSpace(line)
		if !strings.HasPrefix(line, "curl ") {
			continue
		}
		m := curlRe.FindStringSubmatch(line)
		if m == nil {
			t.Fatalf("banner line %q is not a curl POST this test can send", line)
		}
		// curl -d sends application/x-www-form-urlencoded.
		r, err := http.Post(m[2], "application/x-www-form-urlencoded", strings.NewReader(m[1]))
		if err != nil {
			t.Fatal(err)
		}
		r.Body.Close()
		if r.StatusCode != http.StatusOK {
			t.Fatalf("%q: %d", line, r.StatusCode)
		}
		paused = append(paused, e.FiringPaused())
	}
	if len(paused) != 2 || !paused[0] || paused[1] {
		t.Fatalf("after each curl example firing paused = %v, want [true false]", paused)
	}
}
