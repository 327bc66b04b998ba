// Package admin serves delaybridge's operator HTTP API (CONTRACT §7):
// liveness and readiness probes, Prometheus metrics, task lookup, cancel
// and engine statistics, and (extensions of the contract) the listing of
// a source's pending tasks and the stuck entries of the store with a way
// to drop one. Handlers are thin: each
// calls one typed method of the engine and only encodes its result, so the
// same data is available to Go callers and tests without HTTP.
//
// Routes:
//
//	GET    /healthz                  200 "ok" while the process can make progress (liveness)
//	GET    /readyz                   200 "ok" when Options.Ready returns nil, else 503 and the reason
//	                                 (the reason only with the token, when one is configured)
//	GET    /metrics                  Prometheus exposition of Options.Gatherer
//	GET    /v1/tasks/{source}?prefix=P&after=ID&limit=N
//	                                 JSON {"tasks": [shard.TaskInfo...], "next": ID}: a page of the
//	                                 source's pending tasks (see listTasks)
//	GET    /v1/tasks/{source}/{id}   JSON shard.TaskInfo; 404 if no task is pending
//	DELETE /v1/tasks/{source}/{id}   204 after cancelling; 404 if no task is pending
//	GET    /v1/stats                 JSON shard.Stats
//	GET    /v1/stuck?limit=N         JSON shard.StuckList: held and parked dead letters, undecodable entries
//	DELETE /v1/stuck/{shard}/{seq}   204 after dropping that entry for good; 404 if it is not listed
//	GET    /v1/firing                JSON shard.FiringState: whether firing is paused, and why
//	POST   /v1/firing/pause          JSON shard.FiringState after pausing firing (body: nothing, or
//	                                 {"reason": "..."}); kept in the store until resumed
//	POST   /v1/firing/resume         JSON shard.FiringState after ending the operator's pause
//	GET    /debug/pprof/...          Go runtime profiles, only with Options.Pprof
//
// {source} is the delay topic (Kafka) or stream (NATS) the task came from.
// {id} is the task id; ids containing "/" may be sent escaped ("a%2Fb") or
// raw ("a/b"): everything after the source segment is the id. Ids with
// empty, "." or ".." segments ("a//b", "a/../b") must be escaped; sent raw
// they are refused with 400 rather than redirected to another id.
//
// GET /v1/tasks/{source} lists the pending tasks of {source} whose id
// starts with prefix, in id (byte) order, after the id after (excluded),
// at most limit (1..1000, default 100; anything else is 400), as
// shard.Engine.ListTasks reads them: each page is a point-in-time view of
// the store, cancel markers left out. next, present when there may be
// more, is the after of the next page. The query is form-encoded ("+" is
// a space: send "%2B"); an unknown, repeated or badly escaped parameter
// is 400 naming it. Ids that are not valid UTF-8 (Kafka keys are bytes)
// cannot be JSON strings: their "id" (and "next") carry U+FFFD for the
// bad bytes, so the task (and the page) also carries "id_escaped"
// ("next_escaped"), every byte but [A-Za-z0-9-._~] percent-encoded, to
// use as is in a path or query.
//
// /v1/stuck lists what will not leave the store by itself (see
// shard.StuckState): dead letters whose DLQ fails (held: their source
// partition waits) or refuses them (parked), and entries whose envelope
// does not decode, which may be ordinary tasks. They are not all dead
// letters and have no usable (source, id) (dead letters have no id index
// entry; an undecodable envelope cannot say its id), so the route is
// /v1/stuck and an entry is named by its place in the store, {shard} and
// {seq} as listed. limit is 1..1000 (default 100; larger is cut to
// 1000); "total" counts them all. Dropping is an operator's decision to
// lose that message: a held dead letter's source then commits past it.
//
// POST /v1/firing/pause is an operator's pause of firing (see
// shard.Engine.PauseFiringByOperator): no task begins its delivery until
// POST /v1/firing/resume, across restarts too, since the pause is kept
// in the store; dead letters a source waits for still go to their DLQ.
// It answers once the pause is durable. Its body is empty or a JSON
// object with an optional "reason" (at most shard.MaxPauseReason bytes
// of text), kept and shown with the pause; a pause asked for again keeps
// its start and takes a new reason. The batches the fire loops had taken
// before the pause still go out: "in_flight" counts what is taken and not
// settled, 0 once nothing more reaches a target. "catching_up" is the pause at start
// while the sources read their backlog; firing resumes when neither
// holds it. The pause is the process's (its store's): with several
// bridges, pause each.
//
// When Options.Token is set, /metrics, /v1/* and /debug/pprof/* require
// "Authorization: Bearer <token>"; the probes stay open for the kubelet.
// Options.MetricsToken, set too, is good for /metrics only (a scraper's);
// elsewhere it is 403. A request other than GET that a browser marks as
// cross-origin (Sec-Fetch-Site, or an Origin other than the Host) is 403
// (http.CrossOriginProtection): without a token, a web page could
// otherwise POST /v1/firing/pause. Without a token, such a browser
// request (Origin or Sec-Fetch-Site set) is also 403 unless its Host is
// an IP address or localhost: a page that rebinds its own name to the
// loopback (DNS rebinding) is the same origin to the browser. Clients
// without those headers (curl) are not affected.
// Errors are JSON objects {"error": "..."}; a wrong method is 405 with Allow.
package admin

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/pprof"
	"net/netip"
	"net/url"
	"path"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/config"
	"github.com/delaybridge/delaybridge/internal/logthrottle"
	"github.com/delaybridge/delaybridge/shard"
)

