"""Triton's ``config.pbtxt``: parsed with protobuf's text format against Triton's ``model_config.proto``
(the ``ModelConfig`` message that ``tritonclient`` ships as ``tritonclient.grpc.model_config_pb2``), then
checked field by field: inferd honours a subset of the fields, and a field it does not honour is an error
at load, never silently ignored.

Source: Triton Inference Server, docs/user_guide/model_configuration.md and
src/core/model_config.proto (https://github.com/triton-inference-server/common).
"""

from __future__ import annotations

from google.protobuf import text_format
from google.protobuf.descriptor import FieldDescriptor
from tritonclient.grpc import model_config_pb2 as mc

BACKENDS = ("onnxruntime", "pytorch", "embedding", "llm")
# Triton's platform names, for configs that give a platform instead of a backend.
_PLATFORMS = {"onnxruntime_onnx": "onnxruntime", "pytorch_libtorch": "pytorch", "pytorch_torch_export": "pytorch"}

# Every field path inferd honours; any other field set in a config is refused.
HONOURED_FIELDS = frozenset({
    "name", "platform", "backend", "max_batch_size", "default_model_filename", "parameters",
    "version_policy.latest.num_versions", "version_policy.all", "version_policy.specific.versions",
    "input.name", "input.data_type", "input.dims", "input.optional",
    "output.name", "output.data_type", "output.dims",
    "dynamic_batching.preferred_batch_size", "dynamic_batching.max_queue_delay_microseconds",
    "dynamic_batching.preserve_ordering",
    "dynamic_batching.default_queue_policy.timeout_action",
    "dynamic_batching.default_queue_policy.default_timeout_microseconds",
    "dynamic_batching.default_queue_policy.allow_timeout_override",
    "dynamic_batching.default_queue_policy.max_queue_size",
    "instance_group.name", "instance_group.kind", "instance_group.count", "instance_group.gpus",
    "model_warmup.name", "model_warmup.batch_size", "model_warmup.count", "model_warmup.inputs",
    "model_warmup.inputs.data_type", "model_warmup.inputs.dims", "model_warmup.inputs.zero_data",
    "model_warmup.inputs.random_data",
})

# Parameters (the config's ``parameters`` map) each backend understands.
BACKEND_PARAMETERS = {
    "onnxruntime": {"intra_op_thread_count"},
    "pytorch": {"num_threads", "batch_invariant"},
    "embedding": {"num_threads", "batch_invariant"},
    "llm": {"model_file", "served_model_name", "dtype", "max_model_len", "kv_cache_memory_bytes",
            "max_num_seqs", "max_num_batched_tokens", "max_prefill_tokens_with_decodes", "enable_prefix_caching",
            "batch_invariant"},
}

DTYPE_NAMES = {v: k[len("TYPE_"):] for k, v in mc.DataType.items() if k != "TYPE_INVALID"}


class ModelConfigError(ValueError):
    """config.pbtxt is unreadable, inconsistent, or sets a field inferd does not honour."""


def parse_config(text: str, model_name: str) -> mc.ModelConfig:
    """Parse and validate the text of ``<repository>/<model_name>/config.pbtxt``.

    Returns:
        the ``ModelConfig`` message with ``name`` and ``backend`` filled in (a ``platform`` is mapped to its
        backend) and defaults applied: one CPU instance, version policy latest 1.

    Raises:
        ModelConfigError: a text-format syntax error, an unknown or unhonoured field, or inconsistent
            values (the message names the field).
    """
    cfg = mc.ModelConfig()
    try:
        text_format.Parse(text, cfg)
    except text_format.ParseError as e:
        raise ModelConfigError(f"config.pbtxt of {model_name!r}: {e}") from None
    for path in _set_fields(cfg):
        if path not in HONOURED_FIELDS and not any(h.startswith(path + ".") for h in HONOURED_FIELDS):
            raise ModelConfigError(f"config.pbtxt of {model_name!r}: field {path!r} is not supported by inferd "
                                   f"(remove it; supported fields are listed in docs/model_repository.md)")
    _validate(cfg, model_name)
    return cfg


def _set_fields(msg, prefix: str = ""):
    """Yield the dotted path of every field set in ``msg`` (recursing into messages, lists and maps)."""
    for field, value in msg.ListFields():
        path = prefix + field.name
        is_map = field.message_type is not None and field.message_type.GetOptions().map_entry
        if is_map:
            yield path
            vfield = field.message_type.fields_by_name["value"]
            if vfield.type == FieldDescriptor.TYPE_MESSAGE and path != "parameters":
                for v in value.values():
                    yield from _set_fields(v, path + ".")
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            items = value if field.is_repeated else [value]
            if not any(item.ListFields() for item in items):
                yield path  # an empty message that is present, e.g. ``dynamic_batching {}``
            for item in items:
                for sub in _set_fields(item, path + "."):
                    yield sub
        else:
            yield path


