"""Allows `python -m watchdog`."""

from watchdog.entry import main

raise SystemExit(main())
