"""OpenAI-style request bodies -> a validated `Job` (prompt ids + `GenerationConfig`), framework-free.

Every refusal is a `RequestError` naming the request field (`max_tokens`, `messages[2]`, `mtp.k`) with the text of
mtp's own validation: sampling and speculative options go through `GenerationConfig.from_options` and
`GenerationConfig.validate(model)`, and an `OptionError` is worded with the request field instead of the option
name (`OptionError.say`), so `max_tokens must be an integer >= 1, got 0` reads as mtp-eval's and mtp-chat's do.

Field mapping (OpenAI -> generate option):
    max_tokens / max_completion_tokens -> max_new_tokens (absent: the server's default, cut to the room the prompt
                 leaves in max_model_len; given: prompt + max_tokens over max_model_len is a 400)
    temperature  0 -> verify='strict' (greedy); > 0 -> verify='sample' at that temperature; absent: the server's
                 verifier (unless the request names one in `mtp.verify`, which wins)
    top_p, top_k, seed -> the sampling verifier's
    stop         strings that end the reply (matched on the streamed text, left out of it)
    mtp          the speculative settings of this request (extension): draft, k, verify, draft_sampling, and the
                 options of the registered verifiers (`Verifier.options`: relaxed's top_n, delta, span_rule;
                 typical's posterior_threshold, posterior_alpha), read from the registry per request, so a verifier
                 registered later brings its own; one the request's verifier does not read is refused. Settings
                 that read server files or change the compiled step (draft_vocab, draft_head_fp8, tree, mode,
                 prefill_chunk) and think_ids (the tokenizer's) stay the server's.
    thinking     DeepSeek's `thinking: {"type": "enabled" | "disabled"}`, or vLLM's
                 `chat_template_kwargs: {"thinking": bool}`; absent: the server's default
Unsupported fields that would change the output (n > 1, logprobs, penalties, tool_choice 'required' or a named
function, which need constrained decoding) are refused rather than ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..decode.config import OPTIONS, GenerationConfig
from ..draft.modes import drafts
from ..spec.options import OptionError, is_int, is_number
from ..text.prompt import encode_chat
from ..text.tokenizer import Tokenizer
from ..verify.registry import VERIFIER_REGISTRY

# the generate options a request's `mtp` object may set whichever its verifier (the verifiers' own: verifier_fields)
DRAFT_FIELDS = ("draft", "k", "verify", "draft_sampling")
_SERVER_ONLY = ("think_ids",)  # verifier options the server sets (the tokenizer's), never a request
# generate()'s option -> the OpenAI field it comes from (the `mtp` ones are `mtp.<option>`): how an OptionError is said
OPENAI_FIELDS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                 "seed": "seed"}
_UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "presence_penalty": (None, 0),
                "frequency_penalty": (None, 0), "logit_bias": (None, {}), "echo": (None, False),
                "suffix": (None, ""), "best_of": (None, 1), "response_format": (None, {"type": "text"})}


class RequestError(ValueError):
    """A request mtp cannot serve as asked: HTTP `status` (400 unless said), the request `field` it is about."""

    def __init__(self, field: str, message: str, status: int = 400):
        self.field, self.status = field, status
        super().__init__(message)


@dataclass(frozen=True)
class Defaults:
    """What a request does not say: the server's configuration (`mtp-serve`'s draft / verify / runtime groups)."""

    max_new_tokens: int = 512
    thinking: bool = True
    options: Mapping[str, Any] = field(default_factory=dict)  # generate() keyword options (draft, k, verify, ...)
    max_model_len: int | None = None  # prompt + max_tokens limit; None: the model's own


@dataclass
class Job:
    """One validated request."""

    kind: str  # 'chat' | 'completion'
    prompt_ids: list[int]
    config: GenerationConfig
    thinking: bool  # the reply opens inside reasoning (chat in thinking mode)
    tools: bool  # read DSML tool calls from the reply
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def parse_chat(body: Any, defaults: Defaults, tok: Tokenizer, model) -> Job:
    body = _body(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", f"messages must be a non-empty list of messages, got {messages!r:.80}")
    messages = [_message(i, m) for i, m in enumerate(messages)]
    thinking = _thinking(body, defaults.thinking)
    tools = body.get("tools") or None
    choice = body.get("tool_choice")
    if choice == "none":
        tools = None
    elif choice not in (None, "auto"):
        raise RequestError("tool_choice", f"tool_choice must be 'auto' or 'none', got {choice!r:.80} ('required' and "
                                          "named functions need constrained decoding, which mtp does not do)")
    try:
        ids = encode_chat(messages, tok, thinking, tools=tools)
    except ValueError as e:  # the prompt builder names messages[i] or tools
        raise RequestError("tools" if str(e).startswith("tools") else "messages", str(e)) from None
    return _job("chat", body, ids, defaults, tok, model, thinking=thinking, tools=bool(tools))


def parse_completion(body: Any, defaults: Defaults, tok: Tokenizer, model) -> Job:
    """`/v1/completions`: `prompt` is one text (BOS is put before it) or one list of token ids (used as given)."""
    body = _body(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        ids = [tok.bos_id] + tok.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        ids = list(prompt)
        V = model.cfg.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise RequestError("prompt", f"prompt holds token id {bad[0]} outside the vocabulary [0, {V})")
    else:
        raise RequestError("prompt", f"prompt must be a non-empty string or list of token ids (one prompt: requests "
                                     f"run one at a time), got {prompt!r:.80}")
    return _job("completion", body, ids, defaults, tok, model, thinking=False, tools=False)


def _body(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise RequestError("body", f"the request body must be a JSON object, got {type(body).__name__}")
    for name, allowed in _UNSUPPORTED.items():
        if name in body and body[name] not in allowed:
            raise RequestError(name, f"{name} is not supported by mtp-serve, got {body[name]!r:.80}")
    n = body.get("n", 1)
    if n not in (None, 1):
        raise RequestError("n", f"n must be 1 (requests run one at a time at batch 1), got {n!r}")
    return body


def _message(i: int, msg: Any) -> Any:
    """OpenAI content parts ([{"type": "text", "text": ...}]) joined into one string; other fields as sent."""
    if isinstance(msg, Mapping) and isinstance(msg.get("content"), list):
        parts = msg["content"]
        if not all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in parts):
            raise RequestError(f"messages[{i}].content", f"messages[{i}].content: only text parts "
                                                         "({'type': 'text', 'text': ...}) are supported")
        return {**msg, "content": "".join(p["text"] for p in parts)}
    return msg


def _thinking(body: Mapping[str, Any], default: bool) -> bool:
    t = body.get("thinking")
    if t is not None:
        kind = t.get("type") if isinstance(t, Mapping) else None
        if isinstance(t, bool):
            return t
        if kind not in ("enabled", "disabled"):
            raise RequestError("thinking", f"thinking must be {{'type': 'enabled' | 'disabled'}} or a bool, got {t!r:.80}")
        return kind == "enabled"
    kwargs = body.get("chat_template_kwargs") or {}
    value = kwargs.get("thinking") if isinstance(kwargs, Mapping) else None
    if value is not None and not isinstance(value, bool):
        raise RequestError("chat_template_kwargs.thinking",
                           f"chat_template_kwargs.thinking must be a bool, got {value!r:.80}")
    return default if value is None else value


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop", f"stop must be a non-empty string or a list of them, got {body['stop']!r:.80}")
    return tuple(stop)


def verifier_fields() -> dict[str, tuple[str, ...]]:
    """The verifier options a request's `mtp` object may set -> the registered verifiers that read them. Asked of
    the registry per request (a verifier registered after this module brings its options); `sampling` is not one
    (its options are the OpenAI fields temperature, top_p, top_k, seed), nor what the server sets (_SERVER_ONLY)."""
    fields: dict[str, tuple[str, ...]] = {}
    for v in VERIFIER_REGISTRY.values():
        for name in v.options:
            if name in OPTIONS and name not in _SERVER_ONLY and name not in OPENAI_FIELDS:
                fields[name] = fields.get(name, ()) + (v.name,)
    return fields


def request_field(option: str) -> str:
    """The request field a generate option comes from (`max_tokens`, `mtp.top_n`)."""
    if option in OPENAI_FIELDS:
        return OPENAI_FIELDS[option]
    return f"mtp.{option}" if option in DRAFT_FIELDS or option in verifier_fields() else option


def generate_options(body: Mapping[str, Any], defaults: Defaults) -> dict[str, Any]:
    """The server's generate options with the request's sampling fields and `mtp` settings applied."""
    options = dict(defaults.options)
    spec = body.get("mtp") or {}
    if not isinstance(spec, Mapping):
        raise RequestError("mtp", f"mtp must be an object of speculative settings, got {spec!r:.80}")
    known = DRAFT_FIELDS + tuple(verifier_fields())
    unknown = sorted(set(spec) - set(known))
    if unknown:
        raise RequestError(f"mtp.{unknown[0]}", f"mtp.{unknown[0]} is not a per-request setting; "
                                                f"known: {', '.join(known)}")
    options.update(spec)
    if "draft" in spec and "k" not in spec:  # k of the new draft: the server's, or 1 when the server drafts nothing
        options["k"] = (defaults.options.get("k") or None) if drafts(spec["draft"]) else 0
    t = body.get("temperature")
    if t is not None:
        if is_number(t) and t == 0:
            options.pop("temperature", None)
            if "verify" not in spec:
                options["verify"] = "strict"
                options["draft_sampling"] = "greedy"
        else:
            options["temperature"] = t
            if "verify" not in spec:
                options["verify"] = "sample"
    for name in ("top_p", "top_k", "seed"):
        if body.get(name) is not None:
            options[name] = body[name]
    return options


def _job(kind: str, body: Mapping[str, Any], ids: list[int], defaults: Defaults, tok: Tokenizer, model,
         thinking: bool, tools: bool) -> Job:
    max_new = body.get("max_completion_tokens", body.get("max_tokens"))
    asked = max_new is not None
    max_new = max_new if asked else defaults.max_new_tokens
    options = generate_options(body, defaults)
    options.setdefault("think_ids", (tok.think_id, tok.end_think_id))
    try:
        config = GenerationConfig.from_options(max_new, **options)
        config.validate(model)
    except OptionError as e:
        name = request_field(e.name)
        raise RequestError(name, e.say(name)) from None
    except ValueError as e:  # rules that need the model (MTP modules for k drafts)
        raise RequestError("mtp", f"mtp: {e}") from None
    _check_read(body.get("mtp") or {}, config)
    limit = context_limit(model, config, defaults)
    if not asked and len(ids) < limit < len(ids) + max_new:
        config = dataclasses.replace(config, max_new_tokens=limit - len(ids))  # no max_tokens: what room is left
    if len(ids) + config.max_new_tokens > limit:
        raise RequestError("max_tokens", f"the prompt is {len(ids)} tokens; + max_tokens {config.max_new_tokens} "
                                         f"exceeds max_model_len {limit}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream", f"stream must be a bool, got {stream!r:.80}")
    usage = (body.get("stream_options") or {}).get("include_usage", False) if stream else True
    return Job(kind, ids, config, thinking=thinking, tools=tools, stop=_stop(body), stream=stream,
               include_usage=bool(usage))


def _check_read(spec: Mapping[str, Any], config: GenerationConfig) -> None:
    """A verifier option the request sets is one its verifier reads: never silently dropped (temperature > 0 picks
    verify='sample' unless mtp.verify names one, so mtp.top_n alone would otherwise do nothing)."""
    for name, readers in verifier_fields().items():
        if name in spec and name not in config.verifier.options:
            raise RequestError(f"mtp.{name}", f"mtp.{name} is an option of verify={' / '.join(readers)}, not of "
                                              f"verify={config.verify!r}, which this request runs (set mtp.verify)")


def context_limit(model, config: GenerationConfig | None, defaults: Defaults) -> int:
    """Most prompt + max_tokens tokens a request may take: max_model_len, and the engine's buffers (prompt +
    max_new_tokens + the drafts' room within max_position_embeddings)."""
    from ..spec.options import draft_room

    k = config.draft.k if config is not None else int(defaults.options.get("k") or 0)
    engine = model.cfg.max_position_embeddings - draft_room(k)
    return engine if defaults.max_model_len is None else min(defaults.max_model_len, engine)


def check_model(body: Any, served: Sequence[str]) -> None:
    name = body.get("model") if isinstance(body, Mapping) else None
    if name is not None and name not in served:
        raise RequestError("model", f"model {name!r} is not served here; served: {', '.join(served)}", status=404)
