# The one entry point for checks; .ci/run calls `make check`, as the README says.
STATICCHECK := honnef.co/go/tools/cmd/staticcheck@v0.8.2
GO_FILES = $(shell git ls-files '*.go')

.PHONY: check fmt vet staticcheck test test-long bench

check: fmt vet staticcheck test

fmt:
	@out=$$(gofmt -l $(GO_FILES)); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

vet:
	go vet ./...

staticcheck:
	go run $(STATICCHECK) ./...

# Core packages run under the race detector; broker end-to-end tests run
# without it (the fault suite, the Helm tests) to keep CI inside its time budget.
# -count=1: never a cached result (the Helm tests read the chart through a
# helm process, which Go's test cache does not see).
RACE_PKGS := ./codec/... ./wheel/... ./shard/... ./internal/... ./bridge/ ./bridge/kafka/... ./bridge/nats/... ./bridge/service/... ./config/... ./admin/...
test:
	go test -count=1 -race -timeout 15m $(RACE_PKGS)
	go test -count=1 -timeout 15m $$(go list ./... | grep -v -E '/(codec|wheel|shard|internal/.*|config|admin|bridge|bridge/kafka|bridge/nats|bridge/service)$$')

# Long fault runs (20+ kill -9 rounds, 30 s broker outages, 10 k bad messages).
# The 10 M capacity and 1 M recovery runs are benchmarks: `DELAYBRIDGE_LONG=1
# make bench`, or `delaybridge bench` (docs/benchmarks.md).
test-long:
	DELAYBRIDGE_LONG=1 go test -count=1 -timeout 60m ./...
	DELAYBRIDGE_LANE_GRACE=1ms go test -race -count=1 ./shard

bench:
	go test -run '^$$' -bench . -benchmem ./...
