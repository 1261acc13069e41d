"""Plumbing shared by every floor: the key=value log lines (logfmt), the counters the metrics export, and
the schedule the loop keeps."""