// Engine is what the API reads and changes; *shard.Engine implements it.
type Engine interface {
	// Lookup returns the pending task (source, id), or shard.ErrNotFound.
	Lookup(source, id string) (shard.TaskInfo, error)
	// ListTasks returns a page of source's pending tasks.
	ListTasks(source string, q shard.ListQuery) (shard.TaskList, error)
	// Cancel removes the pending task (source, id), or returns
	// shard.ErrNotFound.
	Cancel(source, id string) error
	Stats() shard.Stats
	// StuckEntries lists the stuck entries, at most limit.
	StuckEntries(limit int) (shard.StuckList, error)
	// DropStuck removes a listed stuck entry for good, or returns
	// shard.ErrNotFound.
	DropStuck(shard int, seq uint64) error
	// Firing reports whether firing is paused, and why.
	Firing() shard.FiringState
	// PauseFiringByOperator pauses firing, kept in the store, until
	// ResumeFiringByOperator; shard.ErrPauseReason for a reason it does
	// not keep.
	PauseFiringByOperator(reason string) (shard.FiringState, error)
	// ResumeFiringByOperator ends an operator's pause and returns it (nil
	// if there was none).
	ResumeFiringByOperator() (shard.FiringState, *shard.OperatorPause, error)
}

// Options configure the handler.
type Options struct {
	// Engine serves /v1/*. Nil: those routes answer 503.
	Engine Engine
	// Ready reports readiness for /readyz: nil means ready, an error is
	// the reason shown to the probe. Nil func: always ready.
	Ready func() error
	// Live reports liveness for /healthz: an error means the process
	// cannot make progress without a restart (e.g. the store refuses
	// writes after a failed fsync), so the supervisor should restart it.
	// Nil func: always live.
	Live func() error
	// Gatherer is exposed on /metrics. Nil: prometheus.DefaultGatherer.
	Gatherer prometheus.Gatherer
	// Token, when set, is the bearer token /metrics, /v1/* and
	// /debug/pprof/* require.
	Token string
	// MetricsToken, when set with Token, is a second bearer token that
	// GET /metrics takes, and nothing else.
	MetricsToken string
	// TokenFunc and MetricsTokenFunc, when set with Token (MetricsToken),
	// win over it: they are asked at each request, so a token rotated in a
	// file (config.SecretFunc) is the one taken from then on. Whether
	// requests need a token at all, and whether there is a metrics token,
	// is decided by Token and MetricsToken.
	TokenFunc        func() string
	MetricsTokenFunc func() string
	// Pprof serves net/http/pprof under /debug/pprof/.
	Pprof bool
	// Sources are the delay sources of the running config: the Kafka
	// delay topics and the NATS stream, as {source} names them. A 404 for
	// a task of another source says so and lists these (a NATS task is
	// looked up by its stream, and a user who gives the subject should
	// learn that rather than that the task is not pending). Lookups are
	// not limited to them: a source taken out of the config keeps its
	// pending tasks. Empty: no hint.
	Sources []string
	// Logger; nil: no logging.
	Logger *zap.Logger
}

