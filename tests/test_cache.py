"""The on-disk cache's bookkeeping (inferd/cache.py): keys follow the source files' bytes, and pruning drops
all but the most recently used. (The cached tokenizer and checkpoint
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
    """The digest is read from ``digests/`` while the file's path, size, times, inode and device are unchanged (so a
    start does not read a model file again); a file rewritten in place is hashed again even with its mtime put
    back (its status-change time moved), and a damaged memo is recomputed."""
    monkeypatch.setenv("INFERD_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "model.gguf"
    src.write_bytes(b"a" * 10)
    st = os.stat(src)
    assert file_digest(str(src)) == hashlib.sha256(b"a" * 10).hexdigest()
    (memo,) = os.listdir(cache_dir("digests"))
    memo_path = tmp_path / "cache" / "digests" / memo
    memo_path.write_text("0" * 64)  # what the memo says is what is answered: it is read, not the file
    assert file_digest(str(src)) == "0" * 64
    time.sleep(0.01)
    with open(src, "r+b") as f:  # rewritten in place, same size, mtime put back (as cp -p or tar would)
        f.write(b"c" * 10)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_digest(str(src)) == hashlib.sha256(b"c" * 10).hexdigest()
    for memo in os.listdir(cache_dir("digests")):
        (tmp_path / "cache" / "digests" / memo).write_text("not a digest")
    assert file_digest(str(src)) == hashlib.sha256(b"c" * 10).hexdigest()


def test_prune_keeps_the_most_recently_used(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERD_CACHE_DIR", str(tmp_path))
    folder = cache_dir("things")
    os.makedirs(folder)
    now = time.time()
    for i, name in enumerate(["a", "b", "c", "d"]):
        entry = os.path.join(folder, name)
        if name == "d":
            os.makedirs(entry)  # entries may be folders (tokenizers)
        else:
            open(entry, "w").close()
        os.utime(entry, (now - 100 + i, now - 100 + i))  # a oldest ... d newest
    open(os.path.join(folder, ".tmp-write"), "w").close()  # an entry being written is left alone
    touch(os.path.join(folder, "a"))  # used just now: the most recent
    prune("things", 2)
    assert sorted(os.listdir(folder)) == [".tmp-write", "a", "d"]
