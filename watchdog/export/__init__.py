"""Ways the verdicts leave the process: replay timelines and event lines (metrics and alerts later)."""