// NewHandler returns the admin API handler.
func NewHandler(o Options) http.Handler {
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	if o.Gatherer == nil {
		o.Gatherer = prometheus.DefaultGatherer
	}
	s := &server{o: o, log: o.Logger}
	fixed := func(v string) func() string { return func() string { return v } }
	if o.Token != "" {
		s.adminToken, s.metricsToken = o.TokenFunc, o.MetricsTokenFunc
		if s.adminToken == nil {
			s.adminToken = fixed(o.Token)
		}
		if s.metricsToken == nil || o.MetricsToken == "" {
			s.metricsToken = fixed(o.MetricsToken)
		}
	}

	mux := http.NewServeMux()
	// A browser's cross-origin request that changes state is refused
	// (403): POST /v1/firing/pause and /resume are "simple" requests a
	// web page can send without a preflight, and without a token (the
	// default on 127.0.0.1) any page the operator opens could pause every
	// delivery. Clients that send neither Origin nor Sec-Fetch-Site
	// (curl, scripts) are not affected.
	csrf := http.NewCrossOriginProtection()
	csrf.SetDenyHandler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusForbidden, "cross-origin request from a browser refused")
	}))
	// auth: none (the probes), the admin token, or either token
	// (/metrics).
	route := func(path string, auth access, methods map[string]http.HandlerFunc) {
		allow := make([]string, 0, len(methods))
		for m, h := range methods {
			var hh http.Handler = h
			if m != http.MethodGet {
				hh = csrf.Handler(hh)
				if s.adminToken == nil {
					hh = rebindingGuard(hh)
				}
			}
			if auth != open {
				hh = s.authorizeFor(auth, hh)
			}
			mux.Handle(m+" "+path, hh)
			allow = append(allow, m)
		}
		if _, ok := methods[http.MethodGet]; ok {
			allow = append(allow, http.MethodHead) // GET patterns serve HEAD too
		}
		slices.Sort(allow)
		// The pattern without a method catches every other method, so
		// the 405 is JSON like every other error.
		var notAllowed http.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Allow", strings.Join(allow, ", "))
			writeError(w, http.StatusMethodNotAllowed, fmt.Sprintf("method %s not allowed; use %s", r.Method, strings.Join(allow, ", ")))
		})
		if auth != open {
			notAllowed = s.authorizeFor(auth, notAllowed)
		}
		mux.Handle(path, notAllowed)
	}
	route("/healthz", open, map[string]http.HandlerFunc{http.MethodGet: s.healthz})
	route("/readyz", open, map[string]http.HandlerFunc{http.MethodGet: s.readyz})
	metricsH := promhttp.HandlerFor(o.Gatherer, promhttp.HandlerOpts{
		ErrorLog:      zap.NewStdLog(o.Logger.Named("metrics")),
		ErrorHandling: promhttp.ContinueOnError,
	})
	route("/metrics", metricsAccess, map[string]http.HandlerFunc{http.MethodGet: metricsH.ServeHTTP})
	// "/v1/tasks/x" has a pattern of its own, so the mux does not answer
	// it with a redirect to "/v1/tasks/x/" (where the {id...} pattern
	// matches an empty id).
	route("/v1/tasks/{source}", adminAccess, map[string]http.HandlerFunc{http.MethodGet: s.listTasks})
	route("/v1/tasks/{source}/{id...}", adminAccess, map[string]http.HandlerFunc{
		http.MethodGet:    s.getTask,
		http.MethodDelete: s.deleteTask,
	})
	route("/v1/stats", adminAccess, map[string]http.HandlerFunc{http.MethodGet: s.stats})
	route("/v1/stuck", adminAccess, map[string]http.HandlerFunc{http.MethodGet: s.listStuck})
	route("/v1/stuck/{shard}/{seq}", adminAccess, map[string]http.HandlerFunc{http.MethodDelete: s.dropStuck})
	route("/v1/firing", adminAccess, map[string]http.HandlerFunc{http.MethodGet: s.firing})
	route("/v1/firing/pause", adminAccess, map[string]http.HandlerFunc{http.MethodPost: s.pauseFiring})
	route("/v1/firing/resume", adminAccess, map[string]http.HandlerFunc{http.MethodPost: s.resumeFiring})
	if o.Pprof {
		// Index also serves the named profiles (heap, goroutine, ...).
		// One route for the subtree, so another method is 405 with
		// Allow, not the catch-all's 404 (R225): method-less patterns per
		// profile would conflict with "GET /debug/pprof/".
		special := map[string]http.HandlerFunc{
			"cmdline": pprof.Cmdline, "profile": pprof.Profile, "symbol": pprof.Symbol, "trace": pprof.Trace,
		}
		route("/debug/pprof/", adminAccess, map[string]http.HandlerFunc{http.MethodGet: func(w http.ResponseWriter, r *http.Request) {
			if h, ok := special[strings.TrimPrefix(r.URL.Path, "/debug/pprof/")]; ok {
				h(w, r)
				return
			}
			pprof.Index(w, r)
		}})
	}
	mux.Handle("/", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "no such endpoint: "+r.URL.Path)
	}))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// The mux redirects a path with an empty, "." or ".." segment to
		// its cleaned form; for a task that is another id ("a//b" becomes
		// "a/b"), and a client that follows the redirect of a DELETE
		// cancels the wrong task. The segment may be anywhere
		// ("/v1//tasks/src/a//b" too), so no unclean path is redirected.
		if p := r.URL.EscapedPath(); !cleanPath(p) {
			writeError(w, http.StatusBadRequest, "the path has an empty, \".\" or \"..\" segment; in a task id, percent-encode \"/\" as %2F (and \".\" as %2E)")
			return
		}
		mux.ServeHTTP(w, r)
	})
}

// cleanPath reports whether the mux would serve p as it is: no empty,
// "." or ".." segment (a trailing "/" is kept).
func cleanPath(p string) bool {
	c := path.Clean(p)
	if strings.HasSuffix(p, "/") && c != "/" {
		c += "/"
	}
	return c == p
}

type server struct {
	o   Options
	log *zap.Logger
	// adminToken gives the admin token of the moment; nil: no token
	// required. metricsToken: the one good for /metrics only ("" none).
	adminToken, metricsToken func() string
	tokensEqual              atomic.Bool // the two were last seen equal (see checkTokensDiffer)

	probeMu   sync.Mutex
	lastProbe map[string]string // per probe, the reason last logged, digits as # ("" when passing)

	// refused throttles the line about a request refused for its token,
	// per kind of refusal and client host: none was logged (hunt H204:
	// 1.18 million bad requests in 45 s, no line), so a scraper with a
	// stale token or a client guessing tokens left no trace. Per host
	// too, or a second client was held back behind the first one's line
	// (review R200); the throttle bounds the hosts it remembers (64, then
	// one overflow line per 30 s for the others). The lines held back
	// for hosts it forgot before their next line are counted in the next
	// line's held_back_forgotten (review R210). now: nil is time.Now
	// (tests set it).
	refused logthrottle.Throttle
	now     func() time.Time
}

