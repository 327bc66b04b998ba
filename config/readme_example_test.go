package config_test

import (
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/config"
)

// readmeConfigSection returns the "## Configuration" section of the
// repository's README.md, up to the next second-level heading.
func readmeConfigSection(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "README.md"))
	if err != nil {
		t.Fatalf("read README: %v", err)
	}
	s := string(b)
	_, sec, ok := strings.Cut(s, "\n## Configuration\n")
	if !ok {
		t.Fatal(`README.md has no "## Configuration" section`)
	}
	if i := strings.Index(sec, "\n## "); i >= 0 {
		sec = sec[:i]
	}
	return sec
}

// readmeYAMLBlocks returns the ```yaml blocks of the README's
// Configuration section, each a complete config.
func readmeYAMLBlocks(t *testing.T) []string {
	t.Helper()
	sec := readmeConfigSection(t)
	var blocks []string
	for {
		_, rest, ok := strings.Cut(sec, "\n```yaml\n")
		if !ok {
			break
		}
		block, after, ok := strings.Cut(rest, "\n```")
		if !ok {
			t.Fatal("README: a ```yaml block in Configuration is not closed")
		}
		blocks = append(blocks, block+"\n")
		sec = after
	}
	if len(blocks) == 0 {
		t.Fatal("README: no ```yaml block in the Configuration section")
	}
	return blocks
}

// loadAsCheck loads yml as `delaybridge run --config FILE --check` does
// (config.Load on a file), with environ as the only environment, so the
// test's own DELAYBRIDGE_ variables play no part.
func loadAsCheck(t *testing.T, yml string, environ []string) (*config.Config, error) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "delaybridge.yaml")
	if err := os.WriteFile(path, []byte(yml), 0o600); err != nil {
		t.Fatal(err)
	}
	return config.Load(path, environ)
}

// TestREADMEConfigExamplesLoad: every complete YAML example of the
// README's Configuration section (the reference block) loads and validates
// as `run --check` loads it, and its effective config (what --check
// prints) loads back to the same config, as the README says.
func TestREADMEConfigExamplesLoad(t *testing.T) {
	for i, yml := range readmeYAMLBlocks(t) {
		c, err := loadAsCheck(t, yml, nil)
		if err != nil {
			t.Errorf("README Configuration yaml block %d does not load:\n%v", i, err)
			continue
		}
		back, err := config.LoadBytes([]byte(c.String()), nil)
		if err != nil {
			t.Errorf("block %d: the effective config (run --check's stdout) does not load back: %v\n%s", i, err, c.String())
			continue
		}
		if got, want := back.String(), c.String(); got != want {
			t.Errorf("block %d: the effective config loads back as\n%s\nwant\n%s", i, got, want)
		}
	}
}

// TestREADMEConfigReferenceShowsDefaults: the reference block (the first)
// gives every key its default, except what has none (data_dir, the
// brokers and the sources): it loads to the config those alone make.
func TestREADMEConfigReferenceShowsDefaults(t *testing.T) {
	ref, err := loadAsCheck(t, readmeYAMLBlocks(t)[0], nil)
	if err != nil {
		t.Fatalf("reference block: %v", err)
	}
	minimal := `
data_dir: /var/lib/delaybridge
kafka:
  brokers: ["localhost:9092"]
  sources:
    - {topic: delay, dlq: delay.dlq}
nats:
  sources:
    - {subject: "delay.>", dlq: dlq.delay}
`
	def, err := config.LoadBytes([]byte(minimal), nil)
	if err != nil {
		t.Fatalf("minimal config: %v", err)
	}
	got, want := strings.Split(ref.String(), "\n"), strings.Split(def.String(), "\n")
	if len(got) != len(want) {
		t.Fatalf("the README's reference block is not the defaults:\nREADME:\n%s\ndefaults:\n%s", ref, def)
	}
	for i := range got {
		if got[i] != want[i] {
			t.Errorf("the README's reference block is not the defaults: line %d of the effective config is %q, the default %q", i+1, got[i], want[i])
		}
	}
}

