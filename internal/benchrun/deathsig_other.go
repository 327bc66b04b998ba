//go:build !linux

package benchrun

import "os/exec"

// dieWithParent does nothing where there is no parent-death signal: a
// child outlives a bench process that is killed.
func dieWithParent(*exec.Cmd) {}
