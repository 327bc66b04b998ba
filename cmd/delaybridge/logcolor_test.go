package main

import (
	"bytes"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestConsoleLogColour: `log.format: console` (and `dev`) coloured the
// level with escape codes whatever the output: a pipe, a file, a
// container's log got "\x1b[33mWARN\x1b[0m". Colour is for a terminal
// only, and never with NO_COLOR set.
func TestConsoleLogColour(t *testing.T) {
	file, err := os.Create(filepath.Join(t.TempDir(), "dev.log"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { file.Close() })
	var buf bytes.Buffer
	for _, tc := range []struct {
		name string
		w    io.Writer
		read func() string
	}{
		{"buffer (a pipe)", &buf, buf.String},
		{"file", file, func() string {
			b, err := os.ReadFile(file.Name())
			if err != nil {
				t.Fatal(err)
			}
			return string(b)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			log, err := newLogger("info", "console", tc.w)
			if err != nil {
				t.Fatal(err)
			}
			log.Warn("target refused a publish")
			_ = log.Sync()
			out := tc.read()
			if !strings.Contains(out, "WARN") || strings.Contains(out, "\x1b[") {
				t.Fatalf("console line %q, want the level WARN without escape codes", out)
			}
		})
	}

	// A character device (as a terminal is) gets colour, unless NO_COLOR.
	dev, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	if err != nil {
		t.Skipf("no %s: %v", os.DevNull, err)
	}
	t.Cleanup(func() { dev.Close() })
	for _, tc := range []struct {
		noColor string
		want    bool
	}{{"", true}, {"1", false}} {
		t.Setenv("NO_COLOR", tc.noColor)
		if got := colorTerminal(dev); got != tc.want {
			t.Errorf("colorTerminal(%s) with NO_COLOR=%q = %v, want %v", os.DevNull, tc.noColor, got, tc.want)
		}
	}
	if colorTerminal(&buf) || colorTerminal(file) {
		t.Errorf("colorTerminal of a buffer or a file = true")
	}
}
