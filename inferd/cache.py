"""On-disk caches of what inferd derives from a model file and would otherwise recompute at every start:
the tokenizer converted from a GGUF file's vocabulary, and the GGUF file's dequantized weights.

Location: ``$INFERD_CACHE_DIR``, else ``$XDG_CACHE_HOME/inferd`` or ``~/.cache/inferd``. An entry's key
is the SHA-256 of the source files' bytes and a version string of the code that derived it: a changed
file or a new converter misses the cache, and a copy of a file (a model repository's version folder,
a moved download) finds the entry of the original. So that a start does not hash a model file each
time, a file's digest is remembered (``digests/``) under its absolute path, size, modification and
status-change times (ns), inode and device, as git's index does; the status-change time cannot be set
back (``cp -p`` and ``touch`` set it to now), so a replaced or rewritten file is hashed again. A
loader checks :func:`unchanged` before it writes an entry, so a file replaced while it was being
converted does not leave its bytes under the old file's key. Entries are written under a temporary name and renamed into place, so a
concurrent loader sees all of an entry or none; an unwritable cache is skipped (logged at INFO). Only
data formats are stored (tokenizer JSON, safetensors, hex digests), never pickles.

The cache stays bounded: reading an entry marks it used (its mtime), and each new entry prunes all but
the most recently used few (:func:`prune`). (An entry is not dropped when the file that made it is
deleted: a copy elsewhere may still use it.)
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile

logger = logging.getLogger("inferd.cache")


def cache_dir(kind: str) -> str:
    """The folder of one kind of entry (``tokenizers``, ``checkpoints``)."""
    base = os.environ.get("INFERD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "inferd")
    return os.path.join(base, kind)


DIGEST_ENTRIES = 256  # remembered file digests (a few dozen bytes each)


def file_digest(path: str) -> str:
    """SHA-256 (64 hex digits) of the bytes of the file at ``path``, remembered under its stat.

    Hashing the default model's 98 MB takes ~0.08 s from the page cache (more from disk, and seconds
    for a model of several GB); a remembered digest costs a ``stat`` and a 64-byte read.

    Raises:
        OSError: ``path`` cannot be stat'ed or read.
    """
    path = os.path.abspath(path)
    st = _stat(path)
    memo = os.path.join(cache_dir("digests"), hashlib.sha256(f"{path}\0{st}".encode()).hexdigest()[:32])
    try:
        with open(memo, encoding="ascii") as f:
            digest = f.read()
        if len(digest) == 64 and all(c in "0123456789abcdef" for c in digest):
            touch(memo)
            return digest
    except (OSError, UnicodeDecodeError):
        pass
    digest = sha256_file(path)
    if _stat(path) == st:  # not when the file changed while it was read
        _write_atomically(memo, digest)
        prune("digests", DIGEST_ENTRIES)
    return digest


def sha256_file(path: str) -> str:
    """SHA-256 (64 hex digits) of the file's bytes, read in 1 MiB pieces (also the model repository's
    SHA256SUMS check).

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _stat(path: str) -> tuple[int, ...]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev


def source_stats(paths: str | list[str]) -> list[tuple[int, ...]]:
    """The stat of each source file (size, times, inode, device), taken before its key (:func:`unchanged`).

    Raises:
        OSError: a file cannot be stat'ed.
    """
    return [_stat(p) for p in ([paths] if isinstance(paths, str) else paths)]


def unchanged(paths: str | list[str], before: list[tuple[int, ...]]) -> bool:
    """Whether the source files are still those :func:`source_stats` saw (call after converting them and
    before writing the entry: a file replaced or rewritten meanwhile would leave its bytes under the key
    of the old ones)."""
    try:
        return source_stats(paths) == before
    except OSError:
        return False


def cache_key(paths: str | list[str], version: str, root: str | None = None) -> str:
    """32 hex digits naming the entry derived from the bytes of the file(s) at ``paths`` by code of
    ``version``. A single file's name and location are not part of the key; a list is keyed by each
    file's path relative to ``root`` (else its base name) and digest, in order.

    Raises:
        OSError: a file cannot be stat'ed or read.
    """
    if isinstance(paths, str):
        parts = [file_digest(paths)]
    else:
        parts = [f"{os.path.relpath(p, root) if root else os.path.basename(p)}\0{file_digest(p)}" for p in paths]
    return hashlib.sha256("\0".join([version, *parts]).encode()).hexdigest()[:32]


def _write_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path`` under a temporary name, then rename it into place; an unwritable
    cache is logged at INFO and skipped."""
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        logger.info("cache entry %s not written (%s)", path, e)
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)


def touch(entry: str) -> None:
    """Mark an entry as used now (for :func:`prune`'s least-recently-used order)."""
    try:
        os.utime(entry)
    except OSError:
        pass


def prune(kind: str, keep: int) -> None:
    """Delete all but the ``keep`` most recently used entries of ``kind``. Errors are logged, never
    raised (an entry another process has open stays readable until it closes it)."""
    folder = cache_dir(kind)
    try:
        entries = [os.path.join(folder, n) for n in os.listdir(folder) if not n.startswith(".")]
    except OSError:
        return
    entries.sort(key=lambda e: os.path.getmtime(e) if os.path.exists(e) else 0.0, reverse=True)
    for entry in entries[keep:]:
        _remove(entry)


def _remove(entry: str) -> None:
    try:
        if os.path.isdir(entry):
            shutil.rmtree(entry)
        else:
            os.remove(entry)
    except OSError as e:
        logger.info("cache entry %s not removed (%s)", entry, e)
