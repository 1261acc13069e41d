"""The stack feature: capture the ranks' Python stacks with py-spy, read saved dumps, classify each rank's
activity, group identical stacks, name the odd rank and decide a verdict, and render it for a terminal.
Imports only the core and sample/ (for the ranks)."""
