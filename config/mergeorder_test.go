package config

import (
	"strings"
	"testing"

	"github.com/delaybridge/delaybridge/codec"
)

// TestMergeSequenceEarlierWins (review R210): in a merge key's sequence
// ("<<: [*a, *b]") the mappings earlier in the sequence win (YAML 1.1's merge key; gopkg.in/yaml.v3
// decodes so). The decoder applies them in order, so the later one won:
// shards 4 for [{shards: 2}, {shards: 4}], and a later mapping with an
// empty targets block (e8f844e empties allow at the targets key) denied
// every target the earlier one allowed.
func TestMergeSequenceEarlierWins(t *testing.T) {
	base := strings.Replace(validYAML, "targets:\n  allow: [\"*\"]\n", "", 1)
	if c := mustLoad(t, base+"<<: [{shards: 2}, {shards: 4}]\n"); c.Shards != 2 {
		t.Errorf("<<: [{shards: 2}, {shards: 4}]: shards %d, want 2 (the first mapping wins)", c.Shards)
	}
	if c := mustLoad(t, base+"<<: [{targets: {allow: [orders]}}, {targets: {}}]\n"); !c.AllowTarget(codec.TransportKafka, "orders") {
		t.Errorf("<<: [{targets: {allow: [orders]}}, {targets: {}}]: allow %q, want [orders] (the first mapping wins)", c.Targets.Allow)
	}
}
