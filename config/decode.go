package config

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"reflect"
	"strconv"
	"strings"

	"gopkg.in/yaml.v3"
)

var (
	durationType = reflect.TypeFor[Duration]()
	secretType   = reflect.TypeFor[Secret]()
)

// maxListLen bounds lists and list indexes (YAML and environment), so a
// typo like DELAYBRIDGE_KAFKA_SOURCES_99999999_TOPIC cannot allocate memory
// without bound.
const maxListLen = 1024

// yamlName is the key of a struct field: its yaml tag up to the comma.
func yamlName(f reflect.StructField) string {
	if !f.IsExported() {
		return ""
	}
	name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
	if name == "-" {
		return ""
	}
	return name
}

// decodeYAML decodes one YAML document onto c, which holds the defaults,
// and returns the key paths of the single values it set ("store.cache_mb")
// and of the keys it found with a null value ("kafka:" with nothing under
// it), which leave c as it was. Errors of all keys are collected and
// joined.
func decodeYAML(data []byte, c *Config) (set, null map[string]bool, err error) {
	root, err := parseYAML(data)
	if err != nil || root == nil {
		return nil, nil, err
	}
	d := &decoder{budget: 10000 + 10*len(data), set: map[string]bool{}, null: map[string]bool{}}
	d.value(root, reflect.ValueOf(c).Elem(), "")
	return d.set, d.null, errors.Join(d.errs...)
}

// yamlError names the parser in err once: yaml.v3's syntax errors already
// start with "yaml: ", and a second prefix ("yaml: yaml: line 2: ...") is
// what a user would read.
func yamlError(err error) error {
	if strings.HasPrefix(err.Error(), "yaml: ") {
		return err
	}
	return fmt.Errorf("yaml: %w", err)
}

// parseYAML returns the root node of the only document, nil for an empty
// file.
func parseYAML(data []byte) (root *yaml.Node, err error) {
	// yaml.v3 recovers its own panics; this guard is for the ones it has
	// not been taught about yet, so that bad input is an error, never a
	// crash of the caller. It covers only the parser: a panic of the
	// walker below is a bug that tests must see.
	defer func() {
		if r := recover(); r != nil {
			root, err = nil, fmt.Errorf("yaml: parser failed: %v", r)
		}
	}()
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, nil // empty file: defaults and environment only
		}
		return nil, yamlError(err)
	}
	var extra yaml.Node
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		if err != nil {
			return nil, yamlError(err)
		}
		return nil, fmt.Errorf("yaml: line %d: a second document; the configuration is one document", extra.Line)
	}
	root = &doc
	if root.Kind == yaml.DocumentNode {
		if len(root.Content) == 0 {
			return nil, nil
		}
		root = root.Content[0]
	}
	return root, nil
}

type decoder struct {
	errs []error
	set  map[string]bool // key paths of the single values set
	null map[string]bool // key paths found with a null value
	// budget bounds the nodes visited: aliases and merge keys can make a
	// small document expand exponentially ("billion laughs"), and a merge
	// key can name its own mapping.
	budget    int
	depth     int
	exhausted bool
}

const maxDepth = 64

// over reports whether the walk must stop, recording the reason once.
func (d *decoder) over(n *yaml.Node, path string) bool {
	if d.exhausted {
		return true
	}
	d.budget--
	if d.budget >= 0 && d.depth <= maxDepth {
		return false
	}
	d.exhausted = true
	d.fail(n, path, "document expands too far through aliases or merge keys")
	return true
}

func (d *decoder) fail(n *yaml.Node, path, format string, args ...any) {
	if path == "" {
		path = "(top level)"
	}
	d.errs = append(d.errs, fmt.Errorf("line %d: %s: %s", n.Line, path, fmt.Sprintf(format, args...)))
}

func isNull(n *yaml.Node) bool {
	return n.Kind == yaml.ScalarNode && n.Tag == "!!null"
}

