package config

import (
	"bytes"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"slices"
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

// fileWatch is a value read from files, read again at every call: the
// callers ask once per connection, handshake or request, so the reads cost
// nothing that matters, and no rewrite is missed (a stat-based cache
// misses one of the same size within the file system's timestamp
// granularity). Contents equal to the last good ones return the value
// kept; new ones are parsed. A read that fails or does not parse keeps the
// last value that did (a file caught mid-update, a Secret briefly gone)
// and is logged once per distinct error, and once when the files read
// again: a rotation that never becomes readable ends in refused
// connections or requests, and the log must say why.
type fileWatch[T any] struct {
	files  []string
	parse  func(data ...[]byte) (T, error) // one data per file
	log    *zap.Logger
	fields []zap.Field // name the files in the log lines
	// failMsg is logged for a change that cannot be used; againMsg once
	// the files read again after one, and for every change read when
	// logChanges.
	failMsg, againMsg string
	logChanges        bool

	mu      sync.Mutex
	raw     [][]byte // the contents of the last read that worked; nil before one
	val     T
	failing string // the error last logged, "" when the last read worked
}

// get returns the value of the files as they are now, or the last one that
// read.
func (w *fileWatch[T]) get() T {
	w.mu.Lock()
	defer w.mu.Unlock()
	raw := make([][]byte, len(w.files))
	var err error
	for i, f := range w.files {
		if raw[i], err = os.ReadFile(f); err != nil {
			break
		}
	}
	unchanged := err == nil && w.raw != nil && slices.EqualFunc(raw, w.raw, bytes.Equal)
	var v T
	if err == nil && !unchanged {
		v, err = w.parse(raw...)
	}
	if err != nil {
		if msg := err.Error(); msg != w.failing {
			w.failing = msg
			w.log.Warn(w.failMsg, append(slices.Clip(w.fields), zap.Error(err))...)
		}
		return w.val
	}
	if w.failing != "" || (w.logChanges && !unchanged && w.raw != nil) {
		w.log.Info(w.againMsg, w.fields...)
	}
	w.failing = ""
	if !unchanged {
		w.raw, w.val = raw, v
	}
	return w.val
}

// newSecretWatch watches a secret or CA file of the config key key.
func newSecretWatch[T any](key, file string, parse func([]byte) (T, error), first T, log *zap.Logger) *fileWatch[T] {
	if log == nil {
		log = zap.NewNop()
	}
	return &fileWatch[T]{
		files:      []string{file},
		parse:      func(data ...[]byte) (T, error) { return parse(data[0]) },
		log:        log,
		fields:     []zap.Field{zap.String("key", key), zap.String("file", file)},
		failMsg:    "file could not be read again; keeping the value last read",
		againMsg:   "file read again",
		logChanges: true,
		val:        first,
	}
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
// it is the file as it is at the call (read at every call), so that when it
// changes a rotated password or token takes effect at the next
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
	return newSecretWatch(key, file, parse, value.Value(), log).get
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