// logRefused logs a request refused for its token (reason), once per
// logthrottle.DefaultEvery per reason and client host with the count held
// back (held_back, and held_back_forgotten for hosts forgotten since).
func (s *server) logRefused(r *http.Request, reason string) {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		host = r.RemoteAddr
	}
	now := time.Now
	if s.now != nil {
		now = s.now
	}
	held, forgotten, ok := s.refused.AllowEachForgotten(now(), reason+"\x00"+host)
	if !ok {
		return
	}
	// The method cut too: any reaches the token check (a route's 405 is
	// behind it), up to the 64 KiB of a request line (review R200).
	f := []zap.Field{zap.String("reason", reason), zap.String("remote", r.RemoteAddr),
		zap.String("method", shard.LogCut(r.Method, 32)), zap.String("path", shard.LogCut(r.URL.EscapedPath(), 256)),
		zap.Int("held_back", held), logthrottle.Forgotten(forgotten)}
	s.log.Warn("admin: request refused", f...)
}

// logProbe logs a probe's reason when it changed since the last call
// (reason "" when the probe passes), so the log has what an open probe
// does not say, once per change rather than once per kubelet poll. Numbers
// do not count as a change: "writes held for 12s" is the reason of
// "writes held for 5s", a second later or two.
func (s *server) logProbe(probe, reason string) {
	s.probeMu.Lock()
	defer s.probeMu.Unlock()
	if s.lastProbe == nil {
		s.lastProbe = make(map[string]string)
	}
	shape := strings.Map(func(r rune) rune {
		if r >= '0' && r <= '9' {
			return '#'
		}
		return r
	}, reason)
	if shape == s.lastProbe[probe] {
		return
	}
	s.lastProbe[probe] = shape
	if reason == "" {
		s.log.Info("probe passes again", zap.String("probe", probe))
		return
	}
	s.log.Warn("probe fails", zap.String("probe", probe), zap.String("reason", reason))
}

// rebindingGuard refuses (403) a browser's request (one with an Origin or
// Sec-Fetch-Site header) whose Host is not an IP address or localhost:
// a page of another site that rebinds its own name to 127.0.0.1 (DNS
// rebinding) sends that name as Host and Origin alike, the same origin
// for CrossOriginProtection. Only without a token: with one, such a page
// cannot authenticate. Clients without those headers (curl, scripts) may
// name the bridge as they like (R226).
func rebindingGuard(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if (r.Header.Get("Origin") != "" || r.Header.Get("Sec-Fetch-Site") != "") && !addressHost(r.Host) {
			writeError(w, http.StatusForbidden, "a browser's request must name the bridge by its IP address or localhost (no admin token is set, and another name may be a DNS-rebinding page)")
			return
		}
		next.ServeHTTP(w, r)
	})
}

// addressHost reports whether host (a request's Host, with or without a
// port) is an IP address, "localhost" or a name under ".localhost", which
// browsers resolve to the loopback themselves.
func addressHost(host string) bool {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.ToLower(strings.TrimPrefix(strings.TrimSuffix(host, "]"), "["))
	if host == "localhost" || strings.HasSuffix(host, ".localhost") {
		return true
	}
	_, err := netip.ParseAddr(host)
	return err == nil
}

// access is what an endpoint asks of a request.
type access int

const (
	open          access = iota // nothing (the probes)
	adminAccess                 // the admin token
	metricsAccess               // the admin token or the metrics token
)

// authorizeFor requires the token that a asks for, when a token is
// configured.
func (s *server) authorizeFor(a access, next http.Handler) http.Handler {
	if s.adminToken == nil {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch s.token(r) {
		case tokenMissing:
			s.logRefused(r, "missing bearer token")
			w.Header().Set("WWW-Authenticate", `Bearer realm="delaybridge"`)
			writeError(w, http.StatusUnauthorized, "missing bearer token")
		case tokenInvalid:
			s.logRefused(r, "invalid bearer token")
			w.Header().Set("WWW-Authenticate", `Bearer realm="delaybridge", error="invalid_token"`)
			writeError(w, http.StatusUnauthorized, "invalid bearer token")
		case tokenMetrics:
			if a != metricsAccess {
				s.logRefused(r, "the metrics token outside /metrics")
				writeError(w, http.StatusForbidden, "this token is good for /metrics only")
				return
			}
			next.ServeHTTP(w, r)
		default:
			next.ServeHTTP(w, r)
		}
	})
}

type tokenCheck int

const (
	tokenValid   tokenCheck = iota // the admin token, or none configured
	tokenMetrics                   // the metrics token
	tokenMissing
	tokenInvalid
)

// token checks r's bearer token against the configured ones. Both sides
// are hashed before the constant-time compares, so that neither the
// content nor the length of a token leaks through timing.
func (s *server) token(r *http.Request) tokenCheck {
	if s.adminToken == nil {
		return tokenValid
	}
	scheme, tok, ok := strings.Cut(r.Header.Get("Authorization"), " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return tokenMissing
	}
	sum := sha256.Sum256([]byte(strings.TrimSpace(tok)))
	at := s.adminToken()
	adminSum := sha256.Sum256([]byte(at))
	admin := at != "" && subtle.ConstantTimeCompare(sum[:], adminSum[:]) == 1
	metrics := false
	if mt := s.metricsToken(); mt != "" {
		metricsSum := sha256.Sum256([]byte(mt))
		metrics = subtle.ConstantTimeCompare(sum[:], metricsSum[:]) == 1
		s.checkTokensDiffer(subtle.ConstantTimeCompare(adminSum[:], metricsSum[:]) == 1)
	}
	switch {
	case admin:
		return tokenValid
	case metrics:
		return tokenMetrics
	}
	return tokenInvalid
}

