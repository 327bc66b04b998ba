package main

import (
	"strconv"
	"strings"
	"testing"
	"testing/fstest"
)

func TestContainerMemoryLimit(t *testing.T) {
	file := func(s string) *fstest.MapFile { return &fstest.MapFile{Data: []byte(s)} }
	tests := []struct {
		name   string
		files  fstest.MapFS
		cgroup string
		want   int64
	}{
		{"v2, own cgroup", fstest.MapFS{"sys/fs/cgroup/kubepods/pod1/memory.max": file("1610612736\n")}, "0::/kubepods/pod1\n", 1610612736},
		{"v2, namespaced root", fstest.MapFS{"sys/fs/cgroup/memory.max": file("1073741824\n")}, "0::/\n", 1 << 30},
		{"v2, own path not mounted: the root's", fstest.MapFS{"sys/fs/cgroup/memory.max": file("1073741824\n")}, "0::/elsewhere\n", 1 << 30},
		{"v2, no limit", fstest.MapFS{"sys/fs/cgroup/memory.max": file("max\n")}, "0::/\n", 0},
		{"v1, own cgroup", fstest.MapFS{"sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": file("536870912\n")},
			"12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n", 512 << 20},
		{"v1, no limit", fstest.MapFS{"sys/fs/cgroup/memory/memory.limit_in_bytes": file("9223372036854771712\n")}, "4:memory:/\n", 0},
		{"v1 and an empty v2 line (hybrid)", fstest.MapFS{"sys/fs/cgroup/memory/memory.limit_in_bytes": file("2147483648\n")}, "4:memory:/\n0::/\n", 2 << 30},
		{"v2, a limited parent over an unlimited child", fstest.MapFS{
			"sys/fs/cgroup/kubepods/pod1/memory.max":      file("1610612736\n"),
			"sys/fs/cgroup/kubepods/pod1/ctr1/memory.max": file("max\n"),
		}, "0::/kubepods/pod1/ctr1\n", 1610612736},
		{"v2, the smallest on the path", fstest.MapFS{
			"sys/fs/cgroup/a/memory.max":     file("1073741824\n"),
			"sys/fs/cgroup/a/b/memory.max":   file("2147483648\n"),
			"sys/fs/cgroup/a/b/c/memory.max": file("max\n"),
		}, "0::/a/b/c\n", 1 << 30},
		{"v1, a limited parent only", fstest.MapFS{"sys/fs/cgroup/memory/kubepods/memory.limit_in_bytes": file("1073741824\n"),
			"sys/fs/cgroup/memory/kubepods/pod1/memory.limit_in_bytes": file("9223372036854771712\n")}, "4:memory:/kubepods/pod1\n", 1 << 30},
		{"a path out of the mount stays in it", fstest.MapFS{"sys/fs/cgroup/memory.max": file("1073741824\n")}, "0::/../../etc\n", 1 << 30},
		{"garbage", fstest.MapFS{"sys/fs/cgroup/memory.max": file("lots\n")}, "0::/\n", 0},
		{"v2 unlimited beside a v1 limit (hybrid): v2 holds", fstest.MapFS{
			"sys/fs/cgroup/memory.max":                   file("max\n"),
			"sys/fs/cgroup/memory/memory.limit_in_bytes": file("2147483648\n"),
		}, "4:memory:/\n0::/\n", 0},
		{"unreadable v2 level, v1 limit (hybrid)", fstest.MapFS{
			"sys/fs/cgroup/memory.max":                   file("lots\n"),
			"sys/fs/cgroup/memory/memory.limit_in_bytes": file("2147483648\n"),
		}, "4:memory:/\n0::/\n", 2 << 30},
		{"nothing to read", fstest.MapFS{}, "0::/\n", 0},
		{"no /proc/self/cgroup", fstest.MapFS{"sys/fs/cgroup/memory.max": file("1073741824\n")}, "", 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := containerMemoryLimit(tt.files, tt.cgroup); got != tt.want {
				t.Fatalf("containerMemoryLimit = %d, want %d", got, tt.want)
			}
		})
	}
}

// FuzzContainerMemoryLimit feeds arbitrary /proc/self/cgroup text and
// cgroup file contents to containerMemoryLimit. It never panics, and the
// limit it finds is 0 or the value of one of the files, below v1's "no
// limit"; with only v2 files, a v2 line naming /a and two readable
// limits on that path, it is the smaller.
func FuzzContainerMemoryLimit(f *testing.F) {
	f.Add("0::/a\n", "1073741824\n", "2147483648\n", "536870912\n")
	f.Add("4:memory:/a\n0::/\n", "max\n", "lots", "2147483648\n")
	f.Add("0::/../../a\n", "max", "9223372036854771712", "-1")
	f.Add("1:cpu,memory:/a/b\n", "", " 42 ", "1152921504606846976")
	f.Fuzz(func(t *testing.T, cgroup, root, child, v1 string) {
		files := fstest.MapFS{
			"sys/fs/cgroup/memory.max":                   &fstest.MapFile{Data: []byte(root)},
			"sys/fs/cgroup/a/memory.max":                 &fstest.MapFile{Data: []byte(child)},
			"sys/fs/cgroup/memory/memory.limit_in_bytes": &fstest.MapFile{Data: []byte(v1)},
		}
		got := containerMemoryLimit(files, cgroup)
		if got == 0 {
			return
		}
		if got < 0 || got >= 1<<60 {
			t.Fatalf("limit %d", got)
		}
		read := func(s string) int64 {
			n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
			if err != nil {
				return -1
			}
			return n
		}
		if got != read(root) && got != read(child) && got != read(v1) {
			t.Fatalf("limit %d is none of the files' (%q, %q, %q)", got, root, child, v1)
		}
		if cgroup == "0::/a" || cgroup == "0::/a\n" {
			if r, c := read(root), read(child); r > 0 && c > 0 && r < 1<<60 && c < 1<<60 && got != min(r, c) {
				t.Fatalf("limit %d, want the smaller of %d and %d", got, r, c)
			}
		}
	})
}
