"""The on-disk cache's bookkeeping (inferd/cache.py): keys follow the source files' bytes, and pruning drops
entries whose source is gone and all but the most recently used. (The cached tokenizer and checkpoint
themselves are checked in tests/test_engine.py and tests/test_model.py.)"""

from __future__ import annotations

import hashlib
import os
import time

from inferd.cache import cache_dir, cache_key, file_digest, prune, touch


def test_key_follows_the_bytes_and_the_version(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERD_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "model.gguf"
    src.write_bytes(b"a" * 10)
    k1 = cache_key(str(src), "v1")
    assert len(k1) == 32 and k1 == cache_key(str(src), "v1")
    assert cache_key(str(src), "v2") != k1
    os.utime(src, ns=(time.time_ns(), time.time_ns() + 10**9))  # touched, same bytes: the same entry
    assert cache_key(str(src), "v1") == k1
    (tmp_path / "elsewhere").mkdir()
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.write_bytes(b"a" * 10)
    assert cache_key(str(copy), "v1") == k1
    src.write_bytes(b"b" * 10)
    assert cache_key(str(src), "v1") != k1
    assert file_digest(str(src)) == hashlib.sha256(b"b" * 10).hexdigest()
    # A list of files is keyed by their names and bytes, in order.
    assert cache_key([str(src), str(copy)], "v1") != cache_key([str(copy), str(src)], "v1")


def test_a_file_digest_is_remembered_under_its_stat(tmp_path, monkeypatch):
    """The digest is read from ``digests/`` while path, size, mtime and inode are unchanged (so a start does
    not read a model file again); a damaged memo is recomputed."""
    monkeypatch.setenv("INFERD_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "model.gguf"
    src.write_bytes(b"a" * 10)
    st = os.stat(src)
    assert file_digest(str(src)) == hashlib.sha256(b"a" * 10).hexdigest()
    (memo,) = os.listdir(cache_dir("digests"))
    with open(src, "r+b") as f:  # rewritten in place, stat restored: the remembered digest answers
        f.write(b"c" * 10)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_digest(str(src)) == hashlib.sha256(b"a" * 10).hexdigest()
    (tmp_path / "cache" / "digests" / memo).write_text("not a digest")
    assert file_digest(str(src)) == hashlib.sha256(b"c" * 10).hexdigest()
    assert (tmp_path / "cache" / "digests" / memo).read_text() == hashlib.sha256(b"c" * 10).hexdigest()


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
