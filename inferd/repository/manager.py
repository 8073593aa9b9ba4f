"""Loading, reloading and unloading model versions: Triton's model control modes.

- ``none``: every model of the repository is loaded at start; later changes on disk are ignored.
- ``poll``: the same, then the repository is rescanned every ``poll_interval`` seconds: new models and
  versions load, removed ones unload, and a version whose files or config changed is reloaded.
- ``explicit``: only the models named at start load; the repository API (``load``, ``unload``,
  ``index``) does the rest.

A (re)load builds the new version completely, checksums, instances and warmup included, before it
replaces the old one; requests already queued on the old one finish there, and a failed reload leaves
the old one serving. Source: Triton Inference Server, docs/user_guide/model_management.md.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from inferd.backends.base import Backend, BackendError
from inferd.batching.dynamic_batcher import DynamicBatcher
from inferd.batching.metrics import ModelMetrics
from inferd.repository.config import DTYPE_NAMES, ModelConfigError
from inferd.repository.repository import (IntegrityError, ModelSource, read_model, scan_repository,
                                          verify_checksums, version_fingerprint)

logger = logging.getLogger("inferd.repository")

CONTROL_MODES = ("none", "poll", "explicit")


class ModelNotFoundError(LookupError):
    """No such model (or version) in the repository or among the loaded ones (HTTP 404)."""


class ModelUnavailableError(RuntimeError):
    """The model exists but no version of it is ready (HTTP 503)."""


@dataclass
class LoadedVersion:
    """A ready model version: a dynamic batcher over its instances, or an LLM engine.

    Attributes:
        fingerprint: of the version folder and config when it loaded (poll mode compares it).
        verified: SHA256SUMS was present and matched.
    """

    name: str
    version: int
    config: mc.ModelConfig
    fingerprint: str
    batcher: DynamicBatcher | None = None
    llm: object | None = None  # AsyncLLMEngine
    verified: bool = False
    tokenizer: object | None = None  # embedding models: the SentenceEncoder of instance 0
    loaded_at: float = field(default_factory=time.time)

    @property
    def backend(self) -> str:
        return self.config.backend

    def retire(self, drain_timeout: float = 60.0) -> None:
        """Stop taking requests, let the ones already queued or running finish, then free everything."""
        if self.batcher is not None:
            self.batcher.close(drain_timeout)
        if self.llm is not None:
            deadline = time.monotonic() + drain_timeout
            while self.llm.engine.has_unfinished() and time.monotonic() < deadline:
                time.sleep(0.05)
            self.llm.shutdown()


@dataclass
class _ModelEntry:
    versions: dict[int, LoadedVersion] = field(default_factory=dict)
    status: dict[int, tuple[str, str]] = field(default_factory=dict)  # version -> (state, reason)
    config_fingerprint: str = ""
    error: str = ""
    failed: dict[int, str] = field(default_factory=dict)  # version -> fingerprint that failed to load
    counts_for_readiness: bool = True


class ModelManager:
    """The models a server hosts.

    Args:
        registry: Prometheus registry for per-model metrics.
        repository: the repository folder, or None (then only ``static`` models).
        control_mode: ``none``, ``poll`` or ``explicit``.
        poll_interval: seconds between rescans in poll mode.
        startup_models: in explicit mode, the models to load at start (``*`` = all).
        static: models defined in code, not on disk, as ``{name: (config, version_dir or EngineConfig)}``
            (``inferd serve --model`` serves its LLM this way).
        engine_setup: called as ``engine_setup(name, engine)`` with each LLM engine loaded, before it
            serves (the gateway sets its waiting bound and input guard).
        on_static_error: called as ``on_static_error(name, message)`` when a static model fails to load at
            start (``inferd serve`` then exits with the message, as vLLM does, instead of answering 503).
    """

    def __init__(self, registry, repository: str | None = None, control_mode: str = "none",
                 poll_interval: float = 15.0, startup_models: tuple[str, ...] = (),
                 static: dict | None = None, engine_setup=None, on_static_error=None) -> None:
        if control_mode not in CONTROL_MODES:
            raise ValueError(f"model control mode must be one of {', '.join(CONTROL_MODES)}")
        if repository is not None and not os.path.isdir(repository):
            raise FileNotFoundError(f"model repository {repository!r} is not a folder")
        self.registry = registry
        self.repository = repository
        self.control_mode = control_mode
        self.poll_interval = poll_interval
        self.startup_models = tuple(startup_models)
        self.static = dict(static or {})
        self.engine_setup = engine_setup
        self.on_static_error = on_static_error
        self._entries: dict[str, _ModelEntry] = {}
        self._lock = threading.RLock()  # guards _entries
        self._load_lock = threading.Lock()  # one (re)load at a time
        self._stop = threading.Event()
        self.started = False  # the startup loads are done
        self._threads: list[threading.Thread] = []

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self, background: bool = True) -> None:
        """Load the startup models (on a thread when ``background``), then poll in poll mode."""
        def run():
            self._startup()
            if self.control_mode == "poll" and self.repository:
                while not self._stop.wait(self.poll_interval):
                    try:
                        self.sync()
                    except Exception:  # noqa: BLE001 - keep polling
                        logger.exception("repository poll failed")

        if background:
            t = threading.Thread(target=run, name="inferd-repository", daemon=True)
            t.start()
            self._threads.append(t)
        else:
            run()

    def _startup(self) -> None:
        try:
            self._startup_loads()
        except Exception:  # noqa: BLE001 - readiness says the rest; the server keeps serving what loaded
            logger.exception("loading the models at start failed")
        finally:
            self.started = True

    def _startup_loads(self) -> None:
        for name, (cfg, source) in self.static.items():
            self._load_static(name, cfg, source)
        if self.repository:
            if self.control_mode == "explicit":
                names = None if "*" in self.startup_models else self.startup_models
                for name in (names if names is not None else scan_repository(self.repository)):
                    try:
                        self.load(name)
                    except (ModelNotFoundError, BackendError, ModelConfigError, IntegrityError) as e:
                        logger.error("cannot load %s: %s", name, e)
            else:
                self.sync()

    def stop(self) -> None:
        """Stop polling and retire every loaded version."""
        self._stop.set()
        with self._lock:
            loaded = [lv for e in self._entries.values() for lv in e.versions.values()]
            self._entries.clear()
        for lv in loaded:
            lv.retire(drain_timeout=5.0)

    # -- lookup ------------------------------------------------------------------------------------

    def get(self, name: str, version: int | None = None) -> LoadedVersion:
        """The ready version ``version`` of ``name`` (None = the highest ready version).

        Raises:
            ModelNotFoundError: unknown model, or that version is not loaded.
            ModelUnavailableError: the model is known but nothing of it is ready.
        """
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or (not entry.versions and not entry.status and not entry.error):
                if not self.started and (name in self.static or (
                        self.repository and self.control_mode != "explicit" and
                        _is_model_folder(self.repository, name))):
                    raise ModelUnavailableError(f"model {name!r} is loading")
                raise ModelNotFoundError(f"model {name!r} is not found")
            if version is None:
                if not entry.versions:
                    reason = entry.error or next((r for _, r in entry.status.values() if r), "")
                    raise ModelUnavailableError(f"model {name!r} is not ready" + (f": {reason}" if reason else ""))
                return entry.versions[max(entry.versions)]
            lv = entry.versions.get(version)
            if lv is None:
                state = entry.status.get(version)
                if state is None:
                    raise ModelNotFoundError(f"model {name!r} has no version {version}")
                raise ModelUnavailableError(f"model {name!r} version {version} is not ready"
                                            + (f": {state[1]}" if state[1] else ""))
            return lv

    def ready_models(self) -> list[LoadedVersion]:
        """The highest ready version of every model."""
        with self._lock:
            return [e.versions[max(e.versions)] for _, e in sorted(self._entries.items()) if e.versions]

    def is_ready(self) -> bool:
        """Startup is done and every model the server knows has a ready version (Triton's strict
        readiness: a model that failed to load makes the server not ready)."""
        if not self.started:
            return False
        with self._lock:
            return all(e.versions for e in self._entries.values() if e.counts_for_readiness)

    def index(self) -> list[dict]:
        """Triton's repository index: every model folder and loaded version with its state and reason."""
        found = scan_repository(self.repository) if self.repository else {}
        out = []
        with self._lock:
            names = sorted(set(found) | set(self._entries))
            for name in names:
                entry = self._entries.get(name)
                if entry is None or (not entry.status and not entry.error):
                    out.append({"name": name})
                    continue
                if entry.error and not entry.status:
                    out.append({"name": name, "state": "UNAVAILABLE", "reason": entry.error})
                for v, (state, reason) in sorted(entry.status.items()):
                    if entry.error and state == "READY":
                        reason = f"config.pbtxt change not applied, still serving the loaded version: {entry.error}"
                    out.append({"name": name, "version": str(v), "state": state, "reason": reason})
        return out

    # -- control -----------------------------------------------------------------------------------

    def sync(self) -> None:
        """Bring every model of the repository in line with the disk (none and poll modes)."""
        found = scan_repository(self.repository)
        for name, src in found.items():
            try:
                self._sync_model(src)
            except Exception:  # noqa: BLE001 - one model's bug must not stop the others from syncing
                logger.exception("model %s: sync failed", name)
        with self._lock:
            gone = [n for n in self._entries if n not in found and n not in self.static]
        for name in gone:
            self.unload(name)

    def load(self, name: str) -> None:
        """Load (or reload what changed of) one model of the repository (explicit mode's load).

        Raises:
            ModelNotFoundError: no such folder.
            ModelConfigError, BackendError, IntegrityError: nothing of the model could be served (the
                message says why); a version already serving keeps serving.
        """
        if not self.repository or not _is_model_folder(self.repository, name):
            raise ModelNotFoundError(f"model {name!r} is not found in the repository")
        src = read_model(self.repository, name)
        self._sync_model(src)
        with self._lock:
            entry = self._entries.get(name)
            if entry is not None and not entry.versions and self.started:
                entry.counts_for_readiness = False  # a failed load call is the caller's error, not the server's
            if entry is None or not entry.versions:
                reason = (entry.error if entry else "") or next(
                    (r for _, r in (entry.status.values() if entry else []) if r), "no version to load")
                raise BackendError(f"failed to load {name!r}: {reason}")

    def unload(self, name: str) -> None:
        """Unload every version of a model; queued and running requests finish first.

        Raises:
            ModelNotFoundError: the model is not loaded.
        """
        with self._load_lock, self._lock:  # not while a load of it is half done
            entry = self._entries.pop(name, None)
        if entry is None:
            raise ModelNotFoundError(f"model {name!r} is not loaded")
        for lv in entry.versions.values():
            lv.retire()
        logger.info("unloaded %s", name)

    # -- loading -----------------------------------------------------------------------------------

    def _sync_model(self, src: ModelSource) -> None:
        with self._load_lock:
            with self._lock:
                entry = self._entries.setdefault(src.name, _ModelEntry())
            if src.config is None:
                with self._lock:
                    if entry.error != src.error:  # log a broken config once, not on every poll
                        logger.error("model %s: %s", src.name, src.error)
                    entry.error = src.error or "unreadable config"
                return
            with self._lock:
                entry.error = ""
                config_changed = entry.config_fingerprint != src.fingerprint
                entry.config_fingerprint = src.fingerprint
                current = dict(entry.versions)
            if not src.versions:
                with self._lock:
                    entry.error = "no version folder matches the version policy"
            for v in src.versions:
                vdir = os.path.join(src.path, str(v))
                fp = src.fingerprint + version_fingerprint(vdir)
                old = current.get(v)
                if old is not None and old.fingerprint == fp and not config_changed:
                    continue
                if entry.failed.get(v) == fp:
                    continue  # failed before and unchanged since: do not retry on every poll
                with self._lock:
                    entry.status[v] = ("LOADING", "") if old is None else ("READY", "reloading")
                try:
                    lv = self._load_version(src.name, v, src.config, vdir, fp)
                except Exception as e:  # noqa: BLE001 - recorded; a bug in one backend must not wedge the poll
                    if not isinstance(e, (BackendError, IntegrityError, OSError, ValueError)):
                        logger.exception("model %s version %d: unexpected error while loading", src.name, v)
                        e = BackendError(f"unexpected error while loading: {type(e).__name__}: {e}")
                    logger.error("model %s version %d failed to load: %s", src.name, v, e)
                    with self._lock:
                        entry.failed[v] = fp
                        entry.status[v] = (("READY", f"reload failed, still serving the loaded files: {e}")
                                           if old is not None else ("UNAVAILABLE", str(e)))
                    continue
                with self._lock:
                    entry.failed.pop(v, None)
                    entry.versions[v] = lv
                    entry.status[v] = ("READY", "")
                if old is not None:
                    threading.Thread(target=old.retire, daemon=True, name=f"inferd-retire-{src.name}").start()
                logger.info("model %s version %d is ready", src.name, v)
            with self._lock:
                serving_new = any(v in entry.versions for v in src.versions)
            # Versions the policy no longer selects unload, unless none of the selected ones loaded: then
            # the old ones keep serving (a broken or tampered new version must not take the model down).
            with self._lock:  # forget failed versions that are gone from the disk or the policy
                for v in [v for v in entry.status if v not in src.versions and v not in entry.versions]:
                    entry.status.pop(v)
                    entry.failed.pop(v, None)
            for v in [v for v in current if v not in src.versions and serving_new]:
                with self._lock:
                    lv = entry.versions.pop(v, None)
                    entry.status.pop(v, None)
                if lv is not None:
                    threading.Thread(target=lv.retire, daemon=True).start()
                    logger.info("model %s version %d unloaded", src.name, v)

    def _load_static(self, name: str, cfg: mc.ModelConfig, source) -> None:
        entry = _ModelEntry()
        with self._lock:
            self._entries[name] = entry
            entry.status[1] = ("LOADING", "")
        try:
            lv = self._load_version(name, 1, cfg, source, "static")
        except Exception as e:  # noqa: BLE001 - whatever it is, this model is not served: say why
            if isinstance(e, (BackendError, OSError, ValueError)):
                reason = str(e)
                logger.error("model %s failed to load: %s", name, reason)
            else:  # not an error the load anticipates: the traceback goes to the log
                reason = f"{type(e).__name__}: {e}"
                logger.exception("model %s failed to load", name)
            with self._lock:
                entry.status[1] = ("UNAVAILABLE", reason)
            if self.on_static_error is not None:
                self.on_static_error(name, reason)
            return
        with self._lock:
            entry.versions[1] = lv
            entry.status[1] = ("READY", "")

    def _load_version(self, name: str, version: int, config: mc.ModelConfig, source, fingerprint: str
                      ) -> LoadedVersion:
        """Build one version: checksums, instances, warmup.

        Raises:
            IntegrityError, BackendError.
        """
        t0 = time.perf_counter()
        cfg = mc.ModelConfig()
        cfg.CopyFrom(config)
        verified = False
        if isinstance(source, str):
            verified = verify_checksums(source)
        if cfg.backend == "llm":
            from inferd.backends import llm

            llm.declare_tensors(cfg)
            engine_cfg = source if not isinstance(source, str) else llm.engine_config(cfg, source, _device(cfg))
            engine = llm.load_engine(engine_cfg, self.registry)
            if self.engine_setup is not None:
                self.engine_setup(name, engine)
            return LoadedVersion(name, version, cfg, fingerprint, llm=engine, verified=verified)
        instances = []
        try:
            for group in cfg.instance_group:
                for i in range(group.count):
                    instances.append(_make_backend(cfg, source, _device(cfg, group, i)))
            for inst in instances:
                _warmup(inst, cfg)
        except BaseException:
            for inst in instances:
                inst.close()
            raise
        batcher = DynamicBatcher(cfg, instances, ModelMetrics(self.registry, name, version))
        tokenizer = getattr(instances[0], "encoder", None)
        logger.info("loaded %s version %d (%s, %d instance(s)) in %.2f s", name, version, cfg.backend,
                    len(instances), time.perf_counter() - t0)
        return LoadedVersion(name, version, cfg, fingerprint, batcher=batcher, verified=verified,
                             tokenizer=tokenizer)


