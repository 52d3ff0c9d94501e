"""The OpenAI-compatible HTTP front end (FastAPI): `/v1/models`, `/v1/chat/completions`, `/v1/completions`
(plain and streamed as server-sent events ending in `data: [DONE]`), `/health` and `/metrics` (Prometheus).

    app = create_app(LocalBackend(model), tokenizer, Defaults(...), model_name="dsv32")
    uvicorn.run(app, host="127.0.0.1", port=8000)            # what `mtp-serve` does

Requests are validated here (mtp/serve/protocol.py; a bad one gets HTTP 400 naming the field and the server goes
on), queued and run one at a time by a `Worker` (mtp/serve/backend.py), their tokens turned into OpenAI deltas by
`ReplyText` (mtp/serve/stream.py). Every response carries `usage` and an `mtp` object with the request's acceptance
and timing (mtp/serve/metrics.py); a streamed one sends them in its last chunk (`usage` only with
`stream_options.include_usage`, as OpenAI does). A client that disconnects stops its generation at the next step.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..text.tokenizer import Tokenizer
from .backend import Backend, Outcome, Worker
from .metrics import ServerMetrics, acceptance
from .protocol import Defaults, Job, RequestError, check_model, context_limit, parse_chat, parse_completion
from .stream import Delta, ReplyText

_POLL_S = 0.1  # how often a plain (unstreamed) request checks that its client is still there


def _error(e: RequestError) -> JSONResponse:
    kind = "invalid_request_error" if e.status == 400 else "not_found_error"
    return JSONResponse({"error": {"message": str(e), "type": kind, "param": e.field, "code": None}},
                        status_code=e.status)


class _Run:
    """One request in flight: deltas flow from the worker thread to the event loop through a queue."""

    def __init__(self, job: Job, tok: Tokenizer, worker: Worker):
        self.job, self.t0 = job, time.perf_counter()
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.stop = threading.Event()
        self.text = ReplyText(tok, job.thinking, job.tools, job.stop)
        self.t_first: float | None = None
        self.recorded = False
        future = worker.submit(job.prompt_ids, job.config, self._on_tokens,
                               lambda: self.stop.is_set() or self.text.stopped)
        self.future = asyncio.wrap_future(future)
        self.future.add_done_callback(lambda _: self.queue.put_nowait(None))

    def _on_tokens(self, tokens: list[int], accepted: int) -> None:  # worker thread
        if self.t_first is None:
            self.t_first = time.perf_counter()
        delta = self.text.push(tokens)
        if delta:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, delta)

    async def deltas(self) -> AsyncIterator[Delta]:
        while (d := await self.queue.get()) is not None:
            yield d

    def finish(self, out: Outcome) -> tuple[Delta, str]:
        """The last delta and the OpenAI finish reason."""
        last = self.text.finish(interrupted=out.finish_reason == "interrupted")
        reason = "stop" if self.text.stopped else out.finish_reason
        return last, "tool_calls" if last.tool_calls else reason

    def usage(self, out: Outcome) -> dict[str, int]:
        n = len(self.job.prompt_ids)
        return {"prompt_tokens": n, "completion_tokens": len(out.tokens), "total_tokens": n + len(out.tokens)}


def create_app(backend: Backend, tokenizer: Tokenizer, defaults: Defaults, model_name: str, model) -> FastAPI:
    """The server over `backend` (`model` is read for its vocabulary and limits only; the backend runs it)."""
    app = FastAPI(title="mtp-serve")
    worker = Worker(backend)
    metrics = ServerMetrics()
    created = int(time.time())
    app.state.worker, app.state.metrics = worker, metrics
    app.router.add_event_handler("shutdown", worker.close)

    def record(run: _Run, out: Outcome, reason: str) -> None:
        run.recorded = True
        ttft = None if run.t_first is None else run.t_first - run.t0
        metrics.record(out.metrics, reason, ttft, time.perf_counter() - run.t0, out.queue_s)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "mtp", "max_model_len": context_limit(model, None, defaults)}]}

    async def serve(request: Request, parse) -> Response:
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RequestError("body", f"the request body is not valid JSON: {e}") from None
            check_model(body, [model_name])
            job = parse(body, defaults, tokenizer, model)
        except RequestError as e:
            return _error(e)
        run = _Run(job, tokenizer, worker)
        if job.stream:
            return StreamingResponse(_stream(run, request), media_type="text/event-stream")
        return await _plain(run, request)

    async def _plain(run: _Run, request: Request) -> Response:
        while not run.future.done():
            await asyncio.wait([run.future], timeout=_POLL_S)
            if not run.future.done() and await request.is_disconnected():
                run.stop.set()
        async for _ in run.deltas():  # drained: the text is complete
            pass
        try:
            out = run.future.result()
        except Exception as e:  # a failure inside generation: the request fails, the server goes on
            return JSONResponse({"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error",
                                           "param": None, "code": None}}, status_code=500)
        _, reason = run.finish(out)
        record(run, out, reason)
        msg = run.text.message
        rid = f"{'chatcmpl' if run.job.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        if run.job.kind == "chat":
            choice = {"index": 0, "message": {k: v for k, v in msg.items() if v or k == "content"},
                      "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": msg["content"], "finish_reason": reason, "logprobs": None}
            obj = "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                             "choices": [choice], "usage": run.usage(out), "mtp": acceptance(out.metrics)})

    async def _stream(run: _Run, request: Request) -> AsyncIterator[str]:
        chat = run.job.kind == "chat"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: Delta | None, reason: str | None = None, role: bool = False, **extra: Any) -> str:
            if chat:
                d: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
                if delta is not None:
                    d.update({k: v for k, v in (("reasoning_content", delta.reasoning), ("content", delta.content))
                              if v})
                if delta is not None and delta.tool_calls:
                    d["tool_calls"] = [{"index": i, **c} for i, c in enumerate(delta.tool_calls)]
                choice = {"index": 0, "delta": d, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": "" if delta is None else delta.content, "finish_reason": reason,
                          "logprobs": None}
            payload = {"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                       "choices": [choice], **extra}
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        try:
            if chat:
                yield chunk(None, role=True)
            async for d in run.deltas():
                if d.reasoning or d.content:
                    yield chunk(d)
            try:
                out = run.future.result()
            except Exception as e:
                err = {"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error"}}
                yield f"data: {json.dumps(err)}\n\n"
                yield "data: [DONE]\n\n"
                return
            last, reason = run.finish(out)
            record(run, out, reason)
            if last:
                yield chunk(last)
            extra = {"mtp": acceptance(out.metrics)}
            if run.job.include_usage:
                extra["usage"] = run.usage(out)
            yield chunk(None, reason, **extra)
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the generator is closed) or the reply ended: stop generating either way
            run.stop.set()
            if not run.recorded:  # counted when the worker has stopped it
                run.future.add_done_callback(
                    lambda f: f.cancelled() or f.exception() or record(run, f.result(), f.result().finish_reason))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, parse_chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, parse_completion)

    return app
