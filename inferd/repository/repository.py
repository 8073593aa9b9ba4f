"""Reading a model repository from disk: models, versions, version policies and SHA256SUMS.

Layout (Triton's): ``<root>/<model>/config.pbtxt`` and ``<root>/<model>/<version>/...`` where a version
is a folder named by a positive integer. A version folder may carry ``SHA256SUMS`` in the format
``sha256sum`` writes (``<64 hex digits>  <relative path>`` per line); when it does, every other file in the
folder must be listed and match, or the version is refused.

Source: Triton Inference Server, docs/user_guide/model_repository.md.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from tritonclient.grpc import model_config_pb2 as mc

from inferd.cache import sha256_file
from inferd.repository.config import ModelConfigError, parse_config

CHECKSUM_FILE = "SHA256SUMS"


class IntegrityError(Exception):
    """A version's files do not match its SHA256SUMS; the message names the file."""


@dataclass(frozen=True)
class ModelSource:
    """A model folder as found on disk.

    Attributes:
        name: the folder name (= the model name clients use).
        config: the parsed config, or None when ``error`` says why it could not be read.
        versions: the version numbers the version policy selects, ascending.
        fingerprint: changes whenever config.pbtxt changes (poll mode reloads the model then).
    """

    name: str
    path: str
    config: mc.ModelConfig | None
    versions: tuple[int, ...]
    fingerprint: str
    error: str | None = None


def scan_repository(root: str) -> dict[str, ModelSource]:
    """Every model folder under ``root`` (hidden folders skipped), by name.

    Raises:
        FileNotFoundError: ``root`` is not a folder.
    """
    if not os.path.isdir(root):
        raise FileNotFoundError(f"model repository {root!r} is not a folder")
    return {name: read_model(root, name) for name in sorted(os.listdir(root))
            if not name.startswith(".") and os.path.isdir(os.path.join(root, name))}


def read_model(root: str, name: str) -> ModelSource:
    """Read one model folder; a config error is recorded in ``error`` instead of raised."""
    path = os.path.join(root, name)
    cfg_path = os.path.join(path, "config.pbtxt")
    try:
        with open(cfg_path, "rb") as f:
            raw = f.read()
    except OSError:
        return ModelSource(name, path, None, (), "", f"{name}/config.pbtxt is missing")
    fingerprint = hashlib.sha256(raw).hexdigest()
    try:
        cfg = parse_config(raw.decode("utf-8"), name)
    except (ModelConfigError, UnicodeDecodeError) as e:
        return ModelSource(name, path, None, (), fingerprint, str(e))
    available = sorted(int(d) for d in os.listdir(path)
                       if d.isdigit() and int(d) > 0 and os.path.isdir(os.path.join(path, d)))
    return ModelSource(name, path, cfg, select_versions(cfg.version_policy, available), fingerprint)


def select_versions(policy: mc.ModelVersionPolicy, available: list[int]) -> tuple[int, ...]:
    """The versions to serve under ``policy`` (Triton's ``latest`` N, ``all``, ``specific``)."""
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        return tuple(available)
    if which == "specific":
        return tuple(v for v in available if v in set(policy.specific.versions))
    n = policy.latest.num_versions or 1
    return tuple(available[-n:])


def version_fingerprint(version_dir: str) -> str:
    """A digest of the folder's file names, sizes and modification times (cheap: no file is read);
    poll mode reloads a version when it changes."""
    h = hashlib.sha256()
    for rel in _files(version_dir):
        st = os.stat(os.path.join(version_dir, rel))
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def verify_checksums(version_dir: str) -> bool:
    """Check the folder against its SHA256SUMS, if it has one.

    Returns:
        True when SHA256SUMS was present and everything matched, False when there is none.

    Raises:
        IntegrityError: a listed file is missing or differs, a file is not listed, or SHA256SUMS is
            malformed; the message names the file.
    """
    sums_path = os.path.join(version_dir, CHECKSUM_FILE)
    if not os.path.isfile(sums_path):
        return False
    expected: dict[str, str] = {}
    with open(sums_path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            digest, sep, rel = line.partition(" ")
            rel = rel.lstrip(" *")
            if not sep or len(digest) != 64 or not rel or any(c not in "0123456789abcdefABCDEF" for c in digest):
                raise IntegrityError(f"{CHECKSUM_FILE} line {n} is not '<sha256>  <file>'")
            expected[os.path.normpath(rel)] = digest.lower()
    present = set(_files(version_dir)) - {CHECKSUM_FILE}
    for rel in sorted(present - set(expected)):
        raise IntegrityError(f"{rel} is not listed in {CHECKSUM_FILE}")
    for rel, digest in sorted(expected.items()):
        if rel not in present:
            raise IntegrityError(f"{rel} is listed in {CHECKSUM_FILE} but missing")
        actual = sha256_file(os.path.join(version_dir, rel))
        if actual != digest:
            raise IntegrityError(f"{rel} does not match {CHECKSUM_FILE} (expected sha256 {digest[:16]}..., "
                                 f"file has {actual[:16]}...)")
    return True


def write_checksums(version_dir: str) -> None:
    """Write SHA256SUMS for every file in the folder (what ``sha256sum`` would write)."""
    lines = [f"{sha256_file(os.path.join(version_dir, rel))}  {rel}\n"
             for rel in _files(version_dir) if rel != CHECKSUM_FILE]
    with open(os.path.join(version_dir, CHECKSUM_FILE), "w", encoding="utf-8") as f:
        f.writelines(lines)



def _files(folder: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        for fn in sorted(filenames):
            out.append(os.path.relpath(os.path.join(dirpath, fn), folder))
    return out
