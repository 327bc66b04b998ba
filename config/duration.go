package config

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"gopkg.in/yaml.v3"
)

// Duration is a time.Duration that also accepts a whole number of days
// ("365d", "2d12h") in YAML and environment values. Days are 24 hours; there
// is no calendar arithmetic.
//
// TODO(fold): package codec has its own days-aware parser for delay-after;
// once it lands, both should share one implementation.
type Duration time.Duration

// Std returns d as a time.Duration.
func (d Duration) Std() time.Duration { return time.Duration(d) }

// String formats d so that ParseDuration reads it back: whole days as "Nd",
// the rest as time.Duration does ("2d12h0m0s").
func (d Duration) String() string {
	const day = 24 * time.Hour
	v := time.Duration(d)
	if v < day && v > -day {
		return v.String()
	}
	sign := ""
	if v < 0 {
		if v == time.Duration(-1<<63) {
			return v.String() // cannot negate; still a valid Go duration
		}
		sign, v = "-", -v
	}
	days := v / day
	rest := v % day
	s := sign + strconv.FormatInt(int64(days), 10) + "d"
	if rest != 0 {
		s += rest.String()
	}
	return s
}

// MarshalText implements encoding.TextMarshaler (YAML output, logs).
func (d Duration) MarshalText() ([]byte, error) { return []byte(d.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler.
func (d *Duration) UnmarshalText(b []byte) error {
	v, err := ParseDuration(string(b))
	if err != nil {
		return err
	}
	*d = Duration(v)
	return nil
}

// MarshalYAML writes the duration as its string form.
func (d Duration) MarshalYAML() (any, error) { return d.String(), nil }

// UnmarshalYAML reads a scalar duration. Package config decodes YAML with its
// own walker; this method is for callers that embed a Duration in their own
// yaml.v3 structures.
func (d *Duration) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.ScalarNode {
		return fmt.Errorf("line %d: duration must be a scalar", n.Line)
	}
	return d.UnmarshalText([]byte(n.Value))
}

var errDurationSyntax = errors.New(`want a Go duration ("90s", "1h30m") or days ("365d", "2d12h")`)

// ParseDuration parses a Go duration with an optional leading whole number of
// days: "10m", "365d", "2d12h", "-1d". A bare number other than "0" is refused
// because its unit would be a guess.
func ParseDuration(s string) (time.Duration, error) {
	orig := s
	s = strings.TrimSpace(s)
	i := strings.IndexByte(s, 'd')
	if i < 0 {
		v, err := time.ParseDuration(s)
		if err != nil {
			return 0, fmt.Errorf("invalid duration %q: %w", orig, errDurationSyntax)
		}
		return v, nil
	}
	neg := false
	num := s[:i]
	if num != "" && (num[0] == '-' || num[0] == '+') {
		neg = num[0] == '-'
		num = num[1:]
	}
	if num == "" || strings.TrimLeft(num, "0123456789") != "" {
		return 0, fmt.Errorf("invalid duration %q: %w", orig, errDurationSyntax)
	}
	days, err := strconv.ParseInt(num, 10, 64)
	const maxDays = int64(1<<63-1) / int64(24*time.Hour)
	if err != nil || days > maxDays {
		return 0, fmt.Errorf("invalid duration %q: out of range", orig)
	}
	total := time.Duration(days) * 24 * time.Hour
	if rest := s[i+1:]; rest != "" {
		if rest[0] == '-' || rest[0] == '+' {
			return 0, fmt.Errorf("invalid duration %q: %w", orig, errDurationSyntax)
		}
		r, err := time.ParseDuration(rest)
		if err != nil {
			return 0, fmt.Errorf("invalid duration %q: %w", orig, errDurationSyntax)
		}
		if r > time.Duration(1<<63-1)-total {
			return 0, fmt.Errorf("invalid duration %q: out of range", orig)
		}
		total += r
	}
	if neg {
		total = -total
	}
	return total, nil
}
