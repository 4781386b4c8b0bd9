"""Request limits for the OpenAI endpoints, one implementation for the router and the engine.

`check_request` walks a parsed JSON body before anything else reads it: every string must be
valid Unicode (no lone surrogates), lists and objects are capped, chat roles are known, and the
fields that size the work (`n`, `best_of`, `stop`, `logit_bias`, `logprobs`, `max_tokens`, the
prompt) are bounded. A violation is an ApiError 400 whose `param` names the field (dotted path,
like pydantic's: `messages.0.content`). Value ranges of sampling floats (temperature, top_p, ...)
stay with the engine's SamplingParams; this module only checks that they are finite numbers.
docs/engine-server.md, "Request limits", lists the numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ragserve.http.errors import ApiError
from ragserve.tokenizer import ROLES

MAX_DEPTH = 64  # JSON nesting (checked on the raw body by ragserve.http.body)
MAX_LIST_ITEMS = 4096  # any list, except lists of token ids
MAX_TOKEN_IDS = 1 << 20  # a list of integers (a token-id prompt, resume_token_ids, stop_token_ids...)
MAX_OBJECT_KEYS = 1024
MAX_PROMPTS = 256  # a batched completions prompt
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 256
MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_N = 64  # n, best_of
MAX_LOGPROBS = 20  # logprobs (completions), top_logprobs (chat)
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_RANGE = 100.0
MAX_NAME_CHARS = 256  # model, user, role, name, cache_salt, content-part type
MAX_TOKENS = 1 << 24  # max_tokens without a known context length
_NUMBERS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_NUMBERS += ("length_penalty",)
_INT64 = 2**63


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", "invalid_value", param)


def check_request(body: dict, chat: bool, max_model_len: int | None = None) -> None:
    """Raise a 400 naming the first field of an OpenAI chat/completions body that breaks a limit."""
    check_json(body)
    if chat:
        _messages(body.get("messages"))
    else:
        _prompt(body.get("prompt"))
    _fields(body, chat, max_model_len)


def check_json(value, path: str = "") -> None:
    """Valid Unicode strings (keys too) and capped lists/objects, anywhere in a parsed body."""
    if isinstance(value, str):
        _unicode(value, path or "body")
    elif isinstance(value, dict):
        if len(value) > MAX_OBJECT_KEYS:
            raise invalid(path or "body", f"at most {MAX_OBJECT_KEYS} keys")
        for key, item in value.items():
            _unicode(key, path or "body")
            check_json(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        ints = all(type(v) is int for v in value)
        cap = MAX_TOKEN_IDS if ints else MAX_LIST_ITEMS
        if len(value) > cap:
            raise invalid(path, f"at most {cap} items")
        if not ints:
            for i, item in enumerate(value):
                check_json(item, f"{path}.{i}")


def _unicode(text: str, path: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise invalid(path, "not valid Unicode (lone surrogate)") from None


def _messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty list")
    if len(messages) > MAX_MESSAGES:
        raise invalid("messages", f"at most {MAX_MESSAGES} messages")
    for i, message in enumerate(messages):
        path = f"messages.{i}"
        if not isinstance(message, dict):
            raise invalid(path, "must be an object")
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"{path}.role", f"must be one of {', '.join(sorted(ROLES))}")
        content = message.get("content")
        if isinstance(content, list):
            _content_parts(content, f"{path}.content")
        elif content is not None and not isinstance(content, str):
            raise invalid(f"{path}.content", "must be a string, a list of content parts or null")
        _optional(message, "name", path, _name)


def _content_parts(parts: list, path: str) -> None:
    if len(parts) > MAX_CONTENT_PARTS:
        raise invalid(path, f"at most {MAX_CONTENT_PARTS} content parts")
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid(f"{path}.{j}", "must be an object with a string type")
        _name(part["type"], f"{path}.{j}.type")
        if "text" in part and not isinstance(part["text"], str):
            raise invalid(f"{path}.{j}.text", "must be a string")


def _prompt(prompt) -> None:
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, list) or not prompt:
        raise invalid("prompt", "must be a string, a list of token ids, or a non-empty list of either")
    if all(_is_int(t) for t in prompt):
        return
    if len(prompt) > MAX_PROMPTS:
        raise invalid("prompt", f"at most {MAX_PROMPTS} prompts in one request")
    for i, item in enumerate(prompt):
        ok = isinstance(item, str) or (isinstance(item, list) and item and all(_is_int(t) for t in item))
        if not ok:
            raise invalid(f"prompt.{i}", "must be a string or a non-empty list of token ids")


def _fields(body: dict, chat: bool, max_model_len: int | None) -> None:
    """The body's sampling and output fields, in the body's order; one lookup per field it has."""
    cap, checks = max_model_len or MAX_TOKENS, _CHAT_FIELDS if chat else _COMPLETION_FIELDS
    for name, value in body.items():
        if value is not None and (check := checks.get(name)) is not None:
            check(value, name, cap)


def _optional(body: dict, name: str, parent: str, check: Callable[[object, str], None]) -> None:
    if body.get(name) is not None:
        check(body[name], f"{parent}.{name}" if parent else name)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(value, param: str, lo: int, hi: int) -> None:
    if not _is_int(value) or not lo <= value <= hi:
        raise invalid(param, f"must be an integer in [{lo}, {hi}]")


def _number(value, param: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(param, "must be a finite number")


def _bool(value, param: str) -> None:
    if not isinstance(value, bool):
        raise invalid(param, "must be true or false")


def _name(value, param: str) -> None:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_CHARS:
        raise invalid(param, f"must be a string of 1 to {MAX_NAME_CHARS} characters")


def _stop(value, param: str) -> None:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOP:
        raise invalid(param, f"must be a string or a list of at most {MAX_STOP} strings")
    if not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise invalid(param, f"stop strings must have 1 to {MAX_STOP_CHARS} characters")


def _token_ids(value, param: str, cap: int) -> None:
    if not isinstance(value, list) or len(value) > cap or not all(_is_int(t) and t >= 0 for t in value):
        raise invalid(param, f"must be a list of at most {cap} token ids")


def _logit_bias(value, param: str) -> None:
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise invalid(param, f"must be an object of at most {MAX_LOGIT_BIAS} token ids")
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 10:
            raise invalid(param, f"keys must be token ids, got {key[:20]!r}")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not abs(bias) <= LOGIT_BIAS_RANGE:
            raise invalid(param, f"biases must be numbers in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]")


def _int_in(lo: int, hi: int | None = None) -> Callable[[object, str, int], None]:
    """An integer in [lo, hi]; hi None: the token cap (the model's context length, else MAX_TOKENS)."""

    def check(value, param: str, cap: int) -> None:
        _int(value, param, lo, cap if hi is None else hi)

    return check


def _capless(check: Callable[[object, str], None]) -> Callable[[object, str, int], None]:
    return lambda value, param, cap: check(value, param)


_COMPLETION_FIELDS: dict[str, Callable[[object, str, int], None]] = {
    "max_tokens": _int_in(1),
    "max_completion_tokens": _int_in(1),
    "min_tokens": _int_in(0),
    "n": _int_in(1, MAX_N),
    "best_of": _int_in(1, MAX_N),
    "seed": _int_in(-_INT64, _INT64 - 1),
    "top_k": _int_in(-1, 1 << 31),
    "priority": _int_in(-_INT64, _INT64 - 1),
    **dict.fromkeys(_NUMBERS, _capless(_number)),
    "logprobs": _int_in(0, MAX_LOGPROBS),
    **dict.fromkeys(
        ("stream", "echo", "ignore_eos", "return_token_ids", "use_beam_search", "skip_special_tokens"),
        _capless(_bool),
    ),
    "include_stop_str_in_output": _capless(_bool),
    **dict.fromkeys(("model", "user", "cache_salt"), _capless(_name)),
    "stop": _capless(_stop),
    "stop_token_ids": _capless(lambda value, param: _token_ids(value, param, MAX_STOP_TOKEN_IDS)),
    "resume_token_ids": _token_ids,  # capped by the token cap
    "logit_bias": _capless(_logit_bias),
}
_CHAT_FIELDS = {**_COMPLETION_FIELDS, "logprobs": _capless(_bool), "top_logprobs": _int_in(0, MAX_LOGPROBS)}
