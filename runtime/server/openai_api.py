"""The OpenAI API's request bodies and responses, as clients use them.

`parse_chat` and `parse_completion` turn a decoded JSON body into a
`ParsedRequest` or raise ApiError(400) naming the field; the `*_response`
and `*_chunk` functions build what the API returns. Fields clients send
that change nothing here (`user`, `metadata`, zero penalties) are accepted;
fields that would change the output and are not implemented are refused by
name rather than ignored.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Any

from kvexport.contract.sampler import SamplingConfig

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20


class ApiError(Exception):
    """An OpenAI-shaped error: the HTTP status and the body's error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ParsedRequest:
    kind: str  # "chat" or "completion"
    model: str | None
    messages: list[dict] | None  # chat
    prompt: str | list[int] | None  # completion: text, or token ids
    max_tokens: int | None  # None: up to the context
    sampling: SamplingConfig
    seed: int
    n: int
    stop: tuple[str, ...]
    logprobs: int | None
    stream: bool
    include_usage: bool
    ignore_eos: bool
    response_format: tuple[str, Any] = ("text", None)  # ("json_object", None) or ("json_schema", the schema)


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param)


def _get(body: dict, name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    """body[name] when it is one of `kinds` (JSON null gives the default)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise _bad(f"'{name}' must be {_spell(kinds)}, got a boolean", name)
    if not isinstance(value, kinds) or (float in kinds and isinstance(value, float) and not math.isfinite(value)):
        raise _bad(f"'{name}' must be {_spell(kinds)}, got {_json_type(value)}", name)
    return value


def _spell(kinds: tuple[type, ...]) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array", dict: "an object"}
    if kinds == (int, float):
        return "a number"
    return " or ".join(names[k] for k in kinds)


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    return {int: "an integer", float: "a number", str: "a string", list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def _common(body: Any, kind: str) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = _get(body, "model", (str,))
    max_tokens = _get(body, "max_completion_tokens", (int,), _get(body, "max_tokens", (int,)))
    if max_tokens is not None and max_tokens < 1:
        raise _bad(f"'max_tokens' must be at least 1, got {max_tokens}", "max_tokens")
    temperature = float(_get(body, "temperature", (int, float), 1.0))
    if not 0 <= temperature <= 2:
        raise _bad(f"'temperature' must be in [0, 2], got {temperature}", "temperature")
    top_p = float(_get(body, "top_p", (int, float), 1.0))
    if not 0 < top_p <= 1:
        raise _bad(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = _get(body, "top_k", (int,), 0)
    if top_k < 0:
        raise _bad(f"'top_k' must be >= 0 (0 turns it off), got {top_k}", "top_k")
    seed = _get(body, "seed", (int,))
    if seed is None:
        seed = secrets.randbits(62)
    n = _get(body, "n", (int,), 1)
    if n < 1:
        raise _bad(f"'n' must be at least 1, got {n}", "n")
    if not 0 <= seed < (1 << 64) - n:
        raise _bad(f"'seed' must be in 0..2**64 - 1 - n, got {seed}", "seed")
    stop = _get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) for s in stop):
        raise _bad(f"'stop' must be a string or an array of at most {MAX_STOP_STRINGS} strings", "stop")
    stream = _get(body, "stream", (bool,), False)
    options = _get(body, "stream_options", (dict,), {})
    include_usage = _get(options, "include_usage", (bool,), False)
    for name in ("presence_penalty", "frequency_penalty"):
        if _get(body, name, (int, float), 0) != 0:
            raise _bad(f"'{name}' is not supported by this server (only 0)", name)
    if _get(body, "logit_bias", (dict,), {}):
        raise _bad("'logit_bias' is not supported by this server", "logit_bias")
    for name in ("tools", "functions"):
        if _get(body, name, (list,), []):
            raise _bad(f"'{name}' is not supported by this server", name)
    response_format = _response_format(_get(body, "response_format", (dict,), {"type": "text"}))
    return dict(kind=kind, model=model, max_tokens=max_tokens, sampling=SamplingConfig(temperature, top_k, top_p),
                seed=seed, n=n, stop=tuple(stop), stream=stream, include_usage=include_usage,
                ignore_eos=_get(body, "ignore_eos", (bool,), False), response_format=response_format)


def _response_format(value: dict) -> tuple[str, Any]:
    """OpenAI's response_format: text, json_object, or json_schema with
    {"json_schema": {"name", "schema", "strict"}}."""
    kind = value.get("type", "text")
    if kind in ("text", "json_object"):
        return kind, None
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise _bad("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}", "response_format")
        return kind, spec.get("schema", {})
    raise _bad(f"response_format type {kind!r} is not supported (text, json_object, json_schema)", "response_format")


ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_chat(body: Any) -> ParsedRequest:
    fields = _common(body, "chat")
    messages = _get(body, "messages", (list,))
    if not messages:
        raise _bad("'messages' must be a non-empty array", "messages")
    clean = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(f"'{where}' must be an object", where)
        role = message.get("role")
        if role not in ROLES:
            raise _bad(f"'{where}.role' must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        clean.append({"role": role, "content": _content(message.get("content"), f"{where}.content")})
    wants = _get(body, "logprobs", (bool,), False)
    top = _get(body, "top_logprobs", (int,))
    if top is not None and not wants:
        raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise _bad(f"'top_logprobs' must be in 0..{MAX_TOP_LOGPROBS}, got {top}", "top_logprobs")
    return ParsedRequest(messages=clean, prompt=None, logprobs=(top or 0) if wants else None, **fields)


def _content(content: Any, where: str) -> str:
    """A message's text: a string, or an array of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"'{where}': only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported", where)
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(f"'{where}' must be a string or an array of text parts, got {_json_type(content)}", where)


MAX_COMPLETION_LOGPROBS = 5


def parse_completion(body: Any) -> ParsedRequest:
    fields = _common(body, "completion")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise _bad("'prompt' must be a string, or an array of token ids (one prompt per request)", "prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise _bad("'prompt' must be a non-empty string, or an array of token ids (one prompt per request)", "prompt")
    if _get(body, "echo", (bool,), False):
        raise _bad("'echo' is not supported by this server", "echo")
    if _get(body, "suffix", (str,)):
        raise _bad("'suffix' is not supported by this server", "suffix")
    best_of = _get(body, "best_of", (int,))
    if best_of is not None and best_of != fields["n"]:
        raise _bad("'best_of' other than n is not supported by this server", "best_of")
    logprobs = _get(body, "logprobs", (int,))
    if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise _bad(f"'logprobs' must be in 0..{MAX_COMPLETION_LOGPROBS}, got {logprobs}", "logprobs")
    return ParsedRequest(messages=None, prompt=prompt, logprobs=logprobs, **fields)


# -------------------------------------------------------------- responses
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_logprobs(entries: list, spell) -> dict:
    """The chat API's logprobs object: one entry per generated token."""
    def item(token: int, logprob: float) -> dict:
        text = spell(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]}


def completion_logprobs(entries: list, spell, offset: int = 0) -> dict:
    """The completions API's logprobs object (text_offset counts from `offset`)."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(spell(e.token))
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{spell(t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}