// schemaKeys returns the key paths of every single value of the config
// schema ("kafka.sources[].dlq").
func schemaKeys(t reflect.Type, prefix string) []string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	var keys []string
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if !f.IsExported() || name == "" || name == "-" {
			continue
		}
		path := name
		if prefix != "" {
			path = prefix + "." + name
		}
		ft := f.Type
		for ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		switch {
		case ft.Kind() == reflect.Struct:
			keys = append(keys, schemaKeys(ft, path)...)
		case ft.Kind() == reflect.Slice && ft.Elem().Kind() == reflect.Struct:
			keys = append(keys, schemaKeys(ft.Elem(), path+"[]")...)
		default:
			keys = append(keys, path)
		}
	}
	return keys
}

// orKey is a comment naming a key given instead of the one it follows:
// "password: ""  # or password_file".
var orKey = regexp.MustCompile(`^#\s*or ([a-z_]+)\b`)

// blockKeys returns the key paths the YAML names, and the sibling keys
// its line comments name with "# or KEY".
func blockKeys(n *yaml.Node, prefix string, into map[string]bool) {
	switch n.Kind {
	case yaml.DocumentNode:
		for _, c := range n.Content {
			blockKeys(c, prefix, into)
		}
	case yaml.SequenceNode:
		for _, c := range n.Content {
			blockKeys(c, prefix+"[]", into)
		}
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			path := k.Value
			sib := func(key string) string { return key }
			if prefix != "" {
				path = prefix + "." + k.Value
				sib = func(key string) string { return prefix + "." + key }
			}
			into[path] = true
			for _, c := range []string{k.LineComment, v.LineComment} {
				if m := orKey.FindStringSubmatch(c); m != nil {
					into[sib(m[1])] = true
				}
			}
			blockKeys(v, path, into)
		}
	}
}

// TestREADMEConfigReferenceNamesEveryKey: the reference block names every
// key of the schema, as a key or in a "# or KEY" comment, and no key the
// schema does not have.
func TestREADMEConfigReferenceNamesEveryKey(t *testing.T) {
	var root yaml.Node
	if err := yaml.Unmarshal([]byte(readmeYAMLBlocks(t)[0]), &root); err != nil {
		t.Fatalf("reference block: %v", err)
	}
	named := map[string]bool{}
	blockKeys(&root, "", named)
	schema := schemaKeys(reflect.TypeFor[config.Config](), "")
	for _, k := range schema {
		if !named[k] {
			t.Errorf("README's reference block does not name %s", k)
		}
	}
	for k := range named {
		isLeaf := slices.Contains(schema, k)
		isBlock := slices.ContainsFunc(schema, func(s string) bool {
			return strings.HasPrefix(s, k+".") || strings.HasPrefix(s, k+"[].")
		})
		if !isLeaf && !isBlock {
			t.Errorf("README's reference block names %s, which is no key of the config", k)
		}
	}
}

// rangeComment is a range a reference comment gives a key: "(1..1024)".
var rangeComment = regexp.MustCompile(`\((\d+)\.\.(\d+)[;)]`)