def _validate(cfg: mc.ModelConfig, model_name: str) -> None:
    where = f"config.pbtxt of {model_name!r}"

    def fail(msg: str):
        raise ModelConfigError(f"{where}: {msg}")

    if cfg.name and cfg.name != model_name:
        fail(f"name {cfg.name!r} differs from the folder name {model_name!r}")
    cfg.name = model_name
    if cfg.platform:
        if cfg.platform not in _PLATFORMS:
            fail(f"platform {cfg.platform!r} is not supported (supported: {', '.join(_PLATFORMS)})")
        if cfg.backend and cfg.backend != _PLATFORMS[cfg.platform]:
            fail(f"platform {cfg.platform!r} and backend {cfg.backend!r} disagree")
        cfg.backend = _PLATFORMS[cfg.platform]
    if not cfg.backend:
        fail(f"set backend to one of {', '.join(BACKENDS)}")
    if cfg.backend not in BACKENDS:
        fail(f"backend {cfg.backend!r} is not supported (supported: {', '.join(BACKENDS)})")
    for key in cfg.parameters:
        if key not in BACKEND_PARAMETERS[cfg.backend]:
            fail(f"parameter {key!r} is not understood by the {cfg.backend} backend "
                 f"(it understands: {', '.join(sorted(BACKEND_PARAMETERS[cfg.backend]))})")
    if cfg.max_batch_size < 0:
        fail("max_batch_size must be >= 0")
    if cfg.backend != "llm" and (not cfg.input or not cfg.output):
        fail("declare the model's input and output tensors")
    names: set[str] = set()
    for kind, tensors in (("input", cfg.input), ("output", cfg.output)):
        for t in tensors:
            if not t.name:
                fail(f"an {kind} has no name")
            if t.name in names:
                fail(f"tensor name {t.name!r} is declared twice")
            names.add(t.name)
            if t.data_type == mc.TYPE_INVALID:
                fail(f"{kind} {t.name!r} needs a data_type")
            if not t.dims and cfg.max_batch_size == 0:
                fail(f"{kind} {t.name!r} needs dims")
            if any(d < -1 or d == 0 for d in t.dims):
                fail(f"{kind} {t.name!r}: dims must be positive or -1 (variable), got {list(t.dims)}")
    db = cfg.dynamic_batching if cfg.HasField("dynamic_batching") else None
    if db is not None:
        if cfg.max_batch_size == 0:
            fail("dynamic_batching needs max_batch_size > 0")
        for p in db.preferred_batch_size:
            if not 1 <= p <= cfg.max_batch_size:
                fail(f"preferred_batch_size {p} is outside [1, max_batch_size={cfg.max_batch_size}]")
        qp = db.default_queue_policy
        if qp.timeout_action != mc.ModelQueuePolicy.REJECT:
            fail("default_queue_policy.timeout_action DELAY is not supported (use REJECT)")
    if cfg.backend == "llm":
        if cfg.max_batch_size or db is not None:
            fail("the llm backend batches continuously by itself: leave out max_batch_size and dynamic_batching")
        if cfg.input or cfg.output:
            fail("the llm backend declares its own tensors (text_input, text_output): leave out input and output")
    if not cfg.instance_group:
        cfg.instance_group.add(kind=mc.ModelInstanceGroup.KIND_AUTO, count=1)
    for g in cfg.instance_group:
        if g.kind not in (mc.ModelInstanceGroup.KIND_AUTO, mc.ModelInstanceGroup.KIND_CPU,
                          mc.ModelInstanceGroup.KIND_GPU):
            fail(f"instance_group kind {mc.ModelInstanceGroup.Kind.Name(g.kind)} is not supported")
        if g.count < 0:
            fail("instance_group count must be >= 0")
        if g.count == 0:
            g.count = 1
        if g.gpus and g.kind != mc.ModelInstanceGroup.KIND_GPU:
            fail("instance_group gpus needs kind KIND_GPU")
    if cfg.backend == "llm" and (len(cfg.instance_group) != 1 or cfg.instance_group[0].count != 1):
        fail("the llm backend runs one instance (one engine batches all requests)")
    vp = cfg.version_policy
    which = vp.WhichOneof("policy_choice")
    if which is None:
        vp.latest.num_versions = 1
    elif which == "latest" and vp.latest.num_versions < 1:
        fail("version_policy latest needs num_versions >= 1")
    elif which == "specific" and not vp.specific.versions:
        fail("version_policy specific needs at least one version")
    for w in cfg.model_warmup:
        if not w.inputs:
            fail(f"model_warmup {w.name!r} has no inputs")
        if cfg.max_batch_size and not 1 <= w.batch_size <= cfg.max_batch_size:
            fail(f"model_warmup {w.name!r}: batch_size must be in [1, max_batch_size]")
        declared = {t.name: t for t in cfg.input}
        for name, inp in w.inputs.items():
            if name not in declared:
                fail(f"model_warmup {w.name!r}: input {name!r} is not a declared input")
            if inp.data_type != declared[name].data_type:
                fail(f"model_warmup {w.name!r}: input {name!r} needs data_type "
                     f"{mc.DataType.Name(declared[name].data_type)}")
            if inp.data_type == mc.TYPE_BF16:
                fail(f"model_warmup {w.name!r}: BF16 warmup data is not supported")
            if inp.WhichOneof("input_data_type") is None:
                fail(f"model_warmup {w.name!r}: input {name!r} needs zero_data or random_data")


def config_to_json(cfg: mc.ModelConfig) -> dict:
    """The config as JSON, as Triton's ``GET /v2/models/{m}/config`` returns it (protobuf JSON mapping
    with the proto's field names)."""
    from google.protobuf import json_format

    return json_format.MessageToDict(cfg, preserving_proto_field_name=True)
