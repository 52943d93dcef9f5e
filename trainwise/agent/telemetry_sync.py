"""Copies a job's telemetry folder into the object store, so the launcher reads a remote run.

Every file under the local folder that changed since the last copy (size or modification time)
is put under `key_prefix/<its path in the folder>`; an open segment is copied as far as it is
written and again when it grows, and its `.complete` marker follows when the writer seals it.
Links and anything that is not a regular file are skipped (a run folder is not trusted to hold
only what the job wrote; issue 31).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

LOG = logging.getLogger("trainwise.agent")


class TelemetrySync:
    def __init__(self, store: Any, folder: Path, key_prefix: str) -> None:
        self.store, self.folder, self.key_prefix = store, Path(folder), key_prefix.strip("/")
        self._copied: dict[str, tuple[int, int]] = {}
        self.failures = 0

    @property
    def files(self) -> int:
        return len(self._copied)

    def _changed(self) -> list[tuple[Path, str, tuple[int, int]]]:
        found = []
        if not self.folder.is_dir():
            return found
        for root, folders, names in os.walk(self.folder, followlinks=False):
            folders[:] = sorted(f for f in folders if not Path(root, f).is_symlink())
            for name in sorted(names):
                path = Path(root, name)
                if name.startswith(".") or path.is_symlink() or not path.is_file():
                    continue  # temp files of an atomic write, links
                stat = path.stat()
                relative = path.relative_to(self.folder).as_posix()
                seen = (stat.st_size, stat.st_mtime_ns)
                if self._copied.get(relative) != seen:
                    found.append((path, relative, seen))
        return found

    def sync(self) -> int:
        """Copies what changed; returns how many files. A failed put is logged and retried at
        the next sync (telemetry never stops the job)."""
        copied = 0
        # Segments before their markers: a reader that sees a marker finds its segment whole.
        for path, relative, seen in sorted(self._changed(),
                                           key=lambda item: item[1].endswith(".complete")):
            try:
                self.store.put_file(path, f"{self.key_prefix}/{relative}")
            except (OSError, ValueError) as error:
                self.failures += 1
                LOG.warning("telemetry %s not copied to the store (%s); retried at the next "
                            "sync", relative, error)
                continue
            self._copied[relative] = seen
            copied += 1
        return copied
