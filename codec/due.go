package codec

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"
)

// ErrBadDelay is wrapped by the errors of ParseDelay and of due-time parsing.
var ErrBadDelay = errors.New("codec: bad delay")

const (
	msPerDay = int64(24 * time.Hour / time.Millisecond)

	// MinDue and MaxDue bound every due time in Unix ms: 1970-01-01T00:00:00Z
	// and 9999-12-31T23:59:59.999Z. Times outside cannot be written as the
	// four-digit-year RFC 3339 of delay-due, so they are refused as bad-due
	// rather than delivered with a header nobody can parse.
	MinDue int64 = 0
	MaxDue int64 = 253402300799999

	// dueLayout is RFC 3339 with exactly three fractional digits; for UTC
	// times "Z07:00" prints "Z".
	dueLayout = "2006-01-02T15:04:05.000Z07:00"
)

// FormatDue writes a due time (Unix ms) as the delay-due header does:
// RFC 3339, UTC, exactly three fractional digits, e.g.
// "2026-11-22T15:04:05.123Z".
func FormatDue(ms int64) string {
	return string(appendDue(nil, ms))
}

func appendDue(dst []byte, ms int64) []byte {
	return time.UnixMilli(ms).UTC().AppendFormat(dst, dueLayout)
}

// ParseDelay parses a relative delay as delay-after and the configuration
// (max_delay: 365d) write it: a Go duration ("90s", "1h30m", "500ms"), whole
// days with "d" optionally followed by a Go duration ("3d", "2d12h"), or an
// integer number of milliseconds ("1500"). Negative delays and delays that
// overflow time.Duration (about 292 years) are refused with an error wrapping
// ErrBadDelay.
func ParseDelay(s string) (time.Duration, error) {
	d, err := parseDelay(s)
	if err != nil {
		return 0, fmt.Errorf("codec: delay %w", err)
	}
	return d, nil
}

func parseDelay(s string) (time.Duration, error) {
	n, rest, isDays, isMs, err := splitDelay(s)
	switch {
	case err != nil:
		return 0, err
	case isMs:
		if n > int64(math.MaxInt64/time.Millisecond) {
			return 0, badDelay("%s overflows", short(s))
		}
		return time.Duration(n) * time.Millisecond, nil
	case !isDays:
		return rest, nil
	}
	if n > int64(math.MaxInt64/(24*time.Hour)) {
		return 0, badDelay("%s overflows", short(s))
	}
	d := time.Duration(n) * 24 * time.Hour
	if d > math.MaxInt64-rest {
		return 0, badDelay("%s overflows", short(s))
	}
	return d + rest, nil
}

// delayMs parses a delay-after value into milliseconds. Unlike ParseDelay it
// is not bounded by time.Duration, so "99999999999d" is reported as an
// overflow of the due time, not of the delay type; sub-millisecond parts of
// a Go duration are truncated.
func delayMs(s string) (int64, error) {
	n, rest, isDays, isMs, err := splitDelay(s)
	if err != nil {
		return 0, err
	}
	if isMs {
		return n, nil
	}
	restMs := rest.Milliseconds()
	if !isDays {
		return restMs, nil
	}
	if n > (math.MaxInt64-restMs)/msPerDay {
		return 0, badDelay("%s overflows", short(s))
	}
	return n*msPerDay + restMs, nil
}

// splitDelay recognises the three delay forms. For integer milliseconds it
// returns n with isMs; for days it returns the day count in n and the Go
// duration after the "d" in rest; otherwise rest is the whole Go duration.
func splitDelay(s string) (n int64, rest time.Duration, isDays, isMs bool, err error) {
	if s == "" {
		return 0, 0, false, false, badDelay("is empty")
	}
	if s[0] == '-' {
		return 0, 0, false, false, badDelay("%s is negative", short(s))
	}
	digits := 0
	for digits < len(s) && s[digits] >= '0' && s[digits] <= '9' {
		digits++
	}
	switch {
	case digits == len(s):
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return 0, 0, false, false, badDelay("%s overflows", short(s))
		}
		return n, 0, false, true, nil
	case digits > 0 && s[digits] == 'd':
		n, err := strconv.ParseInt(s[:digits], 10, 64)
		if err != nil {
			return 0, 0, false, false, badDelay("%s overflows", short(s))
		}
		tail := s[digits+1:]
		if tail == "" {
			return n, 0, true, false, nil
		}
		// Only an unsigned duration may follow the days: "2d-5h" would be
		// a confusing way to write 43h.
		if tail[0] < '0' || tail[0] > '9' {
			return 0, 0, false, false, badDelay("%s: expected a duration after the days", short(s))
		}
		d, err := time.ParseDuration(tail)
		if err != nil {
			return 0, 0, false, false, badDelay("%s: expected a Go duration after the days", short(s))
		}
		return n, d, true, false, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, 0, false, false, badDelay("%s is not a duration, days or milliseconds", short(s))
	}
	if d < 0 {
		return 0, 0, false, false, badDelay("%s is negative", short(s))
	}
	return 0, d, false, false, nil
}

// atMs parses a delay-at value: integer Unix milliseconds or RFC 3339 with
// an offset (any fractional precision; sub-millisecond digits truncated).
func atMs(s string) (int64, error) {
	if s == "" {
		return 0, badDelay("is empty")
	}
	if isInteger(s) {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return 0, badDelay("%s overflows", short(s))
		}
		return n, nil
	}
	t, err := time.Parse(time.RFC3339, s)
	if err != nil {
		return 0, badDelay("%s is neither RFC 3339 with an offset nor Unix milliseconds", short(s))
	}
	// Parse only yields four-digit years, so UnixMilli cannot overflow.
	return t.UnixMilli(), nil
}

// isInteger reports whether s is an optionally negative run of ASCII digits.
func isInteger(s string) bool {
	if s != "" && s[0] == '-' {
		s = s[1:]
	}
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

// addMs adds without wrapping around; ok is false on overflow.
func addMs(a, b int64) (int64, bool) {
	c := a + b
	if (b > 0 && c < a) || (b < 0 && c > a) {
		return 0, false
	}
	return c, true
}

// short quotes a header value for an error detail, cut to a readable length:
// a detail is a human sentence, not a copy of an arbitrarily large value.
func short(s string) string {
	const limit = 64
	if len(s) <= limit {
		return strconv.Quote(s)
	}
	return strconv.Quote(s[:limit]) + "..."
}

// delayError is a due-time parse failure. Its message is a phrase about the
// value ("\"-5s\" is negative") so that Parse can put it in a dead letter's
// detail after the header name; errors.Is matches ErrBadDelay.
type delayError struct{ msg string }

func (e *delayError) Error() string { return e.msg }
func (e *delayError) Unwrap() error { return ErrBadDelay }

func badDelay(format string, args ...any) error {
	return &delayError{msg: fmt.Sprintf(format, args...)}
}