def _device(cfg: mc.ModelConfig, group: mc.ModelInstanceGroup | None = None, index: int = 0) -> str:
    import torch

    group = group or cfg.instance_group[0]
    if group.kind == mc.ModelInstanceGroup.KIND_GPU:
        if not torch.cuda.is_available():
            raise BackendError(f"instance_group kind KIND_GPU for {cfg.name!r}, but this machine has no CUDA GPU")
        gpus = list(group.gpus) or list(range(torch.cuda.device_count()))
        return f"cuda:{gpus[index % len(gpus)]}"
    if group.kind == mc.ModelInstanceGroup.KIND_AUTO and cfg.backend != "onnxruntime" and torch.cuda.is_available():
        return "cuda:0"
    return "cpu"


def _make_backend(cfg: mc.ModelConfig, version_dir: str, device: str) -> Backend:
    if cfg.backend == "onnxruntime":
        from inferd.backends.onnxruntime import OnnxRuntimeBackend as cls
    elif cfg.backend == "pytorch":
        from inferd.backends.pytorch import PyTorchBackend as cls
    elif cfg.backend == "embedding":
        from inferd.backends.embedding import EmbeddingBackend as cls
    else:  # pragma: no cover - parse_config allows no other
        raise BackendError(f"backend {cfg.backend!r} is not supported")
    return cls(version_dir, cfg, device)


