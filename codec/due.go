package codec

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
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
	// dueLen is the length of a delay-due value (UTC: "Z").
	dueLen = len(dueLayout) - len("Z07:00") + 1
)

// FormatDue writes a due time (Unix ms) as the delay-due header does:
// RFC 3339, UTC, exactly three fractional digits, e.g.
// "2026-11-22T15:04:05.123Z".
func FormatDue(ms int64) string {
	return string(appendDue(nil, ms))
}

// appendDue is FormatDue without the allocation. It writes the digits by
// hand because time.AppendFormat interprets the layout on every call, which
// was the largest single cost of Parse.
func appendDue(dst []byte, ms int64) []byte {
	t := time.UnixMilli(ms).UTC()
	year, month, day := t.Date()
	if year < 0 || year > 9999 {
		return t.AppendFormat(dst, dueLayout)
	}
	hour, minute, sec := t.Clock()
	dst = appendDigits(dst, year, 4)
	dst = append(dst, '-')
	dst = appendDigits(dst, int(month), 2)
	dst = append(dst, '-')
	dst = appendDigits(dst, day, 2)
	dst = append(dst, 'T')
	dst = appendDigits(dst, hour, 2)
	dst = append(dst, ':')
	dst = appendDigits(dst, minute, 2)
	dst = append(dst, ':')
	dst = appendDigits(dst, sec, 2)
	dst = append(dst, '.')
	dst = appendDigits(dst, t.Nanosecond()/1e6, 3)
	return append(dst, 'Z')
}

// appendDigits writes a non-negative v in exactly width decimal digits.
func appendDigits(dst []byte, v, width int) []byte {
	var buf [4]byte
	for i := width - 1; i >= 0; i-- {
		buf[i] = byte('0' + v%10)
		v /= 10
	}
	return append(dst, buf[:width]...)
}

