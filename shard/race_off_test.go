//go:build !race

package shard

// raceOn: built with -race, whose Pebble (invariants) copies and
// allocates more: allocation bounds do not hold.
const raceOn = false
