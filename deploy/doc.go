// Package deploy holds the deployment artifacts of delaybridge: the Helm
// chart (helm/delaybridge), the container image (Dockerfile), the Grafana
// dashboard (grafana) and the Prometheus alert rules (prometheus). It has no
// runtime code; its tests render the chart with a pinned Helm and decode
// every manifest strictly into the Kubernetes API types, and check that the
// dashboard and the alerts only use metrics the bridge exports.
package deploy