// TestREADMEConfigRanges: each numeric range "(lo..hi)" a comment of the
// reference block gives its key is what validation takes: lo and hi are
// valid, lo-1 and hi+1 are refused naming the key, set through the
// key's DELAYBRIDGE_ variable as the README spells them.
func TestREADMEConfigRanges(t *testing.T) {
	yml := readmeYAMLBlocks(t)[0]
	var root yaml.Node
	if err := yaml.Unmarshal([]byte(yml), &root); err != nil {
		t.Fatalf("reference block: %v", err)
	}
	type bound struct {
		key    string
		lo, hi int
	}
	var bounds []bound
	var walk func(n *yaml.Node, prefix string)
	walk = func(n *yaml.Node, prefix string) {
		for _, c := range n.Content {
			if n.Kind != yaml.MappingNode {
				walk(c, prefix)
			}
		}
		if n.Kind != yaml.MappingNode {
			return
		}
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			path := k.Value
			if prefix != "" {
				path = prefix + "." + k.Value
			}
			if v.Kind == yaml.ScalarNode {
				if m := rangeComment.FindStringSubmatch(k.LineComment + v.LineComment); m != nil {
					lo, _ := strconv.Atoi(m[1])
					hi, _ := strconv.Atoi(m[2])
					bounds = append(bounds, bound{path, lo, hi})
				}
			}
			if v.Kind == yaml.MappingNode {
				walk(v, path)
			}
		}
	}
	walk(&root, "")
	if len(bounds) < 6 {
		t.Fatalf("found %d ranges in the reference block's comments (%v), want the 6 it gives", len(bounds), bounds)
	}
	for _, b := range bounds {
		env := config.EnvName(b.key)
		for _, tc := range []struct {
			v  int
			ok bool
		}{{b.lo, true}, {b.hi, true}, {b.lo - 1, false}, {b.hi + 1, false}} {
			environ := []string{env + "=" + strconv.Itoa(tc.v)}
			if b.key == "store.cache_mb" {
				// The block's memtable_mb: 128 needs a cache of 256.
				environ = append(environ, "DELAYBRIDGE_STORE_MEMTABLE_MB=4")
			}
			_, err := loadAsCheck(t, yml, environ)
			switch {
			case tc.ok && err != nil:
				t.Errorf("README says %s takes %d..%d; %s=%d is refused: %v", b.key, b.lo, b.hi, env, tc.v, err)
			case !tc.ok && err == nil:
				t.Errorf("README says %s takes %d..%d; %s=%d is taken", b.key, b.lo, b.hi, env, tc.v)
			case !tc.ok && !strings.Contains(err.Error(), b.key+" (from "+env+"): "):
				t.Errorf("%s=%d: error %q does not name the key and the variable", env, tc.v, err)
			}
		}
	}
}