// value decodes n into v. A null leaves v as it was (a default stays, a
// block stays disabled); aliases are followed.
func (d *decoder) value(n *yaml.Node, v reflect.Value, path string) {
	for depth := 0; n.Kind == yaml.AliasNode; depth++ {
		if n.Alias == nil || depth > 16 {
			d.fail(n, path, "unresolvable alias")
			return
		}
		n = n.Alias
	}
	if isNull(n) && path == "targets.allow" {
		// A bare "allow:" reads as an empty list, not as "omitted": the
		// default "*" would open every target to a publisher where the
		// operator meant to list none.
		v.Set(reflect.MakeSlice(v.Type(), 0, 0))
		return
	}
	if isNull(n) {
		d.null[path] = true
		return
	}
	if d.over(n, path) {
		return
	}
	d.depth++
	defer func() { d.depth-- }()
	switch {
	case v.Kind() == reflect.Pointer:
		if v.IsNil() {
			v.Set(reflect.New(v.Type().Elem()))
		}
		d.value(n, v.Elem(), path)
	case v.Kind() == reflect.Struct:
		d.mapping(n, v, path)
	case v.Kind() == reflect.Slice:
		d.sequence(n, v, path)
	default:
		if n.Kind != yaml.ScalarNode {
			d.fail(n, path, "want a single value, got %s", kindName(n))
			return
		}
		if err := setScalar(v, n.Value); err != nil {
			d.fail(n, path, "%v", err)
			return
		}
		d.set[path] = true
	}
}

func kindName(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	case yaml.ScalarNode:
		return fmt.Sprintf("the value %q", n.Value)
	}
	return "a YAML node of another kind"
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

func (d *decoder) mapping(n *yaml.Node, v reflect.Value, path string) {
	if n.Kind != yaml.MappingNode {
		d.fail(n, path, "want a mapping of keys, got %s", kindName(n))
		return
	}
	t := v.Type()
	seen := map[string]bool{}
	// Merge keys (<<: *base) apply first so that explicit keys win, as in
	// YAML 1.1.
	var merges, plain [][2]*yaml.Node
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, val := n.Content[i], n.Content[i+1]
		if k.Kind == yaml.ScalarNode && k.Tag == "!!merge" {
			merges = append(merges, [2]*yaml.Node{k, val})
		} else {
			plain = append(plain, [2]*yaml.Node{k, val})
		}
	}
	for _, m := range merges {
		src := m[1]
		for depth := 0; src.Kind == yaml.AliasNode && src.Alias != nil && depth <= 16; depth++ {
			src = src.Alias
		}
		switch src.Kind {
		case yaml.MappingNode:
			d.value(src, v, path)
		case yaml.SequenceNode:
			// The mappings earlier in the sequence win (YAML 1.1's
			// merge key, as yaml.v3 decodes it): the last is applied
			// first, each earlier one over it.
			for i := len(src.Content) - 1; i >= 0; i-- {
				d.value(src.Content[i], v, path)
			}
		default:
			d.fail(m[0], path, "merge key needs a mapping")
		}
	}
	for _, kv := range plain {
		k, val := kv[0], kv[1]
		if k.Kind != yaml.ScalarNode {
			d.fail(k, path, "keys must be plain names")
			continue
		}
		key := k.Value
		fp := join(path, key)
		if seen[key] {
			d.fail(k, fp, "duplicate key")
			continue
		}
		seen[key] = true
		idx := fieldIndex(t, key)
		if idx < 0 {
			d.fail(k, fp, "unknown key")
			continue
		}
		if fp == "targets" {
			// A "targets:" block without an allow key (its list
			// commented out, "targets: {}", "targets: ~") denies every
			// target, as a bare "allow:" does (value): only a file
			// without the block gets the default "*". An allow in the
			// block (or DELAYBRIDGE_TARGETS_ALLOW) replaces the empty
			// list. Here, not in value: a merge key under targets
			// ("<<: [*a, *b]") decodes each of its mappings onto the
			// block, and one without allow must not empty the other's.
			tv := v.Field(idx)
			allow := tv.Field(fieldIndex(tv.Type(), "allow"))
			allow.Set(reflect.MakeSlice(allow.Type(), 0, 0))
		}
		d.value(val, v.Field(idx), fp)
	}
}

