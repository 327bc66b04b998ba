package config

import (
	"bytes"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"unicode"

	"go.uber.org/zap"
)

// Errors of a secret or CA file read again after the start (the start
// itself reports them through Load's validation, naming the key).
var (
	// ErrEmptySecret: the file holds nothing but an optional newline.
	ErrEmptySecret = errors.New("empty")
	// ErrBadToken: a bearer token with surrounding white space or control
	// characters, which no Authorization header can carry.
	ErrBadToken = errors.New("white space around it or control characters in it: no Authorization header can carry it")
	// ErrNoPEM: a CA file without a PEM certificate.
	ErrNoPEM = errors.New("no PEM certificate found")
)

// fileWatch is a value read from a file, read again when the file changed:
// another file behind the path (a Kubernetes Secret update swaps a
// symlink), another size or another modification time. A read that fails
// or does not parse keeps the last value that did (a file caught
// mid-update, a Secret briefly gone) and is logged once per distinct
// error, and once when the file reads again: a rotation that never
// becomes readable ends in refused connections or requests, and the log
// must say why. The callers ask once per connection or per request, so a
// stat each time costs nothing that matters.
type fileWatch[T any] struct {
	key   string // the config key, for the log
	file  string
	parse func([]byte) (T, error)
	log   *zap.Logger

	mu      sync.Mutex
	seen    os.FileInfo // the file of the last read that worked; nil before one
	val     T
	failing string // the error last logged, "" when the last read worked
}

// get returns the file's value as it is now, or the last one that read.
func (w *fileWatch[T]) get() T {
	w.mu.Lock()
	defer w.mu.Unlock()
	fi, err := os.Stat(w.file)
	if err == nil && w.seen != nil && os.SameFile(fi, w.seen) &&
		fi.Size() == w.seen.Size() && fi.ModTime().Equal(w.seen.ModTime()) {
		return w.val
	}
	var v T
	if err == nil {
		var b []byte
		if b, err = os.ReadFile(w.file); err == nil {
			v, err = w.parse(b)
		}
	}
	if err != nil {
		if msg := err.Error(); msg != w.failing {
			w.failing = msg
			w.log.Warn("file could not be read again; keeping the value last read",
				zap.String("key", w.key), zap.String("file", w.file), zap.Error(err))
		}
		return w.val
	}
	if w.seen != nil || w.failing != "" {
		w.log.Info("file read again", zap.String("key", w.key), zap.String("file", w.file))
	}
	w.seen, w.val, w.failing = fi, v, ""
	return v
}

// trimSecret drops the one trailing newline that editors and "echo" add
// ("\n" or "\r\n"); a secret that itself ends in a newline keeps it.
func trimSecret(b []byte) []byte {
	if bytes.HasSuffix(b, []byte("\r\n")) {
		return b[:len(b)-2]
	}
	return bytes.TrimSuffix(b, []byte("\n"))
}

func parseSecret(b []byte) (string, error) {
	b = trimSecret(b)
	if len(b) == 0 {
		return "", ErrEmptySecret
	}
	return string(b), nil
}

// badBearerToken reports whether no Authorization header can carry tok:
// HTTP drops the white space around a header value and forbids control
// characters.
func badBearerToken(tok string) bool {
	return strings.TrimSpace(tok) != tok || strings.ContainsFunc(tok, unicode.IsControl)
}

func parseBearerToken(b []byte) (string, error) {
	s, err := parseSecret(b)
	if err == nil && badBearerToken(s) {
		return "", ErrBadToken
	}
	return s, err
}

func parseCAs(b []byte) (*x509.CertPool, error) {
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(b) {
		return nil, ErrNoPEM
	}
	return pool, nil
}

// SecretFunc returns the current value of a secret. Without a file it is
// value, always. With one (the key's *_file, which Load read into value)
// it is the file as it is at the call, read again whenever the file
// changed, so a rotated password or token takes effect at the next
// connection or request without a restart; a new content that cannot be
// used (unreadable, empty, or for a bearer token one that no header can
// carry) keeps the last one and is logged as a warning. key is the
// config key (admin.token_file ...); keys of bearer tokens (admin.*)
// get their check. log may be nil.
func SecretFunc(key, file string, value Secret, log *zap.Logger) func() string {
	if file == "" {
		v := value.Value()
		return func() string { return v }
	}
	parse := parseSecret
	if strings.HasPrefix(key, "admin.") {
		parse = parseBearerToken
	}
	if log == nil {
		log = zap.NewNop()
	}
	w := &fileWatch[string]{key: key, file: file, parse: parse, log: log, val: value.Value()}
	return w.get
}

// readCAs reads a CA file into a pool (the start's read, which Build
// reports as an error).
func readCAs(file string) (*x509.CertPool, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("tls ca file: %w", err)
	}
	pool, err := parseCAs(b)
	if err != nil {
		return nil, fmt.Errorf("tls ca file %s: %w", file, err)
	}
	return pool, nil
}
