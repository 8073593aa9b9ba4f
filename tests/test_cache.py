"""The on-disk cache's bookkeeping (inferd/cache.py): keys follow the source file, and pruning drops
entries whose source is gone and all but the most recently used. (The cached tokenizer and checkpoint
themselves are checked in tests/test_engine.py and tests/test_model.py.)"""

from __future__ import annotations

import os
import time

from inferd.cache import cache_dir, cache_key, prune, touch


def test_key_changes_with_the_source_file(tmp_path):
    src = tmp_path / "model.gguf"
    src.write_bytes(b"a" * 10)
    k1 = cache_key(str(src), "v1")
    assert len(k1) == 32 and k1 == cache_key(str(src), "v1")
    assert cache_key(str(src), "v2") != k1
    os.utime(src, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert cache_key(str(src), "v1") != k1


def test_prune_drops_gone_sources_then_least_recently_used(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERD_CACHE_DIR", str(tmp_path))
    folder = cache_dir("things")
    os.makedirs(folder)
    sources = {}
    now = time.time()
    for i, name in enumerate(["a", "b", "c", "d", "gone"]):
        entry = os.path.join(folder, name)
        if name == "d":
            os.makedirs(entry)  # entries may be folders (tokenizers)
        else:
            open(entry, "w").close()
        os.utime(entry, (now - 100 + i, now - 100 + i))  # a oldest ... gone newest
        sources[entry] = str(tmp_path / "missing.gguf") if name == "gone" else None
    open(os.path.join(folder, ".tmp-write"), "w").close()  # an entry being written is left alone
    touch(os.path.join(folder, "a"))  # used just now: the most recent
    prune("things", 2, sources.get)
    assert sorted(os.listdir(folder)) == [".tmp-write", "a", "d"]