func fieldIndex(t reflect.Type, key string) int {
	for i := range t.NumField() {
		if yamlName(t.Field(i)) == key {
			return i
		}
	}
	return -1
}

// sequence replaces the list in v with the items of n.
func (d *decoder) sequence(n *yaml.Node, v reflect.Value, path string) {
	if n.Kind != yaml.SequenceNode {
		hint := ""
		if n.Kind == yaml.ScalarNode && v.Type().Elem().Kind() == reflect.String {
			// brokers: localhost:9092, or the environment's form
			// copied into the file.
			items := []string{n.Value}
			if strings.Contains(n.Value, ",") {
				items = splitList(n.Value)
			}
			for i, it := range items {
				items[i] = strconv.Quote(strings.TrimSpace(it))
			}
			hint = "; write it as a list: [" + strings.Join(items, ", ") + "]"
			if len(items) > 1 {
				hint += " (one comma-separated value is the form of a DELAYBRIDGE_ variable)"
			}
		}
		d.fail(n, path, "want a list, got %s%s", kindName(n), hint)
		return
	}
	if len(n.Content) > maxListLen {
		d.fail(n, path, "more than %d items", maxListLen)
		return
	}
	s := reflect.MakeSlice(v.Type(), len(n.Content), len(n.Content))
	for i, item := range n.Content {
		d.value(item, s.Index(i), fmt.Sprintf("%s[%d]", path, i))
	}
	v.Set(s)
}

// setScalar parses text into v by v's type. It is the one place a value is
// interpreted, for YAML and environment alike.
func setScalar(v reflect.Value, text string) error {
	switch v.Type() {
	case durationType:
		d, err := ParseDuration(text)
		if err != nil {
			return err
		}
		v.SetInt(int64(d))
		return nil
	case secretType:
		v.SetString(text)
		return nil
	}
	switch v.Kind() {
	case reflect.String:
		v.SetString(text)
	case reflect.Bool:
		b, err := strconv.ParseBool(strings.TrimSpace(text))
		if err != nil {
			return fmt.Errorf("invalid boolean %q: want true or false", text)
		}
		v.SetBool(b)
	case reflect.Int:
		i, err := strconv.ParseInt(strings.TrimSpace(text), 10, 0)
		if err != nil {
			return fmt.Errorf("invalid integer %q", text)
		}
		v.SetInt(i)
	case reflect.Float64:
		f, err := strconv.ParseFloat(strings.TrimSpace(text), 64)
		if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
			return fmt.Errorf("invalid number %q", text)
		}
		v.SetFloat(f)
	case reflect.Slice:
		if v.Type().Elem().Kind() != reflect.String {
			return errors.New("a list of blocks cannot be set from one value; set its items by index")
		}
		// Lists in one value (environment) are comma-separated; blanks
		// are dropped so "a, b," is [a b] and "" is the empty list.
		var items []string
		for _, p := range splitList(text) {
			if p = strings.TrimSpace(p); p != "" {
				items = append(items, p)
			}
		}
		if len(items) > maxListLen {
			return fmt.Errorf("more than %d items", maxListLen)
		}
		if items == nil {
			items = []string{}
		}
		v.Set(reflect.ValueOf(items).Convert(v.Type()))
	default:
		return fmt.Errorf("cannot be set from a single value")
	}
	return nil
}

// splitList splits a list given in one value (an environment variable) at
// its commas. A backslash escapes the character after it: a comma after a
// backslash belongs to the item, and the backslash is kept, since a NATS
// subject may contain a comma and in a targets.allow pattern "\," matches
// it as "\x" matches x (DELAYBRIDGE_TARGETS_ALLOW=nats:a\,b,orders.* is
// [nats:a\,b orders.*]). "\\," is an escaped backslash, then the comma
// that ends the item.
func splitList(text string) []string {
	var items []string
	start := 0
	for i := 0; i < len(text); i++ {
		switch text[i] {
		case '\\':
			i++
		case ',':
			items = append(items, text[start:i])
			start = i + 1
		}
	}
	return append(items, text[start:])
}
