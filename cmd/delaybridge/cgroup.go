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
// /proc/self/cgroup. The limit that holds is the smallest on the path from
// the process's cgroup up to the root (a pod's limit may sit above the
// container's own cgroup); a level without a limit, or whose file is not
// there (a cgroup namespace shows its own cgroup as the mount's root),
// does not count. cgroup v2 ("0::PATH", file memory.max, "max" when
// unlimited) is read first, then v1 (the "memory" controller, file
// memory.limit_in_bytes, a huge number when unlimited).
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
	// smallest reads file in mount/own and each directory above it, up to
	// mount itself; found says some level had the file.
	smallest := func(mount, own, file string) (limit int64, found bool) {
		for d := path.Join("/", own); ; d = path.Dir(d) {
			b, err := fs.ReadFile(root, strings.TrimPrefix(path.Join(mount, d, file), "/"))
			if err == nil {
				s := strings.TrimSpace(string(b))
				n, err := strconv.ParseInt(s, 10, 64)
				// Only a readable level counts as found: an unparsable
				// file does not stop the fall back to cgroup v1.
				found = found || s == "max" || err == nil
				if err == nil && n > 0 && n < 1<<60 { // 1<<60 and up: v1's "no limit"
					if limit == 0 || n < limit {
						limit = n
					}
				}
			}
			if d == "/" {
				return limit, found
			}
		}
	}
	if v2 != "" {
		if n, ok := smallest("/sys/fs/cgroup", v2, "memory.max"); ok {
			return n
		}
	}
	if v1 != "" {
		if n, ok := smallest("/sys/fs/cgroup/memory", v1, "memory.limit_in_bytes"); ok {
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
