package config

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/delaybridge/delaybridge/codec"
)

// Duration is a time.Duration that also accepts a whole number of days
// ("365d", "2d12h") in YAML and environment values. Days are 24 hours; there
// is no calendar arithmetic.
//
// The days syntax is codec.ParseDelay's, the parser of delay-after.
type Duration time.Duration

// Std returns d as a time.Duration.
func (d Duration) Std() time.Duration { return time.Duration(d) }

// String formats d so that ParseDuration reads it back: whole days as "Nd",
// the rest as time.Duration does ("2d12h0m0s"); see codec.FormatDelay.
func (d Duration) String() string { return codec.FormatDelay(time.Duration(d)) }

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
// days: "10m", "365d", "2d12h", "-1d". It is codec.ParseDelay (the parser of
// delay-after) with a sign allowed in front, and a bare number other than
// "0" refused because its unit would be a guess (delay-after reads it as
// milliseconds).
func ParseDuration(s string) (time.Duration, error) {
	orig := s
	s = strings.TrimSpace(s)
	if !strings.Contains(s, "d") {
		// A Go duration, either sign ("-2562047h47m16.854775808s" is
		// time.Duration's minimum, which has no positive counterpart).
		if v, err := time.ParseDuration(s); err == nil {
			return v, nil
		}
		return 0, fmt.Errorf("invalid duration %q: %w", orig, errDurationSyntax)
	}
	neg := false
	if s != "" && (s[0] == '-' || s[0] == '+') {
		neg, s = s[0] == '-', s[1:]
	}
	v, err := codec.ParseDelay(s)
	if err != nil {
		return 0, fmt.Errorf("invalid duration %q: %w (%w)", orig, errDurationSyntax, err)
	}
	if neg {
		v = -v
	}
	return v, nil
}