// checkTokensDiffer logs, once each time it starts, a metrics token equal
// to the admin token: the start refuses that, but files rotated since can
// bring it about, and then the scraper's token opens the whole admin API
// (the server cannot tell the two apart). Once when they differ again.
func (s *server) checkTokensDiffer(equal bool) {
	if s.tokensEqual.Swap(equal) == equal {
		return
	}
	if equal {
		s.log.Error("admin.metrics_token is now equal to admin.token (files rotated?): the token given to scrapers opens every admin endpoint, task cancels included; give it its own value")
		return
	}
	s.log.Info("admin.metrics_token differs from admin.token again")
}

// probeDetail is the reason a probe gives: all of it for a request with
// the token (or when none is configured), else only that there is one.
// The probes are open, so that kubelet needs no token; the reasons name
// brokers, topics, subjects and paths, which are for the operator.
func (s *server) probeDetail(r *http.Request, state, reason string) string {
	if s.token(r) == tokenValid {
		return state + ": " + reason
	}
	return state + " (the reason with the admin token, and in the log)"
}

func (s *server) healthz(w http.ResponseWriter, r *http.Request) {
	if s.o.Live != nil {
		if err := s.o.Live(); err != nil {
			s.logProbe("healthz", err.Error())
			writeText(w, http.StatusServiceUnavailable, s.probeDetail(r, "unhealthy", err.Error()))
			return
		}
	}
	s.logProbe("healthz", "")
	writeText(w, http.StatusOK, "ok")
}

func (s *server) readyz(w http.ResponseWriter, r *http.Request) {
	if s.o.Ready != nil {
		if err := s.o.Ready(); err != nil {
			// The service's own reason may say "not ready" already.
			reason, _ := strings.CutPrefix(err.Error(), "not ready: ")
			s.logProbe("readyz", reason)
			writeText(w, http.StatusServiceUnavailable, s.probeDetail(r, "not ready", reason))
			return
		}
	}
	s.logProbe("readyz", "")
	writeText(w, http.StatusOK, "ok")
}

// taskKey reads {source} and {id}; false after writing a 400.
func taskKey(w http.ResponseWriter, r *http.Request) (source, id string, ok bool) {
	source, id = r.PathValue("source"), r.PathValue("id")
	if source == "" || id == "" {
		writeError(w, http.StatusBadRequest, "want /v1/tasks/{source}/{id} with a non-empty source and id")
		return "", "", false
	}
	if strings.IndexByte(source, 0) >= 0 {
		// The store keys a task by source, 0, id: a source with a NUL
		// would name another source's task ("a\x00b"/"c" is "a"/"b\x00c").
		// No topic or stream name holds one.
		writeError(w, http.StatusBadRequest, "want /v1/tasks/{source}/{id} with a source without NUL bytes")
		return "", "", false
	}
	return source, id, true
}

func (s *server) getTask(w http.ResponseWriter, r *http.Request) {
	source, id, ok := taskKey(w, r)
	if !ok || !s.haveEngine(w) {
		return
	}
	info, err := s.o.Engine.Lookup(source, id)
	if err != nil {
		s.engineError(w, "lookup", source, id, err)
		return
	}
	writeJSON(w, http.StatusOK, info)
}

func (s *server) deleteTask(w http.ResponseWriter, r *http.Request) {
	source, id, ok := taskKey(w, r)
	if !ok || !s.haveEngine(w) {
		return
	}
	if err := s.o.Engine.Cancel(source, id); err != nil {
		s.engineError(w, "cancel", source, id, err)
		return
	}
	// Cancelling is an operator action on someone's data: keep a trace.
	s.log.Info("admin: task cancelled", zap.String("source", source), zap.String("id", shard.LogID(id)),
		zap.String("remote", r.RemoteAddr))
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusNoContent)
}

func (s *server) listTasks(w http.ResponseWriter, r *http.Request) {
	source := r.PathValue("source")
	if source == "" || strings.IndexByte(source, 0) >= 0 {
		writeError(w, http.StatusBadRequest, "want /v1/tasks/{source} with a non-empty source without NUL bytes")
		return
	}
	q, err := parseListQuery(r.URL.RawQuery)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if !s.haveEngine(w) {
		return
	}
	list, err := s.o.Engine.ListTasks(source, q)
	if err != nil {
		if errors.Is(err, shard.ErrBadListQuery) {
			writeError(w, http.StatusBadRequest, err.Error())
			return
		}
		s.engineError(w, "list", source, "", err)
		return
	}
	if len(list.Tasks) == 0 && list.Next == "" && q.After == "" {
		// Nothing stored under a source the config does not name either
		// (a subject or "kafka:delay" for the topic "delay"): say so, as
		// a lookup does, rather than an empty list that reads as
		// "nothing pending". A removed source's stored tasks are listed.
		if hint := s.unknownSource(source); hint != "" {
			writeError(w, http.StatusNotFound, fmt.Sprintf("no pending task in source %q", source)+hint)
			return
		}
	}
	body := taskListBody{Tasks: make([]listedTask, len(list.Tasks)), Next: list.Next, NextEscaped: escapedID(list.Next)}
	for i, t := range list.Tasks {
		body.Tasks[i] = listedTask{TaskInfo: t, IDEscaped: escapedID(t.ID)}
	}
	writeJSON(w, http.StatusOK, body)
}

