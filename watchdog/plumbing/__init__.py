"""Plumbing shared by every floor: the key=value log lines (logfmt), the counters the metrics export, the
schedule the loop keeps, and handing the allocator's free memory back (allocator)."""
