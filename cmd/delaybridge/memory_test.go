package main

import (
	"math"
	"strings"
	"testing"
)

func TestMemoryWarning(t *testing.T) {
	const cache = 768
	tests := []struct {
		name     string
		inGoHeap bool
		limit    int64
		want     string // a substring of the warning; "" for none
	}{
		{"cgo build, no limit", false, math.MaxInt64, ""},
		{"cgo build, small limit", false, 100 << 20, ""},
		{"no cgo, no limit", true, math.MaxInt64, "GOMEMLIMIT is not set"},
		{"no cgo, the chart's 90% of 1536Mi", true, 1536 << 20 * 9 / 10, ""},
		{"no cgo, the old chart's 90% of the limit less the cache", true, (1536 - 768) << 20 * 9 / 10, "less than 128 MiB beside the store's cache"},
		{"no cgo, exactly cache + 128 MiB", true, (cache + 128) << 20, ""},
		{"no cgo, one byte under", true, (cache+128)<<20 - 1, "less than 128 MiB"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := memoryWarning(tt.inGoHeap, tt.limit, cache)
			if tt.want == "" && got != "" || tt.want != "" && !strings.Contains(got, tt.want) {
				t.Fatalf("memoryWarning = %q, want %q", got, tt.want)
			}
		})
	}
}