def _warmup(instance: Backend, cfg: mc.ModelConfig) -> None:
    """Run the config's ``model_warmup`` samples on one instance (Triton: before the model is ready).

    Raises:
        BackendError: a warmup sample failed.
    """
    rng = np.random.default_rng(0)
    for w in cfg.model_warmup:
        inputs = {}
        for name, spec in w.inputs.items():
            shape = ([w.batch_size] if cfg.max_batch_size else []) + list(spec.dims)
            dtype_name = DTYPE_NAMES[spec.data_type]
            if dtype_name == "STRING":
                value = b"" if spec.HasField("zero_data") else b"warmup"
                arr = np.full(shape, value, dtype=object)
            else:
                np_dtype = np.dtype(dtype_name.lower().replace("fp", "float")) if dtype_name != "BOOL" else np.bool_
                arr = (np.zeros(shape, np_dtype) if spec.HasField("zero_data")
                       else rng.random(shape).astype(np_dtype))
            inputs[name] = arr
        for _ in range(max(1, w.count)):
            try:
                instance.execute(inputs)
            except Exception as e:  # noqa: BLE001
                raise BackendError(f"warmup {w.name!r} failed: {e}") from e


def _is_model_folder(root: str, name: str) -> bool:
    """``name`` is a plain folder name directly inside the repository (no path, no hidden folder)."""
    return (bool(name) and name not in (".", "..") and not name.startswith(".") and "/" not in name
            and "\\" not in name and "\0" not in name and os.path.isdir(os.path.join(root, name)))