// FormatDelay writes d so that ParseDelay (for d >= 0) and the
// configuration read it back: whole days as "Nd", the rest as
// time.Duration does ("365d", "2d12h0m0s", "90s").
func FormatDelay(d time.Duration) string {
	const day = 24 * time.Hour
	if d < day && d > -day {
		return d.String()
	}
	sign := ""
	if d < 0 {
		if d == math.MinInt64 {
			return d.String() // cannot negate; still a valid Go duration
		}
		sign, d = "-", -d
	}
	s := sign + strconv.FormatInt(int64(d/day), 10) + "d"
	if rest := d % day; rest != 0 {
		s += rest.String()
	}
	return s
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
			return 0, overflowDelay(s)
		}
		return time.Duration(n) * time.Millisecond, nil
	case !isDays:
		return rest, nil
	}
	if n > int64(math.MaxInt64/(24*time.Hour)) {
		return 0, overflowDelay(s)
	}
	d := time.Duration(n) * 24 * time.Hour
	if d > math.MaxInt64-rest {
		return 0, overflowDelay(s)
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
		return 0, overflowDelay(s)
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
	// One leading "+" is allowed in every form, as Go durations allow it.
	if s[0] == '+' && len(s) > 1 && s[1] >= '0' && s[1] <= '9' {
		s = s[1:]
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
			return 0, 0, false, false, overflowDelay(s)
		}
		return n, 0, false, true, nil
	case digits > 0 && s[digits] == 'd':
		n, err := strconv.ParseInt(s[:digits], 10, 64)
		if err != nil {
			return 0, 0, false, false, overflowDelay(s)
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
		// time.ParseDuration takes a bare "0" (and only that) without a
		// unit; after the days it would be a number without one, as the
		// "5" of "1d5", which it refuses.
		if tail == "0" {
			return 0, 0, false, false, badDelay("%s: expected a Go duration after the days", short(s))
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

// fastDelayMs parses the common delay-after forms (integer milliseconds,
// days, and Go durations made of integers and ASCII units) straight from
// the header bytes. ok is false for anything else, including every error,
// and the caller then takes the general path, which must convert the value
// to a string: time.ParseDuration keeps its argument alive, so that string
// would be one heap allocation per message.
func fastDelayMs(b []byte) (ms int64, ok bool) {
	digits := 0
	for digits < len(b) && b[digits] >= '0' && b[digits] <= '9' {
		digits++
	}
	if digits == 0 || digits > 18 { // 18 digits cannot overflow int64
		return 0, false
	}
	n := int64(0)
	for _, c := range b[:digits] {
		n = n*10 + int64(c-'0')
	}
	switch {
	case digits == len(b):
		return n, true
	case b[digits] == 'd':
		if string(b[digits+1:]) == "0" { // "1d0": refused, by splitDelay
			return 0, false
		}
		rest, ok := fastDuration(b[digits+1:])
		if !ok || n > (math.MaxInt64-rest.Milliseconds())/msPerDay {
			return 0, false
		}
		return n*msPerDay + rest.Milliseconds(), true
	}
	d, ok := fastDuration(b)
	if !ok || len(b) == 0 {
		return 0, false
	}
	return d.Milliseconds(), true
}

// fastDuration parses a Go duration of integer components with ASCII units
// ("1h30m", "500ms"); empty input is 0. It agrees with time.ParseDuration
// wherever it returns ok, which FuzzFastDelay checks.
func fastDuration(b []byte) (time.Duration, bool) {
	var total uint64
	for len(b) > 0 {
		digits := 0
		for digits < len(b) && b[digits] >= '0' && b[digits] <= '9' {
			digits++
		}
		if digits == 0 || digits > 18 {
			return 0, false
		}
		v := uint64(0)
		for _, c := range b[:digits] {
			v = v*10 + uint64(c-'0')
		}
		b = b[digits:]
		var unit uint64
		switch {
		case len(b) >= 2 && b[0] == 'n' && b[1] == 's':
			unit, b = uint64(time.Nanosecond), b[2:]
		case len(b) >= 2 && b[0] == 'u' && b[1] == 's':
			unit, b = uint64(time.Microsecond), b[2:]
		case len(b) >= 2 && b[0] == 'm' && b[1] == 's':
			unit, b = uint64(time.Millisecond), b[2:]
		case len(b) >= 1 && b[0] == 's':
			unit, b = uint64(time.Second), b[1:]
		case len(b) >= 1 && b[0] == 'm':
			unit, b = uint64(time.Minute), b[1:]
		case len(b) >= 1 && b[0] == 'h':
			unit, b = uint64(time.Hour), b[1:]
		default:
			return 0, false
		}
		if v > math.MaxInt64/unit {
			return 0, false
		}
		total += v * unit
		if total > math.MaxInt64 {
			return 0, false
		}
	}
	return time.Duration(total), true
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
		if n > MaxDue {
			// Said here rather than by Parse's range check, which names
			// only the number: the usual cause is another unit.
			return 0, badDelay("%s read as Unix milliseconds lies after 9999-12-31%s", short(s), unitHint(n))
		}
		if n >= minSecondsMistake && n < maxSecondsMistake {
			// Read as milliseconds it is a due time in the past, which
			// fires at once: a "close the order in 30 min" closing it
			// now. Nobody means 1970-01-12..1973-03-03.
			return 0, badDelay("%s has %d digits: Unix seconds (%s), not milliseconds; multiply by 1000",
				short(s), len(strconv.FormatInt(n, 10)), time.Unix(n, 0).UTC().Format(time.RFC3339))
		}
		return n, nil
	}
	t, err := parseRFC3339(s)
	if err != nil {
		return 0, badDelay("%s is neither RFC 3339 with an offset nor Unix milliseconds", short(s))
	}
	// Parse only yields four-digit years (a leap second at the end of 9999
	// reaches 10000-01-01), so UnixMilli cannot overflow; Parse's MaxDue
	// check refuses what is past 9999.
	return t.UnixMilli(), nil
}

// An integer delay-at in [minSecondsMistake, maxSecondsMistake) is Unix
// seconds written where milliseconds go: the seconds of 2001-09-09 to
// 5138-11-16, which read as milliseconds fall in 1970-01-12..1973-03-03.
// Parse refuses them (bad-due) rather than firing at once.
const (
	minSecondsMistake = 1e9
	maxSecondsMistake = 1e11
)

// unitHint names the unit an integer delay-at beyond MaxDue was most
// likely written in. Times from 2001 to 2286 have 13 digits in Unix
// milliseconds, 16 in microseconds and 19 in nanoseconds (Go's
// time.UnixMicro and UnixNano, for example).
func unitHint(n int64) string {
	switch {
	case n >= 1e15 && n < 1e16:
		return "; its 16 digits look like Unix microseconds: divide by 1000"
	case n >= 1e18:
		return "; its 19 digits look like Unix nanoseconds: divide by 1000000"
	}
	return ""
}

// parseRFC3339 is time.Parse(time.RFC3339, s) with what RFC 3339 allows
// and Go's layout does not: a lower-case "t" and "z" (section 5.6), and a
// leap second, 23:59:60 in UTC (section 5.7), read as the next second.
func parseRFC3339(s string) (time.Time, error) {
	if len(s) > len("2006-01-02T") && (s[10] == 't' || s[len(s)-1] == 'z') {
		b := []byte(s)
		if b[10] == 't' {
			b[10] = 'T'
		}
		if b[len(b)-1] == 'z' {
			b[len(b)-1] = 'Z'
		}
		s = string(b)
	}
	leap := len(s) > len("2006-01-02T15:04:60") && s[13] == ':' && s[16] == ':' && s[17:19] == "60"
	if leap {
		s = s[:17] + "59" + s[19:]
	}
	// Go's parser is laxer than RFC 3339 5.6 in three places: it takes an
	// offset hour of 24, an offset minute of 60 and a "," before the
	// fraction.
	if n := len(s); n > len("Z07:00") && (s[n-6] == '+' || s[n-6] == '-') && s[n-3] == ':' {
		if h := s[n-5 : n-3]; h > "23" {
			return time.Time{}, fmt.Errorf("offset hour %s beyond 23", h)
		}
		if m := s[n-2:]; m > "59" {
			return time.Time{}, fmt.Errorf("offset minute %s beyond 59", m)
		}
	}
	if strings.IndexByte(s, ',') >= 0 {
		return time.Time{}, fmt.Errorf("a fraction of a second follows \".\", not \",\"")
	}
	t, err := time.Parse(time.RFC3339, s)
	if err != nil || !leap {
		return t, err
	}
	if u := t.UTC(); u.Hour() != 23 || u.Minute() != 59 {
		return time.Time{}, fmt.Errorf("second 60 outside 23:59 UTC")
	}
	return t.Add(time.Second).Truncate(time.Second), nil
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
type delayError struct {
	msg string
	// overflow: the value is a well-formed delay too long for any due
	// time (or for time.Duration), not a malformed one.
	overflow bool
}

func (e *delayError) Error() string { return e.msg }
func (e *delayError) Unwrap() error { return ErrBadDelay }

func badDelay(format string, args ...any) error {
	return &delayError{msg: fmt.Sprintf(format, args...)}
}

// overflowDelay is the error of a well-formed delay s that overflows.
func overflowDelay(s string) error {
	return &delayError{msg: short(s) + " overflows", overflow: true}
}

// isOverflow reports whether err, as delayMs returns it, is
// overflowDelay's. A type assertion, not errors.As, which would allocate
// on every refused delay-after.
func isOverflow(err error) bool {
	de, ok := err.(*delayError)
	return ok && de.overflow
}
