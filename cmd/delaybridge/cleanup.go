package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"time"
)

// exitCleanupTimeout bounds the cleanup of a forced exit: a second signal
// means whoever sent it will not wait, so what is not done by then is left
// behind.
const exitCleanupTimeout = 3 * time.Second

// exitCleanups is what the forced exit (a second signal, see
// shutdownOnSignal) still does before exiting, since it skips every defer:
// remove what a command created for itself alone, such as dev's temporary
// directory and bench's work directory, and stop bench's child processes.
// A command that registers nothing (run, whose data dir must outlive it)
// exits exactly as without it.
//
// The zero value is ready to use; a nil *exitCleanups registers nothing and
// runs nothing.
type exitCleanups struct {
	timeout time.Duration // 0: exitCleanupTimeout

	mu      sync.Mutex
	exiting bool // run has started: nothing more is registered
	next    int
	hooks   map[int]exitHook
}

type exitHook struct {
	what string // names what is left behind if the hook does not finish
	fn   func(context.Context) error
}

// add registers fn (described by what) for the forced exit; remove
// unregisters it. It fails once the forced exit has started. On a nil c it
// registers nothing.
func (c *exitCleanups) add(what string, fn func(context.Context) error) (remove func(), err error) {
	if c == nil {
		return func() {}, nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.addLocked(what, fn)
}

func (c *exitCleanups) addLocked(what string, fn func(context.Context) error) (remove func(), err error) {
	if c.exiting {
		return nil, errors.New("exiting")
	}
	if c.hooks == nil {
		c.hooks = map[int]exitHook{}
	}
	id := c.next
	c.next++
	c.hooks[id] = exitHook{what, fn}
	return func() {
		c.mu.Lock()
		delete(c.hooks, id)
		c.mu.Unlock()
	}, nil
}

// tempDir creates a new directory as os.MkdirTemp("", pattern) does and
// returns it with remove, which deletes it (and its contents) and
// unregisters it; until then a forced exit deletes it. Creating and
// registering happen under one lock, so a forced exit either sees the
// directory or finds it never made. Only this directory is ever removed:
// neither the other entries of the temp dir (another sandbox's, say) nor
// anything outside it.
func (c *exitCleanups) tempDir(pattern string) (dir string, remove func() error, err error) {
	return c.tempDirIn("", pattern)
}

// tempDirIn is tempDir with the new directory made in parent, as
// os.MkdirTemp(parent, pattern) does ("" is the system temp dir): bench's
// -work. parent itself and its other entries are never removed.
func (c *exitCleanups) tempDirIn(parent, pattern string) (dir string, remove func() error, err error) {
	if c == nil {
		dir, err := os.MkdirTemp(parent, pattern)
		if err != nil {
			return "", nil, err
		}
		return dir, func() error { return os.RemoveAll(dir) }, nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.exiting {
		return "", nil, errors.New("exiting")
	}
	dir, err = os.MkdirTemp(parent, pattern)
	if err != nil {
		return "", nil, err
	}
	unregister, err := c.addLocked(dir, func(ctx context.Context) error { return removeAllRetry(ctx, dir) })
	if err != nil { // not reached: exiting was checked under the same lock
		_ = os.RemoveAll(dir)
		return "", nil, err
	}
	return dir, func() error {
		err := os.RemoveAll(dir)
		unregister()
		return err
	}, nil
}

// removeAllRetry removes dir, retrying while ctx lasts: on a forced exit the
// command is still running and may create a file in it between os.RemoveAll
// emptying it and removing it, or make it again (a JetStream server
// creating a stream's directory with MkdirAll just after the removal), so
// dir must also stay gone for a moment.
func removeAllRetry(ctx context.Context, dir string) error {
	for {
		err := os.RemoveAll(dir)
		if err == nil {
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(20 * time.Millisecond):
			}
			if _, serr := os.Lstat(dir); errors.Is(serr, os.ErrNotExist) {
				return nil
			}
			continue // made again: remove it again
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// started reports whether the forced exit has begun (run was called). A
// command's error after that is most likely the cleanup's doing (its
// directory removed under it): the forced exit owns the exit, its line
// and its code.
func (c *exitCleanups) started() bool {
	if c == nil {
		return false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.exiting
}

// run runs every registered hook, all at once, and returns when they have
// finished or the timeout has passed, whichever is first; it writes one
// line to stderr per hook that failed or did not finish. After it has
// started nothing more is registered. Without hooks it returns at once.
func (c *exitCleanups) run(stderr io.Writer) {
	if c == nil {
		return
	}
	c.mu.Lock()
	c.exiting = true
	hooks := make([]exitHook, 0, len(c.hooks))
	for _, h := range c.hooks {
		hooks = append(hooks, h)
	}
	c.mu.Unlock()
	if len(hooks) == 0 {
		return
	}
	timeout := c.timeout
	if timeout <= 0 {
		timeout = exitCleanupTimeout
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	type result struct {
		i   int
		err error
	}
	results := make(chan result, len(hooks)) // buffered: a hook that outlives run does not block
	for i, h := range hooks {
		go func() { results <- result{i, h.fn(ctx)} }()
	}
	pending := make([]bool, len(hooks))
	for i := range pending {
		pending[i] = true
	}
	for range hooks {
		select {
		case r := <-results:
			pending[r.i] = false
			if r.err != nil {
				fmt.Fprintf(stderr, "delaybridge: cleanup of %s: %v\n", hooks[r.i].what, r.err)
			}
		case <-ctx.Done():
			for i, p := range pending {
				if p {
					fmt.Fprintf(stderr, "delaybridge: cleanup of %s did not finish within %s: left behind\n", hooks[i].what, timeout)
				}
			}
			return
		}
	}
}
