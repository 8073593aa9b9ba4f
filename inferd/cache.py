"""On-disk caches of what inferd derives from a model file and would otherwise recompute at every start:
the tokenizer converted from a GGUF file's vocabulary, and the GGUF file's dequantized weights.

Location: ``$INFERD_CACHE_DIR``, else ``$XDG_CACHE_HOME/inferd`` or ``~/.cache/inferd``. An entry's key
is the source file's absolute path, size and modification time (ns) and a version string of the code
that derived it, so a changed file or a new converter misses the cache. Entries are written under a
temporary name and renamed into place, so a concurrent loader sees all of an entry or none; an
unwritable cache is skipped (logged at INFO). Only data formats are stored (tokenizer JSON,
safetensors), never pickles.
"""

from __future__ import annotations

import hashlib
import os


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
