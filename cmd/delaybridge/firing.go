package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/delaybridge/delaybridge/config"
)

// firingUsage is the usage of `delaybridge firing`.
const firingUsage = `usage: delaybridge firing status|pause|resume [--config FILE | --admin URL] [flags]

Asks a running bridge's admin API whether firing is paused, pauses it (kept
in its store across restarts until resumed) or resumes it, and prints the
answer (JSON) on stdout. --config reads admin.listen and the admin token from
the bridge's config (with its DELAYBRIDGE_* environment), so in a pod:
  kubectl exec POD -- /delaybridge firing pause --config /etc/delaybridge/config.yaml --reason "..."
A listen address on every interface (":8080", "0.0.0.0:8080", "[::]:8080")
is reached on the loopback. README: "Pausing deliveries".

flags:
`

// firingTimeout bounds one admin request of `delaybridge firing`.
const firingTimeout = 30 * time.Second

// cmdFiring runs `delaybridge firing ACTION [flags]`.
func cmdFiring(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("firing", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), firingUsage)
		fs.PrintDefaults()
	}
	path := fs.String("config", "", "the bridge's YAML config: admin.listen and the admin token (token or token_file) are read from it, DELAYBRIDGE_* environment variables applied")
	base := fs.String("admin", "", "the admin API's address (http://HOST:PORT or HOST:PORT); wins over the config's admin.listen")
	tokenFile := fs.String("token-file", "", "a file holding the admin token; wins over the config's")
	reason := fs.String("reason", "", "pause: why (at most 1024 bytes), kept and shown with the pause")
	// The action first, or after flags ("firing --config F pause"); one
	// only (parseFlags would call another "no arguments" taken).
	action, args := firingAction(args)
	if extra, _ := firingAction(args); extra != "" {
		return usagef(fs, "firing: unexpected argument %q: one action (status, pause or resume), then flags", extra)
	}
	if err := parseFlags(fs, args, stdout); err != nil {
		return err
	}
	var method, route string
	switch action {
	case "status":
		method, route = http.MethodGet, "/v1/firing"
	case "pause":
		method, route = http.MethodPost, "/v1/firing/pause"
	case "resume":
		method, route = http.MethodPost, "/v1/firing/resume"
	case "":
		return usagef(fs, "firing: want an action: status, pause or resume")
	default:
		return usagef(fs, "firing: unknown action %q: want status, pause or resume", action)
	}
	if *reason != "" && action != "pause" {
		return usagef(fs, "firing %s: --reason is for pause only", action)
	}
	if *path == "" && *base == "" {
		return usagef(fs, "firing %s: --config FILE or --admin URL is required", action)
	}
	url, token, err := firingTarget(*path, *base, *tokenFile)
	if err != nil {
		return fmt.Errorf("firing %s: %w", action, err)
	}
	var body io.Reader
	if *reason != "" {
		b, err := json.Marshal(map[string]string{"reason": *reason})
		if err != nil {
			return fmt.Errorf("firing %s: %w", action, err)
		}
		body = bytes.NewReader(b)
	}
	ctx, cancel := context.WithTimeout(ctx, firingTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, url+route, body)
	if err != nil {
		return fmt.Errorf("firing %s: %w", action, err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) && action != "status" {
			// A synced write stalled (a full or hung disk): it may still
			// land after the command gave up.
			return fmt.Errorf("firing %s: no answer within %v (%w); the %s may still take effect: check with delaybridge firing status", action, firingTimeout, err, action)
		}
		return fmt.Errorf("firing %s: %w", action, err)
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return fmt.Errorf("firing %s: reading the answer of %s: %w", action, url+route, err)
	}
	if resp.StatusCode != http.StatusOK {
		msg := strings.TrimSpace(string(answer))
		var e struct {
			Error string `json:"error"`
		}
		if json.Unmarshal(answer, &e) == nil && e.Error != "" {
			msg = e.Error
		}
		return fmt.Errorf("firing %s: %s %s: %s: %s", action, method, url+route, resp.Status, msg)
	}
	_, err = stdout.Write(answer)
	return err
}

// firingAction takes the action out of args: the first argument that is
// neither a flag nor a flag's value. Every flag of `delaybridge firing`
// but -h takes a value, so a flag written without "=" is followed by its
// value. A "--" ends the flags: what follows is left to parseFlags.
func firingAction(args []string) (action string, rest []string) {
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			break
		}
		if len(a) > 1 && a[0] == '-' {
			switch name := strings.TrimLeft(a, "-"); {
			case strings.Contains(name, "="), name == "h", name == "help":
			default:
				i++ // its value
			}
			continue
		}
		return a, append(args[:i:i], args[i+1:]...)
	}
	return "", args
}

// firingTarget is the admin API's base URL and token for `delaybridge
// firing`: from the config at path (admin.listen, on the loopback when it
// listens on every interface, and its token), base and tokenFile winning.
func firingTarget(path, base, tokenFile string) (url, token string, err error) {
	if path != "" {
		cfg, err := config.Load(path, os.Environ())
		if err != nil {
			return "", "", err
		}
		token = cfg.Admin.Token.Value()
		if base == "" {
			host, port, err := net.SplitHostPort(cfg.Admin.Listen)
			if err != nil {
				return "", "", fmt.Errorf("admin.listen %q: %w", cfg.Admin.Listen, err)
			}
			switch host {
			case "", "0.0.0.0":
				host = "127.0.0.1"
			case "::":
				host = "::1"
			}
			if port == "0" {
				return "", "", fmt.Errorf("admin.listen %q has port 0 (any free port): give the port the bridge took with --admin", cfg.Admin.Listen)
			}
			base = net.JoinHostPort(host, port)
		}
	}
	if tokenFile != "" {
		b, err := os.ReadFile(tokenFile)
		if err != nil {
			return "", "", fmt.Errorf("--token-file: %w", err)
		}
		token = strings.TrimSpace(string(b))
	}
	if !strings.Contains(base, "://") {
		base = "http://" + base
	}
	if !strings.HasPrefix(base, "http://") && !strings.HasPrefix(base, "https://") {
		return "", "", errors.New("--admin: want http://HOST:PORT or HOST:PORT")
	}
	return strings.TrimSuffix(base, "/"), token, nil
}
