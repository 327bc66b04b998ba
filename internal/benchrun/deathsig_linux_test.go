package benchrun

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestDieWithParent kills (SIGKILL) a process that started a child with
// dieWithParent, as the kernel or an operator kills a bench run, and
// checks that the child goes too: no cleanup of the dead parent runs.
func TestDieWithParent(t *testing.T) {
	switch os.Getenv("BENCHRUN_DEATHSIG_ROLE") {
	case "child":
		select {} // until killed
	case "parent":
		cmd := exec.Command(os.Args[0], "-test.run=^TestDieWithParent$")
		cmd.Env = append(os.Environ(), "BENCHRUN_DEATHSIG_ROLE=child")
		dieWithParent(cmd)
		if err := cmd.Start(); err != nil {
			fmt.Println("ERR", err)
			os.Exit(1)
		}
		fmt.Println("CHILD", cmd.Process.Pid)
		select {} // until killed
	}

	parent := exec.Command(os.Args[0], "-test.run=^TestDieWithParent$")
	parent.Env = append(os.Environ(), "BENCHRUN_DEATHSIG_ROLE=parent")
	out, err := parent.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := parent.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = parent.Process.Kill(); _ = parent.Wait() }()
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatalf("parent said nothing: %v", err)
	}
	pidText, ok := strings.CutPrefix(strings.TrimSpace(line), "CHILD ")
	if !ok {
		t.Fatalf("parent: %q", line)
	}
	pid, err := strconv.Atoi(pidText)
	if err != nil {
		t.Fatal(err)
	}
	if !alive(pid) {
		t.Fatalf("child %d not running before the parent's kill", pid)
	}
	defer func() { _ = syscall.Kill(pid, syscall.SIGKILL) }()
	if err := parent.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = parent.Wait()
	// The signal is delivered when the parent's thread exits; the child
	// then needs to be scheduled to die. Poll, not a fixed sleep.
	deadline := time.Now().Add(30 * time.Second)
	for alive(pid) {
		if time.Now().After(deadline) {
			t.Fatalf("child %d still running 30 s after its parent was killed", pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// alive reports whether pid is a process that has not exited: a zombie
// (exited, not yet reaped by whoever inherited it) counts as gone.
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// pid (comm) state ...: the state follows the last ')'.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 || i+2 >= len(s) {
		return false
	}
	st := s[i+2]
	return st != 'Z' && st != 'X'
}
