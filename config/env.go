package config

import (
	"errors"
	"fmt"
	"reflect"
	"sort"
	"strconv"
	"strings"
)

// EnvPrefix starts every environment override.
const EnvPrefix = "DELAYBRIDGE_"

// envStep is one step of a resolved environment name: a struct field, or an
// index into a list of blocks.
type envStep struct {
	field int // struct field index; -1 for a list index
	index int
	key   string // YAML key or "[i]", for messages
}

// applyEnv sets the keys named by DELAYBRIDGE_* variables and returns the
// variable that set each key path ("retry.max_attempts" ->
// "DELAYBRIDGE_RETRY_MAX_ATTEMPTS"), so that a later error about the key
// can name where its value came from. A variable set twice in environ takes
// its first value, as os.Getenv does. Variables are applied in name order
// so the result does not depend on environ's order.
func applyEnv(c *Config, environ []string) (map[string]string, error) {
	vals := map[string]string{}
	var names []string
	for _, kv := range environ {
		name, val, ok := strings.Cut(kv, "=")
		if !ok || !strings.HasPrefix(name, EnvPrefix) {
			continue
		}
		if _, dup := vals[name]; dup {
			continue
		}
		vals[name] = val
		names = append(names, name)
	}
	sort.Strings(names)
	var errs []error
	set := map[string]string{}
	root := reflect.ValueOf(c).Elem()
	for _, name := range names {
		steps, ok := resolveEnv(root.Type(), strings.TrimPrefix(name, EnvPrefix))
		if !ok {
			errs = append(errs, fmt.Errorf("env %s: names no configuration key%s", name, envListHint(root.Type(), strings.TrimPrefix(name, EnvPrefix))))
			continue
		}
		added, err := setPath(root, steps, vals[name])
		if err != nil {
			errs = append(errs, fmt.Errorf("env %s (%s): %w", name, stepsPath(steps), err))
			continue
		}
		set[stepsPath(steps)] = name
		for _, item := range added {
			set[item] = name // an error about a key of it names the variable
		}
	}
	return set, errors.Join(errs...)
}

// envListHint explains a name that indexes a list of names the way lists
// of blocks are indexed (DELAYBRIDGE_KAFKA_BROKERS_0): such a list is one
// comma-separated variable. It is "" for any other name.
func envListHint(t reflect.Type, name string) string {
	i := strings.LastIndexByte(name, '_')
	if i < 0 || strings.Trim(name[i+1:], "0123456789") != "" || i+1 == len(name) {
		return ""
	}
	steps, ok := resolveEnv(t, name[:i])
	if !ok {
		return ""
	}
	for _, s := range steps {
		if s.field >= 0 {
			t = t.Field(s.field).Type
		} else {
			t = t.Elem()
		}
		for t.Kind() == reflect.Pointer {
			t = t.Elem()
		}
	}
	if t.Kind() != reflect.Slice {
		return ""
	}
	return fmt.Sprintf("; %s is a list of names: set it in one variable, comma-separated (%s%s=a,b)", stepsPath(steps), EnvPrefix, name[:i])
}

// EnvName returns the environment variable for a key path such as
// "kafka.sasl.password" or "kafka.sources[0].topic".
func EnvName(path string) string {
	r := strings.NewReplacer(".", "_", "[", "_", "]", "")
	return EnvPrefix + strings.ToUpper(r.Replace(path))
}

func stepsPath(steps []envStep) string {
	var b strings.Builder
	for _, s := range steps {
		if s.field < 0 {
			b.WriteString(s.key)
			continue
		}
		if b.Len() > 0 {
			b.WriteByte('.')
		}
		b.WriteString(s.key)
	}
	return b.String()
}

// resolveEnv maps an upper-case name (without the prefix) to a leaf key of
// t. Keys contain underscores themselves (DATA_DIR, ALLOW_INSECURE_LISTEN),
// so at each level the candidate keys are tried longest first and a choice
// that leaves an unresolvable rest is backtracked. The first full match in
// that order wins, which makes any (hypothetical) ambiguity deterministic:
// the longer key at the shallower level. TestEnvNamesRoundTrip checks that
// every key of the schema resolves to itself.
func resolveEnv(t reflect.Type, name string) ([]envStep, bool) {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.Struct:
		type cand struct {
			i   int
			key string
		}
		var cands []cand
		for i := range t.NumField() {
			if k := yamlName(t.Field(i)); k != "" {
				cands = append(cands, cand{i, k})
			}
		}
		sort.SliceStable(cands, func(a, b int) bool { return len(cands[a].key) > len(cands[b].key) })
		for _, cd := range cands {
			up := strings.ToUpper(cd.key)
			ft := t.Field(cd.i).Type
			if name == up {
				if isLeaf(ft) {
					return []envStep{{field: cd.i, key: cd.key}}, true
				}
				continue
			}
			if rest, ok := strings.CutPrefix(name, up+"_"); ok {
				if sub, ok := resolveEnv(ft, rest); ok {
					return append([]envStep{{field: cd.i, key: cd.key}}, sub...), true
				}
			}
		}
	case reflect.Slice:
		if t.Elem().Kind() != reflect.Struct {
			return nil, false
		}
		num, rest, ok := strings.Cut(name, "_")
		if !ok {
			return nil, false
		}
		i, err := strconv.Atoi(num)
		// One spelling per index: no sign, no leading zeros.
		if err != nil || i < 0 || strconv.Itoa(i) != num {
			return nil, false
		}
		if sub, ok := resolveEnv(t.Elem(), rest); ok {
			return append([]envStep{{field: -1, index: i, key: "[" + num + "]"}}, sub...), true
		}
	}
	return nil, false
}

// isLeaf reports whether a field of type t is set by one value.
func isLeaf(t reflect.Type) bool {
	switch t.Kind() {
	case reflect.Struct, reflect.Pointer:
		return false
	case reflect.Slice:
		return t.Elem().Kind() == reflect.String
	}
	return true
}

// setPath walks v along steps, enabling omitted blocks and growing lists of
// blocks as needed, and sets the leaf from text. It returns the paths of
// the list items it added ("kafka.sources[2]"; those below the index too,
// if the list had fewer).
func setPath(v reflect.Value, steps []envStep, text string) (added []string, err error) {
	for k, s := range steps {
		for v.Kind() == reflect.Pointer {
			if v.IsNil() {
				v.Set(reflect.New(v.Type().Elem()))
			}
			v = v.Elem()
		}
		if s.field >= 0 {
			v = v.Field(s.field)
			continue
		}
		if s.index >= maxListLen {
			return nil, fmt.Errorf("index %d: lists hold at most %d items", s.index, maxListLen)
		}
		if s.index >= v.Len() {
			list := stepsPath(steps[:k])
			for i := v.Len(); i <= s.index; i++ {
				added = append(added, fmt.Sprintf("%s[%d]", list, i))
			}
			grown := reflect.MakeSlice(v.Type(), s.index+1, s.index+1)
			reflect.Copy(grown, v)
			v.Set(grown)
		}
		v = v.Index(s.index)
	}
	return added, setScalar(v, text)
}
