package main

import (
	"io/fs"
	"path"
	"strconv"
	"strings"
)

// containerMemoryLimit is the memory limit of the cgroup this process
// runs in, in bytes, or 0 when there is none or it cannot be read. root
// is the file system root ("/" in production); procCgroup is the text of
// /proc/self/cgroup. cgroup v2 ("0::PATH", file memory.max, "max" when
// unlimited) is tried first, then v1 (the "memory" controller, file
// memory.limit_in_bytes, a huge number when unlimited); in each, the
// process's own cgroup directory, then the mount's root (what a container
// with its own cgroup namespace sees as its cgroup).
func containerMemoryLimit(root fs.FS, procCgroup string) int64 {
	var v2, v1 string
	for _, line := range strings.Split(procCgroup, "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		switch {
		case parts[0] == "0" && parts[1] == "":
			v2 = parts[2]
		case hasController(parts[1], "memory"):
			v1 = parts[2]
		}
	}
	try := func(dir, own, file string) (int64, bool) {
		for _, d := range []string{path.Join(dir, own), dir} {
			b, err := fs.ReadFile(root, strings.TrimPrefix(path.Join(d, file), "/"))
			if err != nil {
				continue
			}
			s := strings.TrimSpace(string(b))
			if s == "max" {
				return 0, true
			}
			n, err := strconv.ParseInt(s, 10, 64)
			if err != nil || n <= 0 {
				continue
			}
			if n >= 1<<60 { // v1's "no limit" (page-rounded MaxInt64)
				return 0, true
			}
			return n, true
		}
		return 0, false
	}
	if v2 != "" {
		if n, ok := try("/sys/fs/cgroup", v2, "memory.max"); ok {
			return n
		}
	}
	if v1 != "" {
		if n, ok := try("/sys/fs/cgroup/memory", v1, "memory.limit_in_bytes"); ok {
			return n
		}
	}
	return 0
}

func hasController(list, name string) bool {
	for _, c := range strings.Split(list, ",") {
		if c == name {
			return true
		}
	}
	return false
}
