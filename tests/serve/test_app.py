"""mtp-serve over real HTTP on 127.0.0.1, driven by the `openai` client, on the bundled model (CPU)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn

import mtp
from mtp.checkpoint.tiny import default_checkpoint
from mtp.decode.metrics import SpecMetrics
from mtp.serve.app import create_app
from mtp.serve.backend import LocalBackend, Outcome
from mtp.serve.protocol import Defaults
from mtp.text.dsml import tool_calls_text
from mtp.text.tokenizer import END_THINK, EOS, Tokenizer

WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string"}}, "required": ["city"]}}}]


class ScriptedFirst:
    """The real backend, except that the next request answers with `script` (a reply text the bundled model
    was not trained to write: DSML tool calls), streamed token by token as the engine would."""

    def __init__(self, real: LocalBackend, tok: Tokenizer):
        self.real, self.tok, self.script = real, tok, None
        self.prompts: list[list[int]] = []
        self.configs = []  # the GenerationConfig of each request, as the engine gets it

    def generate(self, prompt_ids, config, on_tokens, should_stop):
        self.prompts.append(list(prompt_ids))
        self.configs.append(config)
        if self.script is None:
            return self.real.generate(prompt_ids, config, on_tokens, should_stop)
        ids, self.script = self.tok.encode(self.script), None
        for i in range(0, len(ids), 3):
            on_tokens(ids[i:i + 3], 0)
        m = SpecMetrics(k=config.draft.k, draft=config.draft.mode, verify=config.verify, n_rows=1,
                        prompt_tokens=len(prompt_ids), new_tokens=len(ids))
        return Outcome(ids, "stop", m)


@pytest.fixture(scope="module")
def server():
    path = default_checkpoint()
    model = mtp.load_model(path, device="cpu", dtype=torch.float32)
    tok = Tokenizer.from_dir(path)
    backend = ScriptedFirst(LocalBackend(model), tok)
    defaults = Defaults(max_new_tokens=16, thinking=True, options={"draft": "eagle", "k": 2, "verify": "strict"})
    app = create_app(backend, tok, defaults, "stdlib-mini", model)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    for _ in range(200):  # up to 20 s
        if srv.started:
            break
        time.sleep(0.1)
    assert srv.started, "the server did not start"
    port = srv.servers[0].sockets[0].getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    yield {"client": client, "base": base, "backend": backend, "tok": tok, "model": model}
    srv.should_exit = True
    thread.join(timeout=20)
    assert not thread.is_alive(), "the server did not stop"


def metric(base: str, name: str, missing: float | None = None) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
    if not values and missing is not None:
        return missing
    assert values, f"{name} not in /metrics:\n{text[:2000]}"
    return values[0]


def test_models_lists_the_served_model(server):
    assert [m.id for m in server["client"].models.list().data] == ["stdlib-mini"]


def test_plain_chat_reply_with_usage_and_acceptance(server):
    c = server["client"]
    msgs = [{"role": "user", "content": "Return a copy of the list in reverse order."}]
    r = c.chat.completions.create(model="stdlib-mini", messages=msgs, max_tokens=12, temperature=0)
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    ext = r.model_extra["mtp"]
    assert ext["draft"] == "eagle" and ext["k"] == 2 and ext["verify"] == "strict"
    assert ext["num_draft_tokens"] == 2 * ext["num_drafts"] > 0
    assert ext["draft_acceptance_rate"] == pytest.approx(ext["num_accepted_tokens"] / ext["num_draft_tokens"])
    assert ext["mean_accepted_len"] == pytest.approx(1 + ext["num_accepted_tokens"] / ext["num_drafts"])
    # the same tokens as mtp.generate on the same prompt (thinking on: the server's default)
    from mtp.text.prompt import encode_chat
    tok = server["tok"]
    ids = encode_chat(msgs, tok, thinking=True)
    ref = mtp.generate(server["model"], [ids], 12, draft="eagle", k=2, verify="strict")
    text = tok.decode(ref.tokens[0])
    reasoning = r.choices[0].message.model_extra.get("reasoning_content") or ""
    assert text.startswith(reasoning) and reasoning + END_THINK in text or reasoning == text


def test_streamed_chat_equals_plain_and_ends_with_done(server):
    c, base = server["client"], server["base"]
    msgs = [{"role": "user", "content": "Return the sum of the numbers."}]
    plain = c.chat.completions.create(model="stdlib-mini", messages=msgs, max_tokens=10, temperature=0,
                                      extra_body={"thinking": {"type": "disabled"}, "mtp": {"k": 1}})
    before = metric(base, "mtp:spec_decode_num_drafts_total")
    chunks = list(c.chat.completions.create(model="stdlib-mini", messages=msgs, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"thinking": {"type": "disabled"}, "mtp": {"k": 1}}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == plain.choices[0].message.content and text
    last = chunks[-1]
    assert last.usage.completion_tokens == 10 and last.model_extra["mtp"]["k"] == 1
    assert metric(base, "mtp:spec_decode_num_drafts_total") - before == last.model_extra["mtp"]["num_drafts"] > 0
    raw = httpx.post(f"{base}/v1/chat/completions", json={"messages": msgs, "max_tokens": 3, "stream": True},
                     timeout=60).text
    assert raw.rstrip().endswith("data: [DONE]")


def test_streamed_tool_call_round_trip(server):
    c, backend, tok = server["client"], server["backend"], server["tok"]
    call = [{"type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Lisbon"})}}]
    backend.script = "The weather needs a tool." + END_THINK + "Let me check." + \
        tool_calls_text(call, "script") + EOS
    msgs = [{"role": "user", "content": "Weather in Lisbon?"}]
    chunks = list(c.chat.completions.create(model="stdlib-mini", messages=msgs, tools=WEATHER, stream=True))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    reasoning = "".join(ch.choices[0].delta.model_extra.get("reasoning_content") or "" for ch in chunks)
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert reasoning == "The weather needs a tool." and content == "Let me check."
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [("get_weather", {"city": "Lisbon"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the result goes back; the real model answers after it, its prompt holding the call and the result
    msgs += [{"role": "assistant", "content": content, "reasoning_content": reasoning,
              "tool_calls": [{"id": calls[0].id, "type": "function",
                              "function": {"name": "get_weather", "arguments": calls[0].function.arguments}}]},
             {"role": "tool", "tool_call_id": calls[0].id, "content": "21 C, sunny"}]
    r = c.chat.completions.create(model="stdlib-mini", messages=msgs, tools=WEATHER, max_tokens=6, stream=True)
    assert sum(1 for _ in r) >= 2
    prompt = tok.decode(backend.prompts[-1])
    assert "<result>21 C, sunny</result>" in prompt and 'name="get_weather"' in prompt


@pytest.mark.parametrize("body, field, text", [
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be an integer >= 1, got 0"),
    ({"temperature": -1}, "temperature", "temperature must be a number > 0, got -1"),
    ({"top_p": 2}, "top_p", "top_p must be a number in (0, 1] (1 = off), got 2"),
    ({"mtp": {"k": 99}}, "mtp.k", "mtp.k must be an integer in [1, 16]"),
    ({"mtp": {"mode": "graph"}}, "mtp.mode", "mtp.mode is not a per-request setting"),
    ({"mtp": {"verify": "typical", "posterior_alpha": 2}}, "mtp.posterior_alpha",
     "mtp.posterior_alpha must be a probability in (0, 1], got 2"),
    ({"mtp": {"verify": "typical", "posterior_threshold": "high"}}, "mtp.posterior_threshold",
     "mtp.posterior_threshold must be a probability in (0, 1], got 'high'"),
    ({"mtp": {"posterior_threshold": 0.2}}, "mtp.posterior_threshold",
     "mtp.posterior_threshold is an option of verify=typical, not of verify='strict'"),
    ({"temperature": 0.7, "mtp": {"top_n": 3}}, "mtp.top_n", "mtp.top_n is an option of verify=relaxed, not of "
                                                              "verify='sample'"),
    ({"n": 2}, "n", "n must be 1"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice must be 'auto' or 'none'"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages", "messages[0]: unknown role 'robot'"),
])
def test_bad_request_is_a_400_naming_the_field_and_the_server_goes_on(server, body, field, text):
    c = server["client"]
    req = {"model": "stdlib-mini", "messages": [{"role": "user", "content": "hi"}]}
    extra = {k: body.pop(k) for k in ("mtp",) if k in body}
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(**{**req, **body}, extra_body=extra)
    assert e.value.status_code == 400 and text in e.value.message and e.value.body["param"] == field
    r = c.chat.completions.create(model="stdlib-mini", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_typical_options_per_request_reach_the_engine(server):
    c, backend = server["client"], server["backend"]
    msgs = [{"role": "user", "content": "Return the list reversed."}]
    spec = {"verify": "typical", "posterior_threshold": 0.2, "posterior_alpha": 0.05}
    r = c.chat.completions.create(model="stdlib-mini", messages=msgs, max_tokens=6, temperature=0.5,
                                  extra_body={"mtp": spec})
    g = backend.configs[-1]
    assert r.usage.completion_tokens == 6 and r.model_extra["mtp"]["verify"] == "typical"
    assert (g.verify, g.posterior_threshold, g.posterior_alpha, g.sampling.temperature) == ("typical", 0.2, 0.05, 0.5)
    c.chat.completions.create(model="stdlib-mini", messages=msgs, max_tokens=2, extra_body={"mtp": {"verify": "typical"}})
    assert (backend.configs[-1].posterior_threshold, backend.configs[-1].posterior_alpha) == (0.09, 0.3)  # defaults


def test_completions_plain_and_streamed(server):
    c = server["client"]
    r = c.completions.create(model="stdlib-mini", prompt="def reverse(xs):", max_tokens=8, temperature=0)
    s = list(c.completions.create(model="stdlib-mini", prompt="def reverse(xs):", max_tokens=8, temperature=0,
                                  stream=True))
    assert "".join(ch.choices[0].text for ch in s) == r.choices[0].text and r.usage.completion_tokens == 8
    with pytest.raises(openai.BadRequestError, match="prompt holds token id"):
        c.completions.create(model="stdlib-mini", prompt=[10**9], max_tokens=2)


def test_a_client_that_leaves_stops_its_generation(server):
    base = server["base"]
    name = 'mtp:request_success_total{finished_reason="interrupted"}'
    before = metric(base, name, missing=0.0)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "stream": True,
            "thinking": {"type": "disabled"}}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {") and '"content"' in line and '"role"' not in line:
                break  # leave after the first text
    for _ in range(100):  # the interrupted reply is counted once the worker stops it (bounded: 10 s)
        if metric(base, name, missing=0.0) > before:
            break
        time.sleep(0.1)
    assert metric(base, name) == before + 1
    generated = metric(base, "mtp:generation_tokens_total")
    r = server["client"].chat.completions.create(model="stdlib-mini", messages=body["messages"], max_tokens=2)
    assert r.usage.completion_tokens == 2  # the worker is free again
    assert metric(base, "mtp:generation_tokens_total") - generated == 2  # the left reply generated no more
