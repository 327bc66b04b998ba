package config

import (
	"testing"
	"time"
)

func TestParseDuration(t *testing.T) {
	const day = 24 * time.Hour
	tests := []struct {
		in      string
		want    time.Duration
		wantErr bool
	}{
		{in: "0", want: 0},
		{in: "90s", want: 90 * time.Second},
		{in: "1h30m", want: 90 * time.Minute},
		{in: "500ms", want: 500 * time.Millisecond},
		{in: "365d", want: 365 * day},
		{in: "2d12h", want: 2*day + 12*time.Hour},
		{in: "1d1ms", want: day + time.Millisecond},
		{in: "0d", want: 0},
		{in: "-1d", want: -day},
		{in: " 3d ", want: 3 * day},
		{in: "", wantErr: true},
		{in: "10", wantErr: true},
		{in: "d", wantErr: true},
		{in: "1.5d", wantErr: true},
		{in: "1h2d", wantErr: true},
		{in: "2d-1h", wantErr: true},
		{in: "1d1d", wantErr: true},
		{in: "abc", wantErr: true},
		{in: "99999999999999d", wantErr: true},
		{in: "106751d24h", wantErr: true}, // overflows int64 nanoseconds
		{in: "106751d", want: 106751 * day},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := ParseDuration(tt.in)
			if tt.wantErr {
				if err == nil {
					t.Fatalf("ParseDuration(%q) = %v, want error", tt.in, got)
				}
				return
			}
			if err != nil {
				t.Fatalf("ParseDuration(%q): %v", tt.in, err)
			}
			if got != tt.want {
				t.Fatalf("ParseDuration(%q) = %v, want %v", tt.in, got, tt.want)
			}
		})
	}
}

func TestDurationStringRoundTrip(t *testing.T) {
	const day = 24 * time.Hour
	for _, d := range []time.Duration{0, time.Millisecond, 10 * time.Minute, day, 365 * day,
		2*day + 12*time.Hour, -3 * day, -day - time.Second, time.Duration(1<<63 - 1), time.Duration(-1 << 63)} {
		s := Duration(d).String()
		back, err := ParseDuration(s)
		if err != nil {
			t.Fatalf("%v formats as %q which does not parse: %v", d, s, err)
		}
		if back != d {
			t.Fatalf("%v -> %q -> %v", d, s, back)
		}
	}
	if got := Duration(365 * day).String(); got != "365d" {
		t.Fatalf("365d formats as %q", got)
	}
}

func FuzzParseDuration(f *testing.F) {
	for _, s := range []string{"0", "365d", "2d12h", "-1d", "1h30m", "d", "9999999999d", "1d-1s"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		d, err := ParseDuration(s)
		if err != nil {
			return
		}
		back, err := ParseDuration(Duration(d).String())
		if err != nil || back != d {
			t.Fatalf("%q -> %v -> %q -> %v, %v", s, d, Duration(d).String(), back, err)
		}
	})
}
