"""Sources of node snapshots: live NVML, recorded traces, and scripted simulations."""
