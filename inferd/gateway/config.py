"""The gateway's configuration: one YAML file (``inferd serve --config``), validated by pydantic.

The schema, with every default, is documented in docs/gateway.md; unknown keys are errors, so a typo
cannot silently turn a protection off.
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

SCOPES = ("infer", "admin", "metrics")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JWTConfig(_Strict):
    """JWT bearer tokens (RFC 7519), verified with PyJWT. HS256 needs ``secret_file`` (or ``secret_env``);
    RS256 / ES256 need ``jwks_file`` (RFC 7517). ``exp`` is required; ``nbf`` is checked when present."""

    secret_file: str | None = None
    secret_env: str | None = None
    jwks_file: str | None = None
    issuer: str | None = None
    audience: str | None = None
    tenant_claim: str = "sub"
    scopes_claim: str = "scope"
    models_claim: str = "models"
    leeway_s: Annotated[float, Field(ge=0)] = 0.0


class AuthConfig(_Strict):
    """Authentication: on when ``api_keys_file`` or ``jwt`` is set. ``public_paths`` are HTTP paths served
    without credentials (for example ``/health`` for a load balancer's probe); none by default."""

    api_keys_file: str | None = None
    jwt: JWTConfig | None = None
    public_paths: list[str] = []

    @property
    def enabled(self) -> bool:
        return self.api_keys_file is not None or self.jwt is not None


class LimitConfig(_Strict):
    """Requests and tokens (prompt + generated) per minute; None = no limit."""

    requests_per_minute: Annotated[int, Field(ge=1)] | None = None
    tokens_per_minute: Annotated[int, Field(ge=1)] | None = None


class TenantConfig(LimitConfig):
    """A tenant's limits and priority class (higher is scheduled first when requests wait)."""

    priority: int = 0


class ModelPolicy(LimitConfig):
    """Limits of one model, shared by all tenants, and its bound on waiting requests."""

    max_waiting_requests: Annotated[int, Field(ge=0)] | None = None


class SheddingConfig(_Strict):
    """Load shedding and timeouts. Times in seconds."""

    max_waiting_requests: Annotated[int, Field(ge=0)] | None = 1024
    retry_after_s: Annotated[int, Field(ge=1)] = 1
    request_timeout_s: Annotated[float, Field(gt=0)] | None = None
    max_request_timeout_s: Annotated[float, Field(gt=0)] = 3600.0
    drain_timeout_s: Annotated[float, Field(ge=0)] = 30.0
    max_request_body_bytes: Annotated[int, Field(ge=0)] = 100 * 1024**2


class BreakerConfig(_Strict):
    """Circuit breaker per model: ``failure_threshold`` consecutive backend failures open it; after
    ``reset_timeout_s`` one probe request is let through (half-open). 0 disables it."""

    failure_threshold: Annotated[int, Field(ge=0)] = 5
    reset_timeout_s: Annotated[float, Field(gt=0)] = 30.0


class AuditConfig(_Strict):
    """One JSON line per request in a rotating file; prompt and output text only with ``include_text``."""

    file: str | None = None
    max_bytes: Annotated[int, Field(ge=0)] = 100 * 1024**2
    backup_count: Annotated[int, Field(ge=0)] = 5
    include_text: bool = False


class TLSConfig(_Strict):
    """TLS for HTTP and gRPC; ``ca_certfile`` turns on mutual TLS (client certificates required)."""

    certfile: str | None = None
    keyfile: str | None = None
    ca_certfile: str | None = None


class TracingConfig(_Strict):
    """OpenTelemetry: spans exported over OTLP/HTTP (protobuf) to ``otlp_endpoint`` (the collector's base
    URL, e.g. http://127.0.0.1:4318; ``/v1/traces`` is appended)."""

    otlp_endpoint: str | None = None
    service_name: str = "inferd"
    export_delay_ms: Annotated[int, Field(ge=1)] = 5000

    @field_validator("otlp_endpoint")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^https?://[^\s/]+", v):
            raise ValueError("must be an http:// or https:// URL (the collector's OTLP/HTTP base)")
        return v


class GuardRule(_Strict):
    name: Annotated[str, Field(min_length=1)]
    pattern: str
    ignore_case: bool = True

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"not a regular expression: {e}") from None
        return v


class GuardConfig(_Strict):
    """Checks on every prompt before it is scheduled: regular-expression ``rules`` and ``plugins``
    (``module:function`` names; the function takes the prompt text and returns None or the rule it broke)."""

    rules: list[GuardRule] = []
    plugins: list[str] = []


class GatewayConfig(_Strict):
    """The whole file. ``tenants['default']`` applies to tenants not listed, and to every request when
    authentication is off (tenant ``anonymous``)."""

    auth: AuthConfig = AuthConfig()
    tenants: dict[str, TenantConfig] = {}
    models: dict[str, ModelPolicy] = {}
    rate_limit_storage: str = "memory://"
    shedding: SheddingConfig = SheddingConfig()
    circuit_breaker: BreakerConfig = BreakerConfig()
    audit: AuditConfig = AuditConfig()
    tls: TLSConfig = TLSConfig()
    tracing: TracingConfig = TracingConfig()
    input_guard: GuardConfig = GuardConfig()

    def tenant(self, name: str) -> TenantConfig:
        return self.tenants.get(name) or self.tenants.get("default") or TenantConfig()


class ConfigError(ValueError):
    """The gateway configuration file is missing, not YAML, or does not match the schema."""


def load_config(path: str | None) -> GatewayConfig:
    """Read and validate a gateway YAML file (None: all defaults).

    Raises:
        ConfigError: with the file and the first offending key.
    """
    if path is None:
        return GatewayConfig()
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror}") from None
    except yaml.YAMLError as e:  # one line: the problem and where (PyYAML's message spans several)
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML: {getattr(e, 'problem', None) or ' '.join(str(e).split())}{where}") \
            from None
    return validate_config(doc or {}, path)


def validate_config(doc, source: str) -> GatewayConfig:
    """Validate a parsed configuration (``source`` names it in errors).

    Raises:
        ConfigError: with the first offending key.
    """
    try:
        return GatewayConfig.model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ())) or "(top level)"
        raise ConfigError(f"{source}: {where}: {err.get('msg')}") from None


ScopeName = Literal["infer", "admin", "metrics"]


def check_tls(tls: TLSConfig) -> None:
    """Check that the TLS files exist, are PEM, and that the key matches the certificate.

    Raises:
        ConfigError: naming the file at fault.
    """
    import ssl

    if bool(tls.certfile) != bool(tls.keyfile):
        raise ConfigError("TLS needs both a certificate (--ssl-certfile) and its key (--ssl-keyfile)")
    if tls.ca_certfile and not tls.certfile:
        raise ConfigError("mutual TLS (--ssl-ca-certs) needs --ssl-certfile and --ssl-keyfile")
    if not tls.certfile:
        return
    for flag, path in (("--ssl-certfile", tls.certfile), ("--ssl-keyfile", tls.keyfile),
                       ("--ssl-ca-certs", tls.ca_certfile)):
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"{flag} {path}: no such file")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(tls.certfile, tls.keyfile)
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"--ssl-certfile {tls.certfile} / --ssl-keyfile {tls.keyfile}: not a PEM certificate "
                          f"and its private key ({getattr(e, 'reason', None) or e})") from None
    if tls.ca_certfile:
        try:
            ctx.load_verify_locations(tls.ca_certfile)
        except (ssl.SSLError, OSError) as e:
            raise ConfigError(f"--ssl-ca-certs {tls.ca_certfile}: not PEM CA certificates "
                              f"({getattr(e, 'reason', None) or e})") from None
