package deploy

import (
	"go/ast"
	"go/parser"
	"go/token"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/delaybridge/delaybridge/config"
)

// TestDockerfile pins what the image promises and what the chart relies on.
// No container engine runs in CI here, so the Dockerfile is checked as text:
// the Go version matches go.mod, the binary is static and stripped, the
// final stage runs as 65532 with the data volume and the admin port, and the
// -X main.version flag names a variable that exists.
func TestDockerfile(t *testing.T) {
	raw, err := os.ReadFile("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	df := string(raw)

	gomod, err := os.ReadFile("../go.mod")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindStringSubmatch(string(gomod))
	if m == nil {
		t.Fatal("no go directive in go.mod")
	}
	if want := "ARG GO_VERSION=" + m[1]; !strings.Contains(df, want) {
		t.Errorf("Dockerfile builder does not use go.mod's Go %s (want %q)", m[1], want)
	}
	for _, want := range []string{
		"FROM --platform=$BUILDPLATFORM golang:${GO_VERSION} AS build",
		"CGO_ENABLED=0",
		"go build -trimpath -ldflags \"-s -w -X main.version=${VERSION}\"",
		"./cmd/delaybridge",
		"FROM gcr.io/distroless/static-debian12:nonroot",
		"USER 65532:65532",
		"EXPOSE 8080",
		"VOLUME /var/lib/delaybridge",
		`ENTRYPOINT ["/delaybridge"]`,
		`CMD ["run", "--config", "/etc/delaybridge/config.yaml"]`,
	} {
		if !strings.Contains(df, want) {
			t.Errorf("Dockerfile lacks %q", want)
		}
	}
	// The last FROM is the runtime image: nothing after it may switch back
	// to root.
	last := df[strings.LastIndex(df, "\nFROM "):]
	if regexp.MustCompile(`(?m)^USER\s+(0|root)\b`).MatchString(last) {
		t.Error("final stage runs as root")
	}

	if _, err := os.Stat("Dockerfile.dockerignore"); err != nil {
		t.Errorf("build-context filter: %v", err)
	}

	// main.version must exist for -X to have an effect (the linker ignores
	// an unknown symbol silently).
	files, _ := filepath.Glob("../cmd/delaybridge/*.go")
	if len(files) == 0 {
		t.Skip("cmd/delaybridge has no Go files yet; cannot check main.version")
	}
	found := false
	fset := token.NewFileSet()
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		af, err := parser.ParseFile(fset, f, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range af.Decls {
			gd, ok := d.(*ast.GenDecl)
			if !ok || gd.Tok != token.VAR {
				continue
			}
			for _, s := range gd.Specs {
				for _, n := range s.(*ast.ValueSpec).Names {
					if n.Name == "version" && af.Name.Name == "main" {
						found = true
					}
				}
			}
		}
	}
	if !found {
		t.Error("package main in cmd/delaybridge has no package-level var version for -X main.version")
	}
}

// TestAdminListenSuggestion checks the admin.listen the Dockerfile and the
// README suggest for reaching the admin server from outside a plain
// container: an address the config accepts (with a token), on the port the
// image exposes, and on every interface, IPv6 included. An empty host is
// dual-stack; 0.0.0.0 is IPv4 only and unreachable on an IPv6-only network.
func TestAdminListenSuggestion(t *testing.T) {
	suggestion := regexp.MustCompile(`admin\.listen(?: to|:)\s*(?:#\s*)?"([^"]*)"`)
	for _, f := range []string{"Dockerfile", "README.md"} {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		text := string(raw)
		if strings.Contains(text, "0.0.0.0") {
			t.Errorf("%s suggests 0.0.0.0, IPv4 only: suggest \":8080\" (every interface, dual-stack)", f)
		}
		found := suggestion.FindAllStringSubmatch(text, -1)
		if len(found) == 0 {
			t.Errorf("%s suggests no admin.listen for a container (want admin.listen ... \":8080\")", f)
		}
		for _, m := range found {
			addr := m[1]
			if err := config.CheckListen(addr, "token", false); err != nil {
				t.Errorf("%s suggests admin.listen %q, which the config refuses: %v", f, addr, err)
				continue
			}
			host, port, err := net.SplitHostPort(addr)
			if err != nil || host != "" || port != "8080" {
				t.Errorf("%s suggests admin.listen %q, want \":8080\" (every interface, the exposed port)", f, addr)
			}
		}
	}
}

// TestKcatCancelExamples: kcat sends no message for an empty input line,
// so a cancel example must pipe a body (tried by hand: `echo ” | kcat
// ... -H delay-cancel=true` cancelled nothing); the README also shows the
// tombstone form, whose empty value -Z sends as null.
func TestKcatCancelExamples(t *testing.T) {
	for _, tc := range []struct {
		file string
		want []string
	}{
		{"../README.md", []string{"echo cancel | kcat -P", "-H delay-cancel=true", "echo 'order-42:' | kcat -P -Z -K:"}},
		{"helm/delaybridge/templates/NOTES.txt", []string{"echo cancel | kcat -P", "-H delay-cancel=true"}},
	} {
		raw, err := os.ReadFile(tc.file)
		if err != nil {
			t.Fatal(err)
		}
		text := string(raw)
		if strings.Contains(text, "echo '' |") {
			t.Errorf("%s pipes an empty line to kcat, which sends nothing", tc.file)
		}
		for _, w := range tc.want {
			if !strings.Contains(text, w) {
				t.Errorf("%s lacks the cancel example %q", tc.file, w)
			}
		}
	}
}
