"""Ways the verdicts leave the process: the metric table and its collector, the /metrics endpoint, the
HTML incident report, replay timelines, systemd notifications. Export imports no action."""
