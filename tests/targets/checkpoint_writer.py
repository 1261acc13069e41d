"""A rank that writes a checkpoint for as long as it lives: 256 KiB every 50 ms into its folder, with an
fsync now and then, rewinding at 32 MiB so the disk does not fill. Usage: checkpoint_writer.py FOLDER READY"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def save_checkpoint(path: Path) -> None:
    chunk = os.urandom(256 * 1024)
    with path.open("wb") as f:
        while True:
            for _ in range(128):
                f.write(chunk)
                time.sleep(0.05)
            f.flush()
            os.fsync(f.fileno())
            f.seek(0)


def main() -> None:
    folder = Path(sys.argv[1])
    Path(sys.argv[2]).write_text("ready")
    save_checkpoint(folder / f"shard-{os.getpid()}.pt")


if __name__ == "__main__":
    main()
