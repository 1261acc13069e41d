"""Actions taken when a stall is seen: capture the ranks' stacks, name the culprit (alerts later).
Each side effect is bounded by a timeout."""
