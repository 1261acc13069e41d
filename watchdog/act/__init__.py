"""Side effects when an episode opens, escalates or resolves: incident bundles and alerts, each bounded
by a timeout and run off the sampling loop. Renderers and counters are handed in; act imports no exporter."""
