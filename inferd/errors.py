"""Errors the engine raises for bad requests; the server maps them to HTTP 400 with an OpenAI error body."""

import re


class InvalidRequestError(ValueError):
    """A request the engine cannot serve as asked.

    Attributes:
        param: the request field at fault (OpenAI's ``error.param``), or None.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an internal error; requests cannot be served."""


class EngineOverloadedError(RuntimeError):
    """The model already has as many waiting requests as it may queue (load shedding): retry later.

    Attributes:
        retry_after: seconds the client should wait before retrying.
    """

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


# pydantic names the member of a union that failed in an error's location ("str", "list[str]", "literal['a','b']",
# "function-after[...]"): not a field a client sent (a client's dict key, such as logit_bias's "-5", stays).
_UNION_MEMBER = re.compile(r"^(?:[a-z][a-z-]*\[.*\]|str|int|float|bool|dict|list|none|bytes)$")
_TYPE_PREFIX = "Input should be a valid "


def first_field_error(errors: list[dict]) -> tuple[list[str], str, str]:
    """The first of pydantic's validation ``errors`` as a client reads it: (the field's location, without "body" and
    without the names pydantic gives a union's members; the message; pydantic's error type).

    A value that fails every member of a union gives one error per member: the one about the value itself or its
    items is taken (17 stop strings: "List should have at most 16 items"; a content part of type "image": "Input
    should be 'text'"), else the types are joined ("Input should be a valid string or list")."""
    if not errors:
        return [], "invalid value", ""

    def where(e: dict) -> list[str]:
        return [str(x) for x in e.get("loc", ()) if x != "body" and not _UNION_MEMBER.match(str(x))]

    err = errors[0]
    loc = where(err)
    inside = [e for e in errors if where(e)[:len(loc)] == loc]  # this field's errors, its items' too
    own = next((e for e in inside if not e.get("type", "").endswith("_type")), None)
    if own is not None:
        return where(own), own.get("msg", "invalid value"), own.get("type", "")
    same = [e for e in inside if where(e) == loc]
    kinds = list(dict.fromkeys(e.get("msg", "").removeprefix(_TYPE_PREFIX) for e in same))
    if len(kinds) > 1 and all(e.get("msg", "").startswith(_TYPE_PREFIX) for e in same):
        return loc, _TYPE_PREFIX + " or ".join(kinds), err.get("type", "")
    return loc, err.get("msg", "invalid value"), err.get("type", "")
