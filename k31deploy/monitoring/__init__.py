"""Monitoring generated from a resolved plan: Prometheus recording and alerting rules (`rules.rules`,
`rules.alert_catalog`), a Grafana dashboard (`dashboard.grafana_dashboard`), the Prometheus, Alertmanager and
exporter configuration (`config`) and the console templates under `k31deploy/data/monitoring/`. The
submodules are not re-exported: `rules` is both a module and its function."""