// taskListBody is the JSON of GET /v1/tasks/{source}.
type taskListBody struct {
	Tasks []listedTask `json:"tasks"`
	Next  string       `json:"next,omitempty"`
	// NextEscaped: Next percent-encoded, when it is not valid UTF-8.
	NextEscaped string `json:"next_escaped,omitempty"`
}

// listedTask is a task of a list: what GET /v1/tasks/{source}/{id} says
// of it, and its id percent-encoded when that is not valid UTF-8.
type listedTask struct {
	shard.TaskInfo
	IDEscaped string `json:"id_escaped,omitempty"`
}

// escapedID is id with every byte but [A-Za-z0-9-._~] percent-encoded
// (good as is in a path segment and in a query) when id is not valid
// UTF-8, which a JSON string cannot carry; else "".
func escapedID(id string) string {
	if utf8.ValidString(id) {
		return ""
	}
	return escapeAll(id)
}

// escapeAll percent-encodes every byte of s but the unreserved ones.
func escapeAll(s string) string {
	const hex = "0123456789ABCDEF"
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if 'A' <= c && c <= 'Z' || 'a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '-' || c == '.' || c == '_' || c == '~' {
			b.WriteByte(c)
			continue
		}
		b.WriteByte('%')
		b.WriteByte(hex[c>>4])
		b.WriteByte(hex[c&15])
	}
	return b.String()
}

// parseListQuery reads the query of GET /v1/tasks/{source}: prefix, after
// and limit, each at most once, form-encoded. An error names the
// parameter.
func parseListQuery(raw string) (shard.ListQuery, error) {
	q := shard.ListQuery{Limit: shard.DefaultListLimit}
	seen := make(map[string]bool, 3)
	for part := range strings.SplitSeq(raw, "&") {
		if part == "" {
			continue
		}
		k, v, _ := strings.Cut(part, "=")
		key, err := url.QueryUnescape(k)
		if err != nil || strings.Contains(k, ";") {
			return shard.ListQuery{}, fmt.Errorf("query parameter %q: not a parameter name (percent-encode its bytes; \";\" does not separate parameters)", shard.LogCut(k, 64))
		}
		switch key {
		case "prefix", "after", "limit":
		default:
			return shard.ListQuery{}, fmt.Errorf("unknown query parameter %q; want prefix, after or limit", shard.LogCut(key, 64))
		}
		if seen[key] {
			return shard.ListQuery{}, fmt.Errorf("query parameter %s given twice", key)
		}
		seen[key] = true
		val, err := url.QueryUnescape(v)
		if err != nil {
			return shard.ListQuery{}, fmt.Errorf("%s: %v (percent-encode the value's bytes, \"+\" as %%2B)", key, err)
		}
		switch key {
		case "prefix":
			q.Prefix = val
		case "after":
			q.After = val
		case "limit":
			n, err := strconv.ParseUint(val, 10, 64)
			if err != nil || n < 1 || n > shard.MaxListLimit {
				return shard.ListQuery{}, fmt.Errorf("limit %q: want a whole number from 1 to %d", shard.LogCut(val, 64), shard.MaxListLimit)
			}
			q.Limit = int(n)
		}
	}
	return q, nil
}

func (s *server) stats(w http.ResponseWriter, _ *http.Request) {
	if !s.haveEngine(w) {
		return
	}
	writeJSON(w, http.StatusOK, s.o.Engine.Stats())
}

func (s *server) listStuck(w http.ResponseWriter, r *http.Request) {
	limit := shard.DefaultStuckLimit
	// Not r.URL.Query: it drops a pair it cannot unescape, so
	// "limit=%zz" listed the default limit as if none was given.
	query, err := url.ParseQuery(r.URL.RawQuery)
	if err != nil {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("query: %v", err))
		return
	}
	if v := query.Get("limit"); v != "" {
		// Digits only: a number above the maximum (however large) is cut
		// to it, as the route's doc says.
		n, err := strconv.ParseUint(v, 10, 64)
		if errors.Is(err, strconv.ErrRange) {
			n, err = shard.MaxStuckLimit, nil
		}
		if err != nil || n < 1 {
			writeError(w, http.StatusBadRequest, fmt.Sprintf("limit %q: want a whole number of at least 1 (above %d it is taken as %d)", v, shard.MaxStuckLimit, shard.MaxStuckLimit))
			return
		}
		limit = int(min(n, shard.MaxStuckLimit))
	}
	if !s.haveEngine(w) {
		return
	}
	list, err := s.o.Engine.StuckEntries(limit)
	if err != nil {
		s.engineError(w, "stuck", "", "", err)
		return
	}
	writeJSON(w, http.StatusOK, list)
}

