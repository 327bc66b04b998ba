package main

import (
	"math"
	"strings"
	"testing"
)

func TestMemoryWarning(t *testing.T) {
	const cache = 768
	const pod = 1536 << 20
	tests := []struct {
		name      string
		inGoHeap  bool
		limit     int64
		container int64
		want      string // a substring of the warning; "" for none
	}{
		{"cgo build, no limit", false, math.MaxInt64, 0, ""},
		{"cgo build, no limit in a container", false, math.MaxInt64, pod, ""},
		{"cgo build, small limit", false, 100 << 20, 0, ""},
		{"cgo build, limit and cache fit the container", false, (pod - cache<<20) * 9 / 10, pod, ""},
		{"cgo build, limit and cache over the container", false, pod * 9 / 10, pod, "exceed the container's memory limit"},
		{"no cgo, no limit", true, math.MaxInt64, 0, "GOMEMLIMIT is not set"},
		{"no cgo, the chart's 90% of 1536Mi", true, pod * 9 / 10, pod, ""},
		{"no cgo, the old chart's 90% of the limit less the cache", true, (pod - cache<<20) * 9 / 10, pod, "less than 128 MiB beside the store's cache"},
		{"no cgo, exactly cache + 128 MiB", true, (cache + 128) << 20, 0, ""},
		{"no cgo, one byte under", true, (cache+128)<<20 - 1, 0, "less than 128 MiB"},
		{"no cgo, over the container", true, pod + 1, pod, "not below the container's memory limit"},
		{"no cgo, at the container's limit", true, pod, pod, "not below the container's memory limit"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := memoryWarning(tt.inGoHeap, tt.limit, cache, tt.container)
			if tt.want == "" && got != "" || tt.want != "" && !strings.Contains(got, tt.want) {
				t.Fatalf("memoryWarning = %q, want %q", got, tt.want)
			}
		})
	}
}
