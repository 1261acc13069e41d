"""Allows `python -m watchdog`."""

from watchdog.cli import main

raise SystemExit(main())
