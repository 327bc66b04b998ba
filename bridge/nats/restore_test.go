package nats

import (
	"fmt"
	"net"
	"os"
	"slices"
	"testing"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"
)

// TestSourceStreamRestoredFromBackup: the delay stream is restored from a
// backup taken when it held 3 messages (here a copy of the server's store
// made while it was down; `nats stream restore` and a cluster's stream
// assignment keep the creation time the same way), after the bridge had
// handled 6. The creation time, and so the checkpoint key, is unchanged,
// but messages published after the restore get sequences 4-6 again: they
// must be handed over, as a new incarnation, not acked as held under the
// old floor. Found while the source runs (the consumer's sequences go
// back) and at a start after the restore.
func TestSourceStreamRestoredFromBackup(t *testing.T) {
	for _, atStart := range []bool{false, true} {
		t.Run(fmt.Sprintf("atStart=%v", atStart), func(t *testing.T) {
			opts := jsOptions(t)
			s := startServer(t, opts)
			port := s.Addr().(*net.TCPAddr).Port
			cfg := testConfig(t, serverURL(s))
			cfg.Create = true
			nc := connect(t, cfg)
			js := newJS(t, nc)
			rec := newRecorder()
			start := func() func() error {
				src, err := NewSource(nc, cfg)
				if err != nil {
					t.Fatal(err)
				}
				return runSource(t, src, rec)
			}
			restart := func(store string) {
				s.Shutdown()
				s.WaitForShutdown()
				o := opts.Clone()
				o.Port, o.StoreDir = port, store
				s = startServer(t, o)
			}
			stop := start()
			for i := range 3 {
				publishRetry(t, js, "delay.a", fmt.Sprint("a", i))
			}
			eventually(t, "3 handled", func() bool { return len(rec.seqs()) == 3 })
			backup := copyStore(t, &s, opts, restart)
			for i := range 3 {
				publishRetry(t, js, "delay.a", fmt.Sprint("b", i))
			}
			eventually(t, "6 handled", func() bool { return len(rec.seqs()) == 6 })
			if atStart {
				if err := stop(); err != nil {
					t.Fatal(err)
				}
			}
			restart(backup) // the disaster: the backup comes back
			if atStart {
				start()
			} else {
				// The source sees the consumer's sequences go back at the
				// first delivery after the restore.
				publishRetry(t, js, "delay.a", "c0")
			}
			// Found before the stream grows past the old floor again.
			eventually(t, "the floor back at the backup's last sequence", func() bool {
				rec.mu.Lock()
				defer rec.mu.Unlock()
				for k, v := range rec.cps {
					if k == src0Key(t, js) {
						return v == 3
					}
				}
				return false
			})
			for i := range 3 {
				if i > 0 || atStart {
					publishRetry(t, js, "delay.a", fmt.Sprint("c", i)) // sequences 4-6 again
				}
			}
			eventually(t, "the messages published after the restore", func() bool { return len(rec.seqs()) == 9 })
			rec.mu.Lock()
			var got []string
			var incs []uint32
			for _, it := range rec.items[6:] {
				got = append(got, string(it.Msg.Value))
				incs = append(incs, it.Msg.Incarnation)
			}
			before := rec.items[5].Msg.Incarnation
			rec.mu.Unlock()
			if !slices.Equal(got, []string{"c0", "c1", "c2"}) {
				t.Fatalf("handed over after the restore: %q, want [c0 c1 c2]", got)
			}
			for _, inc := range incs {
				if inc != before+1 {
					t.Fatalf("incarnations after the restore %v, before %d: want the next one", incs, before)
				}
			}
		})
	}
}

// src0Key is the floor's checkpoint key of the DELAY stream as it is now.
func src0Key(t *testing.T, js jetstream.JetStream) string {
	t.Helper()
	st, err := js.Stream(ctxT(t), "DELAY")
	if err != nil {
		t.Fatal(err)
	}
	return CheckpointKey("DELAY", st.CachedInfo().Created.UnixNano(), []string{"delay.>"})
}

// copyStore takes a copy of the server's store with the server down, then
// brings it back on its own store; it returns the copy.
func copyStore(t *testing.T, s **server.Server, opts *server.Options, restart func(string)) string {
	t.Helper()
	(*s).Shutdown()
	(*s).WaitForShutdown()
	backup := t.TempDir()
	if err := os.CopyFS(backup, os.DirFS(opts.StoreDir)); err != nil {
		t.Fatalf("copy the store: %v", err)
	}
	restart(opts.StoreDir)
	return backup
}
