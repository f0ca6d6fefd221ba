"""On-call operations: the redeploy's rollout order (the seed's PD restart rule), `k31 status` and `k31 logs`,
and the repair of an interrupted redeploy."""
