"""The gateway's parts on their own: the keys file, the circuit breaker's half-open probe, input-guard
plugins, rate-limit windows. (tests/test_gateway.py covers them through the running server.)"""

from __future__ import annotations

import os
import sys
import time

import pytest
import yaml

from inferd.gateway.auth import Authenticator, AuthError, add_key, hash_key
from inferd.gateway.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from inferd.gateway.config import ConfigError, GatewayConfig, GuardConfig
from inferd.gateway.guard import InputGuard
from inferd.gateway.ratelimit import RateLimited, RateLimits


def _auth(tmp_path, entries) -> Authenticator:
    (tmp_path / "keys.yaml").write_text(yaml.safe_dump({"keys": entries}))
    return Authenticator(GatewayConfig.model_validate({"auth": {"api_keys_file": str(tmp_path / "keys.yaml")}}))


def test_keys_file_entries_are_checked(tmp_path):
    good = {"id": "k", "sha256": hash_key("secret-key"), "tenant": "t", "scopes": ["infer"]}
    auth = _auth(tmp_path, [good])
    p = auth.authenticate("Bearer secret-key", None)
    assert (p.tenant, p.key_id, p.scopes, p.models) == ("t", "k", frozenset({"infer"}), None)
    assert auth.authenticate(None, "secret-key") == p
    with pytest.raises(AuthError) as e:
        auth.authenticate("Bearer secret-key2", None)
    assert (e.value.status, e.value.message) == (401, "invalid API key")
    path = tmp_path / "keys.yaml"
    for bad, message in (
        (good | {"sha256": "secret-key"}, "keys[0]: sha256 must be 64 hex digits (the hash of the key, not the key)"),
        (good | {"scopes": ["root"]}, "keys[0]: unknown scope 'root' (infer, admin, metrics)"),
        (good | {"role": "x"}, "keys[0]: an entry has id, sha256, tenant, scopes and models"),
        ({k: v for k, v in good.items() if k != "tenant"}, "keys[0]: id and tenant are required (strings)"),
        (good | {"scopes": "infer"}, "keys[0]: scopes must be a list (of infer, admin, metrics)"),
        (good | {"scopes": None}, "keys[0]: scopes must be a list (of infer, admin, metrics)"),
        (good | {"models": 5}, 'keys[0]: models must be a list of model names (or "*")'),
    ):
        with pytest.raises(ConfigError) as e:
            _auth(tmp_path, [bad])
        assert str(e.value) == f"{path}: {message}"
    with pytest.raises(ConfigError) as e:
        _auth(tmp_path, [good, good | {"id": "k2"}])
    assert str(e.value) == f"{path}: keys[1]: the same key appears twice"
    with pytest.raises(ConfigError) as e:
        _auth(tmp_path, [good, good | {"sha256": hash_key("other")}])
    assert str(e.value) == f"{path}: keys[1]: id 'k' appears twice"
    whole_file = ("an API keys file is a mapping with one key, 'keys', a non-empty list of entries (make them "
                  "with: inferd gateway new-key --keys-file ...)")
    for text in ("", "kyes: []\n", "- id: k\n", "keys: []\n", "keys: []\nkeys2: []\n"):
        path.write_text(text)
        with pytest.raises(ConfigError) as e:
            Authenticator(GatewayConfig.model_validate({"auth": {"api_keys_file": str(path)}}))
        assert str(e.value) == f"{path}: {whole_file}", text


def test_new_keys_are_added_to_the_file(tmp_path):
    path = str(tmp_path / "keys.yaml")
    k1 = add_key(path, "one", "acme", ["infer"], ["*"])
    k2 = add_key(path, "two", "acme", ["infer", "admin"], ["m1"])
    auth = Authenticator(GatewayConfig.model_validate({"auth": {"api_keys_file": path}}))
    assert auth.authenticate(f"Bearer {k1}", None).key_id == "one"
    p2 = auth.authenticate(None, k2)
    assert (p2.key_id, p2.scopes, p2.models) == ("two", frozenset({"infer", "admin"}), frozenset({"m1"}))
    with pytest.raises(ConfigError) as e:
        add_key(path, "two", "acme", ["infer"], ["*"])
    assert str(e.value) == f"{path}: id 'two' is taken"
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"


def test_breaker_half_open_probe_failure_reopens():
    br = CircuitBreaker(failure_threshold=2, reset_timeout_s=0.05)
    for _ in range(2):
        assert br.allow()
        br.record("failure")
    assert br.state == OPEN and not br.allow() and not br.ready
    time.sleep(0.06)
    assert br.ready and br.allow() and br.state == HALF_OPEN
    assert not br.allow()  # one probe at a time
    br.record("failure")
    assert br.state == OPEN and not br.allow()
    time.sleep(0.06)
    assert br.allow()
    br.record(None)  # a client error: no verdict, still half-open, the next request probes
    assert br.state == HALF_OPEN and br.allow()
    br.record("ok")
    assert br.state == CLOSED and br.failures == 0
    br.record("failure")
    assert br.state == CLOSED  # one failure after a success is below the threshold


def test_input_guard_plugins(tmp_path, monkeypatch):
    (tmp_path / "my_guard.py").write_text("def check(text):\n    return 'no-digits' if any(c.isdigit() for c in text) "
                                          "else None\nNOT_CALLABLE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    guard = InputGuard(GuardConfig(rules=[{"name": "pw", "pattern": "password"}], plugins=["my_guard:check"]))
    assert guard.check("What is the PASSWORD?") == "pw"
    assert guard.check("call 555") == "no-digits"
    assert guard.check("hello") is None
    for spec, message in (("my_guard:missing", "cannot import 'my_guard:missing'"),
                          ("no_such_module_x:f", "cannot import 'no_such_module_x:f'"),
                          ("my_guard:NOT_CALLABLE", "'my_guard:NOT_CALLABLE' is not callable")):
        with pytest.raises(ConfigError) as e:
            InputGuard(GuardConfig(plugins=[spec]))
        assert str(e.value).startswith(f"input_guard.plugins: {message}")
    sys.modules.pop("my_guard", None)


def test_rate_limits_per_tenant_and_model():
    cfg = GatewayConfig.model_validate({"tenants": {"a": {"requests_per_minute": 2, "tokens_per_minute": 10}},
                                        "models": {"m": {"requests_per_minute": 3}}})
    rl = RateLimits(cfg)
    rl.admit("a", "m")
    rl.admit("a", "m")
    with pytest.raises(RateLimited) as e:
        rl.admit("a", "m")  # the tenant's 2 per minute
    assert (e.value.kind, e.value.scope) == ("requests", "tenant 'a'") and 1 <= e.value.retry_after <= 60
    rl.admit("b", "m")  # another tenant: only the model's limit (its third request)
    with pytest.raises(RateLimited) as e:
        rl.admit("b", "m")
    assert (e.value.kind, e.value.scope) == ("requests", "model 'm'")
    rl2 = RateLimits(cfg)
    rl2.charge("a", None, 25)  # overdrawn
    with pytest.raises(RateLimited) as e:
        rl2.admit("a", "x")
    assert e.value.kind == "tokens"
    headers = dict(rl2.headers("a", "x"))
    assert headers[b"x-ratelimit-limit-tokens"] == b"10" and headers[b"x-ratelimit-remaining-tokens"] == b"0"
    assert headers[b"x-ratelimit-remaining-requests"] == b"2"
