//go:build !linux

package benchrun

// freshPageMicros is not measured here.
func freshPageMicros() float64 { return 0 }
