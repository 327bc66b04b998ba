package benchrun

import (
	"os/exec"
	"syscall"
)

// dieWithParent asks the kernel to SIGKILL cmd's process when the bench
// process dies, a SIGKILL or an OOM kill of bench included, which no
// cleanup of its own can handle: a child bridge would otherwise keep
// running, its store in a scratch directory nobody removes. Pdeathsig is
// tied to the thread that started the child; the Go runtime only ends a
// thread whose goroutine exits while locked to it, which benchrun never
// does.
func dieWithParent(cmd *exec.Cmd) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
}
