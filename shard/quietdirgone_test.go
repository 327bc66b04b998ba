package shard

import (
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

const quietDirGoneChild = "DELAYBRIDGE_QUIET_DIR_GONE_CHILD"

// TestQuietFlushWithStoreDirGone: the quiet flush (quietFlushLoop) of an
// engine whose store directory was removed from under it rotated the WAL
// in the missing directory, which Pebble does not survive (see
// TestCloseWithStoreDirGone): a minute after its last write an idle
// engine ended the process, where Close skips its flush for that reason.
// The flush is skipped too. Run in a child process, since the crash
// cannot be recovered.
func TestQuietFlushWithStoreDirGone(t *testing.T) {
	if os.Getenv(quietDirGoneChild) == "" {
		cmd := exec.Command(os.Args[0], "-test.run=^TestQuietFlushWithStoreDirGone$", "-test.count=1")
		cmd.Env = append(os.Environ(), quietDirGoneChild+"=1")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("the engine's process with its store directory gone: %v\n%s", err, out)
		}
		return
	}
	h := newHarness(t, nil)
	h.run()
	h.ingest([]codec.Task{sched("a", t0.Add(time.Hour), 1)}) // a write: the memtable takes it
	if err := os.RemoveAll(h.opts.Dir); err != nil {
		t.Fatal(err)
	}
	for range 8 { // two minutes, a check at a time
		h.advance(quietFlushAfter / 4)
		time.Sleep(5 * time.Millisecond) // the loop's check, in real time
	}
	h.stop()
	h.e.Close() // its flush skipped (TestCloseWithStoreDirGone)
	h.e = nil
}