func (s *server) dropStuck(w http.ResponseWriter, r *http.Request) {
	sh, err1 := strconv.ParseUint(r.PathValue("shard"), 10, 16)
	seq, err2 := strconv.ParseUint(r.PathValue("seq"), 10, 64)
	if err1 != nil || err2 != nil {
		writeError(w, http.StatusBadRequest, "want /v1/stuck/{shard}/{seq} with the decimal shard and seq of an entry GET /v1/stuck lists")
		return
	}
	if !s.haveEngine(w) {
		return
	}
	if err := s.o.Engine.DropStuck(int(sh), seq); err != nil {
		if errors.Is(err, shard.ErrNotFound) {
			writeError(w, http.StatusNotFound, fmt.Sprintf("no stuck entry %d/%d (GET /v1/stuck lists them)", sh, seq))
			return
		}
		s.engineError(w, "drop stuck", "", fmt.Sprintf("%d/%d", sh, seq), err)
		return
	}
	// The engine logs the drop with what it knew of the entry; this says
	// who asked.
	s.log.Info("admin: stuck entry dropped", zap.Uint64("shard", sh), zap.Uint64("seq", seq),
		zap.String("remote", r.RemoteAddr))
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusNoContent)
}

func (s *server) firing(w http.ResponseWriter, _ *http.Request) {
	if !s.haveEngine(w) {
		return
	}
	writeJSON(w, http.StatusOK, s.o.Engine.Firing())
}

// maxPauseBody bounds the body of POST /v1/firing/pause: a reason of
// shard.MaxPauseReason bytes, every one escaped (\u00XX) at worst, and
// the object around it.
const maxPauseBody = 6*shard.MaxPauseReason + 64

// pauseRequest is the body of POST /v1/firing/pause.
type pauseRequest struct {
	Reason string `json:"reason"`
}

func (s *server) pauseFiring(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(io.LimitReader(r.Body, maxPauseBody+1))
	if err != nil {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("read body: %v", err))
		return
	}
	if len(body) > maxPauseBody {
		writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("body over %d bytes: want nothing, or {\"reason\": \"...\"} with a reason of at most %d bytes", maxPauseBody, shard.MaxPauseReason))
		return
	}
	var req pauseRequest
	if !utf8.Valid(body) {
		// encoding/json would take the bad bytes as U+FFFD.
		writeError(w, http.StatusBadRequest, "body: not UTF-8")
		return
	}
	if len(bytes.TrimSpace(body)) > 0 {
		dec := json.NewDecoder(bytes.NewReader(body))
		dec.DisallowUnknownFields()
		err := dec.Decode(&req)
		if err == nil {
			if _, terr := dec.Token(); terr != io.EOF {
				err = errors.New("data after the object")
			}
		}
		if err != nil {
			writeError(w, http.StatusBadRequest, fmt.Sprintf("body: want nothing, or {\"reason\": \"...\"}: %v", err))
			return
		}
	}
	if !s.haveEngine(w) {
		return
	}
	st, err := s.o.Engine.PauseFiringByOperator(req.Reason)
	if errors.Is(err, shard.ErrPauseReason) {
		writeError(w, http.StatusBadRequest, "reason: "+err.Error())
		return
	}
	if err != nil {
		s.engineError(w, "pause firing", "", "", err)
		return
	}
	// The engine logs the pause; this says who asked.
	s.log.Info("admin: firing paused", zap.String("reason", req.Reason), zap.String("remote", r.RemoteAddr))
	writeJSON(w, http.StatusOK, st)
}

func (s *server) resumeFiring(w http.ResponseWriter, r *http.Request) {
	if !s.haveEngine(w) {
		return
	}
	st, was, err := s.o.Engine.ResumeFiringByOperator()
	if err != nil {
		s.engineError(w, "resume firing", "", "", err)
		return
	}
	if was != nil {
		s.log.Info("admin: firing resumed", zap.String("remote", r.RemoteAddr))
	}
	writeJSON(w, http.StatusOK, st)
}

func (s *server) haveEngine(w http.ResponseWriter) bool {
	if s.o.Engine == nil {
		writeError(w, http.StatusServiceUnavailable, "engine not started")
		return false
	}
	return true
}

// unknownSource is what a "not found" answer adds for a source that is
// none of the running config's: "" when it is one (or the config names
// none).
func (s *server) unknownSource(source string) string {
	if len(s.o.Sources) == 0 || slices.Contains(s.o.Sources, source) {
		return ""
	}
	quoted := make([]string, len(s.o.Sources))
	for i, src := range s.o.Sources {
		quoted[i] = strconv.Quote(src)
	}
	return fmt.Sprintf("; %q is not a delay source of the running config (%s): {source} is the Kafka delay topic or the NATS stream, not a subject",
		source, strings.Join(quoted, ", "))
}

func (s *server) engineError(w http.ResponseWriter, op, source, id string, err error) {
	switch {
	case errors.Is(err, shard.ErrNotFound):
		writeError(w, http.StatusNotFound, fmt.Sprintf("no pending task %q in source %q", id, source)+s.unknownSource(source))
	case errors.Is(err, shard.ErrClosed), errors.Is(err, shard.ErrStoreFailed):
		writeError(w, http.StatusServiceUnavailable, err.Error())
	default:
		s.log.Error("admin: engine call failed", zap.String("op", op), zap.String("source", source),
			zap.String("id", shard.LogID(id)), zap.Error(err))
		writeError(w, http.StatusInternalServerError, err.Error())
	}
}