// TestREADMEConfigMessages: the messages and examples the Configuration
// section quotes are what the loader says and does.
func TestREADMEConfigMessages(t *testing.T) {
	sec := readmeConfigSection(t)
	ref := readmeYAMLBlocks(t)[0]
	for _, tc := range []struct {
		quote   string // in the README, as written
		yml     string
		env     []string
		wantErr string // "": loads
	}{
		{"`retry.max_attempts (from DELAYBRIDGE_RETRY_MAX_ATTEMPTS): must be at least 1, got -1`",
			ref, []string{"DELAYBRIDGE_RETRY_MAX_ATTEMPTS=-1"}, "retry.max_attempts (from DELAYBRIDGE_RETRY_MAX_ATTEMPTS): must be at least 1, got -1"},
		{"(`line 3: horizon: invalid\nduration \"10\": ...`)",
			"data_dir: /d\nshards: 8\nhorizon: 10\nnats: {sources: [{subject: a.>, dlq: b}]}\n", nil, `line 3: horizon: invalid duration "10": `},
		{"`env\nDELAYBRIDGE_FOO: names no configuration key`",
			ref, []string{"DELAYBRIDGE_FOO=1"}, "env DELAYBRIDGE_FOO: names no configuration key"},
		{"`DELAYBRIDGE_KAFKA_BROKERS=a:9092,b:9092`", ref, []string{"DELAYBRIDGE_KAFKA_BROKERS=a:9092,b:9092"}, ""},
		{"`DELAYBRIDGE_KAFKA_SOURCES_0_TOPIC=delay`", ref, []string{"DELAYBRIDGE_KAFKA_SOURCES_0_TOPIC=delay"}, ""},
		{"`kafka://orders` is refused at start", ref, []string{"DELAYBRIDGE_TARGETS_ALLOW=kafka://orders"}, "targets.allow[0] (from DELAYBRIDGE_TARGETS_ALLOW): "},
		{"a Kafka topic never has one, and a `kafka:`\npattern with a comma is refused", ref, []string{`DELAYBRIDGE_TARGETS_ALLOW=kafka:a\,b`}, "targets.allow[0] (from DELAYBRIDGE_TARGETS_ALLOW): "},
		{"/ ? # % and , must be percent-encoded (refused at start otherwise; @ may stay)", ref, []string{"DELAYBRIDGE_NATS_URL=nats://u:p@ss@localhost:4222"}, ""},
		{"/ ? # % and , must be percent-encoded (refused at start otherwise; @ may stay)", ref, []string{"DELAYBRIDGE_NATS_URL=nats://u:p%40ss@localhost:4222"}, ""},
		{"/ ? # % and , must be percent-encoded (refused at start otherwise; @ may stay)", ref, []string{"DELAYBRIDGE_NATS_URL=nats://u:p/ss@localhost:4222"}, "nats.url (from DELAYBRIDGE_NATS_URL): "},
		{"/ ? # % and , must be percent-encoded (refused at start otherwise; @ may stay)", ref, []string{"DELAYBRIDGE_NATS_URL=nats://u:p%ss@localhost:4222"}, "nats.url (from DELAYBRIDGE_NATS_URL): "},
		{"/ ? # % and , must be percent-encoded (refused at start otherwise; @ may stay)", ref, []string{"DELAYBRIDGE_NATS_URL=nats://u:p,ss@localhost:4222"}, "nats.url (from DELAYBRIDGE_NATS_URL): "},
		{"a bare number other than `0` is refused", ref, []string{"DELAYBRIDGE_CANCEL_RETENTION=0"}, ""},
		{"a bare number other than `0` is refused", ref, []string{"DELAYBRIDGE_CANCEL_RETENTION=30"}, `invalid duration "30"`},
		{"(`90s`,\n`1h30m`, `365d`, `2d12h`)", ref, []string{"DELAYBRIDGE_HORIZON=90s", "DELAYBRIDGE_CANCEL_RETENTION=1h30m", "DELAYBRIDGE_MAX_DELAY=2d12h", "DELAYBRIDGE_SHUTDOWN_TIMEOUT=365d"}, ""},
	} {
		if !strings.Contains(sec, tc.quote) {
			t.Errorf("README's Configuration section no longer says %q: update this test with it", tc.quote)
			continue
		}
		_, err := loadAsCheck(t, tc.yml, tc.env)
		switch {
		case tc.wantErr == "" && err != nil:
			t.Errorf("README: %s: %v refused: %v", tc.quote, tc.env, err)
		case tc.wantErr != "" && err == nil:
			t.Errorf("README: %s: %v taken", tc.quote, tc.env)
		case tc.wantErr != "" && !strings.Contains(err.Error(), tc.wantErr):
			t.Errorf("README: %s: error\n%v\nwant it to contain %q", tc.quote, err, tc.wantErr)
		}
	}

	// DELAYBRIDGE_TARGETS_ALLOW='nats:billing.eu\,us,orders.*' allows
	// billing.eu,us and orders.*.
	const allow = "`DELAYBRIDGE_TARGETS_ALLOW='nats:billing.eu\\,us,orders.*'`"
	if !strings.Contains(sec, allow) {
		t.Fatalf("README no longer shows %s", allow)
	}
	c, err := loadAsCheck(t, ref, []string{`DELAYBRIDGE_TARGETS_ALLOW=nats:billing.eu\,us,orders.*`})
	if err != nil {
		t.Fatal(err)
	}
	for _, tg := range []struct {
		tr   codec.Transport
		name string
		want bool
	}{
		{codec.TransportNATS, "billing.eu,us", true},
		{codec.TransportNATS, "orders.x", true},
		{codec.TransportKafka, "orders.x", true},
		{codec.TransportKafka, "billing.eu,us", false},
		{codec.TransportNATS, "billing.eu", false},
	} {
		if got := c.AllowTarget(tg.tr, tg.name); got != tg.want {
			t.Errorf("%s: AllowTarget(%v, %q) = %v, want %v", allow, tg.tr, tg.name, got, tg.want)
		}
	}
}
