"""On-disk caches of what inferd derives from a model file and would otherwise recompute at every start:
the tokenizer converted from a GGUF file's vocabulary, and the GGUF file's dequantized weights.

Location: ``$INFERD_CACHE_DIR``, else ``$XDG_CACHE_HOME/inferd`` or ``~/.cache/inferd``. An entry's key
is the source file's absolute path, size and modification time (ns) and a version string of the code
that derived it, so a changed file or a new converter misses the cache. Entries are written under a
temporary name and renamed into place, so a concurrent loader sees all of an entry or none; an
unwritable cache is skipped (logged at INFO). Only data formats are stored (tokenizer JSON,
safetensors), never pickles.

The cache stays bounded: reading an entry marks it used (its mtime), and each new entry prunes the
entries whose source file is gone and all but the most recently used few (:func:`prune`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Callable

logger = logging.getLogger("inferd.cache")


def cache_dir(kind: str) -> str:
    """The folder of one kind of entry (``tokenizers``, ``checkpoints``)."""
    base = os.environ.get("INFERD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "inferd")
    return os.path.join(base, kind)


def cache_key(path: str, version: str) -> str:
    """32 hex digits naming the entry derived from the file at ``path`` by code of ``version``.

    Raises:
        OSError: ``path`` cannot be stat'ed.
    """
    path = os.path.abspath(path)
    st = os.stat(path)
    return hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{version}".encode()).hexdigest()[:32]


def touch(entry: str) -> None:
    """Mark an entry as used now (for :func:`prune`'s least-recently-used order)."""
    try:
        os.utime(entry)
    except OSError:
        pass


def prune(kind: str, keep: int, source_of: Callable[[str], str | None] | None = None) -> None:
    """Delete the entries of ``kind`` whose source file no longer exists (``source_of(entry)`` names
    it; None = unknown, kept), then all but the ``keep`` most recently used. Errors are logged, never
    raised (an entry another process has open stays readable until it closes it)."""
    folder = cache_dir(kind)
    try:
        entries = [os.path.join(folder, n) for n in os.listdir(folder) if not n.startswith(".")]
    except OSError:
        return
    live = []
    for entry in entries:
        try:
            source = source_of(entry) if source_of is not None else None
        except Exception:  # noqa: BLE001 - an unreadable entry is as good as gone
            source = ""
        if source is not None and not os.path.exists(source):
            _remove(entry)
        else:
            live.append(entry)
    live.sort(key=lambda e: os.path.getmtime(e) if os.path.exists(e) else 0.0, reverse=True)
    for entry in live[keep:]:
        _remove(entry)


def _remove(entry: str) -> None:
    try:
        if os.path.isdir(entry):
            shutil.rmtree(entry)
        else:
            os.remove(entry)
    except OSError as e:
        logger.info("cache entry %s not removed (%s)", entry, e)