func writeText(w http.ResponseWriter, code int, msg string) {
	h := w.Header()
	h.Set("Content-Type", "text/plain; charset=utf-8")
	h.Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	_, _ = w.Write([]byte(msg))
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		code = http.StatusInternalServerError
		b, _ = json.Marshal(errorBody{Error: "encode response: " + err.Error()})
	}
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Cache-Control", "no-store")
	h.Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(code)
	_, _ = w.Write(append(b, '\n'))
}

type errorBody struct {
	Error string `json:"error"`
}

func writeError(w http.ResponseWriter, code int, msg string) {
	writeJSON(w, code, errorBody{Error: msg})
}

// CheckListen refuses a listen address reachable from other hosts without a
// token unless allowInsecure; see config.CheckListen, which holds the rule
// so that config.Validate applies it too.
func CheckListen(listen, token string, allowInsecure bool) error {
	return config.CheckListen(listen, token, allowInsecure)
}

// Timeouts of the admin server. Slow clients cannot hold connections open
// forever; /metrics of a large registry still has time to render.
const (
	readHeaderTimeout = 5 * time.Second
	readTimeout       = 15 * time.Second
	writeTimeout      = 60 * time.Second
	idleTimeout       = 120 * time.Second
	shutdownTimeout   = 5 * time.Second
)

// Serve listens on listen and serves h until ctx ends, then shuts down
// gracefully: in-flight requests get up to 5 s to finish. It returns nil
// after a shutdown caused by ctx, or the listen/serve error.
func Serve(ctx context.Context, listen string, h http.Handler, logger *zap.Logger) error {
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", listen)
	if err != nil {
		return fmt.Errorf("admin: listen %s (admin.listen): %w", listen, err)
	}
	return ServeListener(ctx, ln, h, logger)
}

// MaxHeaderBytes bounds a request's headers, its request line included,
// so also the id of /v1/tasks/{source}/{id}: 64 KiB, about 21 KB of id
// when every byte is escaped, 64 KB of plain ASCII. Headers are read
// before the token is checked, so this is what any client that reaches
// the port can make the server hold per connection; ids up to
// max_message_bytes/5 (the longest a stored task has), 3 x that escaped,
// would let 1 000 slow connections hold 3.7 GiB (measured). A longer id
// is cancelled with a delay-cancel message instead.
const MaxHeaderBytes = 64 << 10

// ServeListener is Serve on a listener the caller opened (tests, socket
// activation). It closes ln.
func ServeListener(ctx context.Context, ln net.Listener, h http.Handler, logger *zap.Logger) error {
	if logger == nil {
		logger = zap.NewNop()
	}
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: readHeaderTimeout,
		ReadTimeout:       readTimeout,
		WriteTimeout:      writeTimeout,
		IdleTimeout:       idleTimeout,
		MaxHeaderBytes:    MaxHeaderBytes,
		ErrorLog:          zap.NewStdLog(logger.Named("http")),
	}
	// fresh: the connections that have not sent a whole request yet
	// (StateNew). Shutdown waits for those as for requests in flight, up
	// to 5 s (net/http's own rule), so one slow or idle client that had
	// only connected held the shutdown that long, from the budget the
	// service keeps for closing the store with its flush (hunt H208:
	// 5.0 s every cycle with slow clients connected). They carry no
	// request to finish: they are closed when the shutdown begins.
	var freshMu sync.Mutex
	fresh := make(map[net.Conn]struct{})
	srv.ConnState = func(c net.Conn, st http.ConnState) {
		freshMu.Lock()
		defer freshMu.Unlock()
		if st == http.StateNew {
			fresh[c] = struct{}{}
		} else {
			delete(fresh, c)
		}
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	logger.Info("admin: serving", zap.String("addr", ln.Addr().String()))
	select {
	case err := <-errc:
		return fmt.Errorf("admin: serve %s: %w", ln.Addr(), err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), shutdownTimeout)
	defer cancel()
	shut := make(chan error, 1)
	go func() { shut <- srv.Shutdown(sctx) }()
	// After Shutdown closed the listener (it does so first), no new
	// connection comes; closing the fresh ones before that could miss
	// one accepted meanwhile, so they are closed until Shutdown returns.
	closing := time.NewTicker(10 * time.Millisecond)
	defer closing.Stop()
	var err error
shutting:
	for {
		freshMu.Lock()
		for c := range fresh {
			_ = c.Close()
			delete(fresh, c)
		}
		freshMu.Unlock()
		select {
		case err = <-shut:
			break shutting
		case <-closing.C:
		}
	}
	if err != nil {
		logger.Warn("admin: graceful shutdown incomplete; closing connections", zap.Error(err))
		_ = srv.Close()
	}
	if serr := <-errc; serr != nil && !errors.Is(serr, http.ErrServerClosed) {
		return fmt.Errorf("admin: serve %s: %w", ln.Addr(), serr)
	}
	logger.Info("admin: stopped")
	return nil
}
