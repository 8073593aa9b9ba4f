"""Authentication: API keys (stored as SHA-256 hashes) and JWT bearer tokens (PyJWT).

Credentials come in ``Authorization: Bearer <key or token>`` (what the openai client sends) or
``x-api-key: <key>``, over HTTP headers or gRPC metadata alike. A key is looked up by the SHA-256 of
its text (keys are random, 32 bytes from :func:`secrets.token_urlsafe`, so a fast hash is enough: there is
nothing to brute-force); a bearer that is not a known key and has JWT's three parts is verified as a JWT:
signature (HS256 with the shared secret; RS256/ES256 with the key of its ``kid`` in the JWKS file, so
an RS256 token can never be checked against the HMAC secret), ``exp`` (required), ``nbf``, ``iss`` and
``aud``. Sources: RFC 7519 (JWT), RFC 7517 (JWK sets), RFC 6750 (bearer tokens).

The API keys file (YAML)::

    keys:
      - id: acme-1                 # shown in the audit log, never the key itself
        sha256: 3f0c...            # hex SHA-256 of the key (``inferd gateway new-key`` adds entries)
        tenant: acme
        scopes: [infer, metrics]   # infer, admin (model load/unload), metrics
        models: ["*"]              # model names this key may use; "*" = all
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass

import jwt
import yaml

from inferd.gateway.config import SCOPES, ConfigError, GatewayConfig


@dataclass(frozen=True)
class Principal:
    """Who a request is from.

    Attributes:
        tenant: the tenant name (limits and priority are per tenant).
        key_id: the API key's id, or ``jwt:<sub>`` for a token; ``-`` when authentication is off.
        scopes: granted scopes (``infer``, ``admin``, ``metrics``).
        models: model names granted, or None for all.
    """

    tenant: str
    key_id: str
    scopes: frozenset[str]
    models: frozenset[str] | None

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


ANONYMOUS = Principal("anonymous", "-", frozenset(SCOPES), None)


class AuthError(Exception):
    """401 (no or bad credentials) or 403 (a scope or model not granted)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def hash_key(key: str) -> str:
    """Hex SHA-256 of an API key, as stored in the keys file."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    """A fresh random API key (256 bits)."""
    return "inferd-" + secrets.token_urlsafe(32)


def _models(value, where: str) -> frozenset[str] | None:
    """``["*"]`` (or ``"*"``) = all models (None); else the set of names.

    Raises:
        ValueError: not a string or a list of strings.
    """
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(m, str) and m for m in value):
        raise ValueError(f"{where} must be a list of model names (or \"*\")")
    return None if "*" in value else frozenset(value)


def _load_keys(path: str) -> dict[str, Principal]:
    """``{sha256 hex: Principal}`` from a keys file: a mapping with one key, ``keys``, a non-empty list of
    entries with unique ids and hashes.

    Raises:
        ConfigError: the file is unreadable, empty, or an entry is malformed (the message names it).
    """
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read the API keys file: {e}") from None
    if not isinstance(doc, dict) or set(doc) != {"keys"} or not isinstance(doc["keys"], list) or not doc["keys"]:
        raise ConfigError(f"{path}: an API keys file is a mapping with one key, 'keys', a non-empty list of "
                          "entries (make them with: inferd gateway new-key --keys-file ...)")
    keys: dict[str, Principal] = {}
    ids = set()
    for i, entry in enumerate(doc["keys"]):
        where = f"{path}: keys[{i}]"
        if not isinstance(entry, dict) or set(entry) - {"id", "sha256", "tenant", "scopes", "models"}:
            raise ConfigError(f"{where}: an entry has id, sha256, tenant, scopes and models")
        if not isinstance(entry.get("id"), str) or not isinstance(entry.get("tenant"), str) \
                or not entry["id"] or not entry["tenant"]:
            raise ConfigError(f"{where}: id and tenant are required (strings)")
        digest = entry.get("sha256")
        if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest.lower()):
            raise ConfigError(f"{where}: sha256 must be 64 hex digits (the hash of the key, not the key)")
        digest = digest.lower()
        scopes = entry.get("scopes", ["infer"])
        if not isinstance(scopes, list) or not all(isinstance(x, str) for x in scopes):
            raise ConfigError(f"{where}: scopes must be a list (of infer, admin, metrics)")
        bad = [x for x in scopes if x not in SCOPES]
        if bad:
            raise ConfigError(f"{where}: unknown scope {bad[0]!r} (infer, admin, metrics)")
        if entry["id"] in ids or digest in keys:
            raise ConfigError(f"{where}: {'id ' + repr(entry['id']) if entry['id'] in ids else 'the same key'} "
                              "appears twice")
        try:
            models = _models(entry.get("models", ["*"]), "models")
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
        ids.add(entry["id"])
        keys[digest] = Principal(entry["tenant"], entry["id"], frozenset(scopes), models)
    return keys


def add_key(path: str, key_id: str, tenant: str, scopes: list[str], models: list[str]) -> str:
    """Make a new API key, add its entry (hash only) to the keys file at ``path`` (created if missing),
    and return the key.

    Raises:
        ConfigError: the file exists but is not a valid keys file, or ``key_id`` is taken.
    """
    key = new_key()
    entries = []
    if os.path.exists(path):
        _load_keys(path)  # refuse to extend a broken file
        with open(path, encoding="utf-8") as f:
            entries = yaml.safe_load(f)["keys"]
    if any(e["id"] == key_id for e in entries):
        raise ConfigError(f"{path}: id {key_id!r} is taken")
    entries.append({"id": key_id, "sha256": hash_key(key), "tenant": tenant, "scopes": scopes, "models": models})
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        yaml.safe_dump({"keys": entries}, f, sort_keys=False)
    os.replace(tmp, path)
    _load_keys(path)
    return key


class Authenticator:
    """Checks credentials against the keys file and the JWT settings of a :class:`GatewayConfig`.

    Raises:
        ConfigError: (at construction) unreadable keys, secret or JWKS file.
    """

    def __init__(self, config: GatewayConfig) -> None:
        self.enabled = config.auth.enabled
        self.public_paths = frozenset(config.auth.public_paths)
        self.keys = _load_keys(config.auth.api_keys_file) if config.auth.api_keys_file else {}
        self.jwt = config.auth.jwt
        self.secret: bytes | None = None
        self.jwks: jwt.PyJWKSet | None = None
        if self.jwt is not None:
            if self.jwt.secret_file:
                try:
                    with open(self.jwt.secret_file, "rb") as f:
                        self.secret = f.read().strip()
                except OSError as e:
                    raise ConfigError(f"{self.jwt.secret_file}: {e.strerror}") from None
                if len(self.secret) < 32:
                    raise ConfigError(f"{self.jwt.secret_file}: an HS256 secret must be at least 32 bytes "
                                      "(RFC 7518, section 3.2)")
            elif self.jwt.secret_env:
                value = os.environ.get(self.jwt.secret_env)
                if not value:
                    raise ConfigError(f"auth.jwt.secret_env: the environment variable {self.jwt.secret_env} is "
                                      "not set")
                self.secret = value.encode()
                if len(self.secret) < 32:
                    raise ConfigError("auth.jwt.secret_env: an HS256 secret must be at least 32 bytes "
                                      "(RFC 7518, section 3.2)")
            if self.jwt.jwks_file:
                try:
                    with open(self.jwt.jwks_file, encoding="utf-8") as f:
                        self.jwks = jwt.PyJWKSet.from_dict(json.load(f))
                except (OSError, ValueError, jwt.PyJWKSetError) as e:
                    raise ConfigError(f"{self.jwt.jwks_file}: cannot read the JWKS: {e}") from None
            if self.secret is None and self.jwks is None:
                raise ConfigError("auth.jwt needs secret_file, secret_env or jwks_file")

    def authenticate(self, authorization: str | None, api_key: str | None) -> Principal:
        """The principal behind a request's credentials (:data:`ANONYMOUS` when authentication is off).

        Args:
            authorization: the ``Authorization`` header / metadata value, if any.
            api_key: the ``x-api-key`` header / metadata value, if any.

        Raises:
            AuthError: 401 without credentials, with an unknown key or an invalid token.
        """
        if not self.enabled:
            return ANONYMOUS
        credential = None
        if authorization:  # the Authorization header first (what the openai client sends), then x-api-key
            scheme, _, value = authorization.strip().partition(" ")
            if scheme.lower() != "bearer" or not value.strip():
                raise AuthError(401, "the Authorization header must be 'Bearer <API key or token>'")
            credential = value.strip()
        elif api_key:
            credential = api_key.strip()
        if not credential:
            raise AuthError(401, "authentication required: send 'Authorization: Bearer <API key or token>'")
        digest = hash_key(credential)
        for known, principal in self.keys.items():  # constant time per entry
            if hmac.compare_digest(known, digest):
                return principal
        if self.jwt is not None and credential.count(".") == 2:
            return self._verify_jwt(credential)
        raise AuthError(401, "invalid API key")

    def _verify_jwt(self, token: str) -> Principal:
        cfg = self.jwt
        try:
            header = jwt.get_unverified_header(token)
            alg = header.get("alg")
            if alg == "HS256" and self.secret is not None:
                key, algs = self.secret, ["HS256"]
            elif alg in ("RS256", "ES256") and self.jwks is not None:
                kid = header.get("kid")
                kty = "RSA" if alg == "RS256" else "EC"
                matches = [k for k in self.jwks.keys if (kid is None or k.key_id == kid) and k.key_type == kty]
                if not matches:
                    raise AuthError(401, f"invalid token: no {kty} key {kid!r} in the JWKS for {alg}")
                key, algs = matches[0].key, [alg]
            else:
                raise AuthError(401, f"invalid token: algorithm {alg!r} is not accepted")
            claims = jwt.decode(token, key, algorithms=algs, audience=cfg.audience, issuer=cfg.issuer,
                                leeway=cfg.leeway_s, options={"require": ["exp"], "verify_aud": cfg.audience
                                                              is not None})
        except jwt.PyJWTError as e:
            raise AuthError(401, f"invalid token: {e}") from None
        except (TypeError, ValueError) as e:  # a key PyJWT cannot use with this token
            raise AuthError(401, f"invalid token: {e}") from None
        tenant = claims.get(cfg.tenant_claim)
        if not isinstance(tenant, str) or not tenant:
            raise AuthError(401, f"invalid token: claim {cfg.tenant_claim!r} (the tenant) is missing")
        raw = claims.get(cfg.scopes_claim, "")
        if not isinstance(raw, (str, list)):
            raise AuthError(401, f"invalid token: claim {cfg.scopes_claim!r} must be a string or a list")
        scopes = raw.split() if isinstance(raw, str) else [str(s) for s in raw]
        models = None
        if cfg.models_claim in claims:
            try:
                models = _models(claims[cfg.models_claim], f"claim {cfg.models_claim!r}")
            except ValueError as e:
                raise AuthError(401, f"invalid token: {e}") from None
        return Principal(tenant, "jwt:" + str(claims.get("sub", tenant)), frozenset(scopes) & frozenset(SCOPES),
                         models)


def require_scope(principal: Principal, scope: str) -> None:
    """Raises: AuthError: 403 when ``scope`` is not granted."""
    if scope not in principal.scopes:
        raise AuthError(403, f"this credential lacks the {scope!r} scope")


def require_model(principal: Principal, model: str) -> None:
    """Raises: AuthError: 403 when ``model`` is not granted."""
    if not principal.may_use(model):
        raise AuthError(403, f"this credential may not use the model {model!r}")
