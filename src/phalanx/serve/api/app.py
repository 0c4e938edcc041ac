"""The OpenAI-compatible HTTP API on Starlette: routes, one error mapping, auth.

Thin by design (docs/architecture.md, Style 11): decode and validate the request, turn
it into token ids and sampling parameters, run it on the engine, shape the answer.
Per-request errors (4xx) are apart from engine death (503); 500 is only for a bug.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from phalanx.engine import SamplingParams
from phalanx.engine.core.grammar import Grammar
from phalanx.errors import EngineError, RequestError, StepFailedError
from phalanx.lifecycle.failpoints import Failpoint

from . import responses as rsp
from . import structured
from .engine_client import EngineClient
from .errors import APIError, error_body
from .metrics import Metrics
from .openapi import openapi_document
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    decode_request,
)
from .responses_api import ResponseBuilder
from .responses_protocol import ResponsesRequest
from .responses_setup import responses_grammar, responses_tools
from .state import RateWindow, ServerInfo, state_document
from .streams import Choices
from .tools import ChoiceDeltas, ToolSetup, shape_response
from .web import web_routes

__all__ = ["ServeSettings", "build_app"]

_T = TypeVar("_T")

log = logging.getLogger("phalanx.serve")

# Text longer than this is tokenized (and chat messages rendered) on a thread, not on
# the event loop: a prompt just under the body limit took 3.7 s, during which nothing
# else, /health included, was answered (issue 45). Shorter text costs less than the
# thread hop (~50 us).
_LARGE_TEXT = 32 << 10
_TOKENIZE = Failpoint("serve.api.tokenize")


@dataclass(frozen=True)
class ServeSettings:
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    max_prompts: int = 256   # prompts in one request: the server's admission slots
    info: ServerInfo = field(default_factory=ServerInfo)  # what /state shows of the shape
    web_ui: bool = True      # GET / serves the page (--no-web-ui: a 404)


def _json(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def _error(exc: APIError) -> Response:
    return Response(exc.body(), status_code=exc.status, media_type="application/json",
                    headers=exc.headers())


class _Guard:
    """ASGI middleware: API key (constant-time compare) and the body size limit (413),
    both before a route reads anything.

    Open without the key: health, metrics and the state built from the same figures,
    the API's description, and the web page's static files (they hold no data: the page
    asks for the key and sends it on every API call it makes)."""

    _OPEN = ("/health", "/metrics", "/state", "/openapi.json", "/web/")
    _OPEN_EXACT = ("/",)

    def __init__(self, app: ASGIApp, settings: ServeSettings) -> None:
        self.app = app
        self.key = settings.api_key.encode() if settings.api_key else None
        self.limit = settings.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        path = scope["path"]
        if (self.key is not None and not path.startswith(self._OPEN)
                and path not in self._OPEN_EXACT):
            given = headers.get(b"authorization", b"")
            expected = b"Bearer " + self.key
            if not hmac.compare_digest(given, expected):
                await _error(APIError(
                    401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key"))(scope, receive, send)
                return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await _error(self._too_large())(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise APIError(413, self._too_large().message)
            return message

        await self.app(scope, limited, send)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body exceeds {self.limit} bytes",
                        code="request_too_large")


class _Api:
    """The routes, bound to one engine, its settings and its metrics."""

    def __init__(self, engine: EngineClient, settings: ServeSettings, metrics: Metrics) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self._openapi = openapi_document(settings.served_model_name,
                                         settings.api_key is not None)
        self._rates = RateWindow()

    # -- helpers ----------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.served_model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                           f"{self.settings.served_model_name!r} (see GET /v1/models)",
                           param="model", code="model_not_found")

    def _budget(self, prompt_len: int, max_tokens: int | None, param: str) -> int:
        limit = self.engine.max_model_len
        if prompt_len >= limit:
            raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context "
                           f"is {limit} tokens (prompt plus output)", param="prompt",
                           code="context_length_exceeded")
        if max_tokens is None:
            return limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise APIError(400, f"{param}={max_tokens} plus the prompt's {prompt_len} tokens "
                           f"exceeds this model's context of {limit} tokens; lower {param}",
                           param=param, code="context_length_exceeded")
        return max_tokens

    def _params(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                logprobs: int | None, grammar: Grammar | None = None
                ) -> list[SamplingParams]:
        """The request's ``n`` choices' parameters: choice ``i`` samples with ``seed + i``
        (vLLM's rule), so a seeded request's choices differ and each is reproducible."""
        return [SamplingParams(
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            seed=None if req.seed is None else req.seed + i,
            max_tokens=max_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos, logprobs=logprobs, grammar=grammar)
            for i in range(req.n)]

    async def _grammar(self, req: ChatCompletionRequest, tools: ToolSetup | None
                       ) -> Grammar | None:
        """The request's grammar: its structured output's, else its tools' (forced
        calls, or ``auto``'s valid calls in free text); a structured output with forced
        calls is a 400."""
        wanted = structured.constraint_of(req.response_format, req.structured_outputs)
        if tools is None or (wanted is not None and tools.choice in ("auto", "none")):
            return await structured.grammar_of(req.response_format, req.structured_outputs)
        if wanted is not None:
            raise APIError(400, "tool_choice forces a function call, which leaves no room "
                           "for response_format or structured_outputs: send one of them",
                           param="tool_choice")
        return await asyncio.to_thread(tools.grammar)

    def _check_serving(self) -> None:
        """A 503 with Retry-After before any work while the engine is down or healing."""
        health = self.engine.health()
        if not health.ok:
            raise APIError(503, f"the engine is not serving: {health.reason}",
                           code="engine_unavailable", retry_after=5)

    async def _off_loop(self, size: int, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` (tokenizing, rendering): on a thread when ``size`` (characters
        of text) is large, so the event loop keeps answering everyone else."""
        if size <= _LARGE_TEXT:
            return fn(*args)

        def run() -> _T:
            _TOKENIZE.hit()
            return fn(*args)

        return await asyncio.to_thread(run)

    async def _start(self, prompts: list[list[int]], params: list[SamplingParams],
                     rid: str, n: int = 1) -> Choices:
        """Every prompt's ``n`` choices (``params`` holds each prompt's run of ``n``);
        choice ``i * n + j`` is prompt ``i``'s ``j``-th, as OpenAI indexes them."""
        # the routes checked health before their work; an engine that died since makes
        # generate_many raise EngineDeadError, the same 503
        runs = [p for p in prompts for _ in range(n)]
        streams = self.engine.generate_many(
            [(f"{rid}-{i}", p, sp)
             for i, (p, sp) in enumerate(zip(runs, params, strict=True))], n)
        choices = Choices(streams, self.metrics)
        try:
            await choices.start()
        except EngineError as exc:
            raise _engine_error(exc) from exc
        return choices

    def _tokenize_all(self, texts: list[str]) -> list[list[int]]:
        return [self.engine.tokenize(t) for t in texts]

    # -- routes -----------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        return _json({"object": "list", "data": [{
            "id": self.settings.served_model_name, "object": "model",
            "created": 0, "owned_by": "phalanx", "max_model_len": self.engine.max_model_len,
        }]})

    async def health(self, request: Request) -> Response:
        h = self.engine.health()
        body = {"status": "ok" if h.ok else "unavailable", "reason": h.reason, **h.detail}
        return Response(msgspec.json.encode(body), status_code=200 if h.ok else 503,
                        media_type="application/json",
                        headers={} if h.ok else {"Retry-After": "5"})

    async def openapi(self, request: Request) -> Response:
        return _json(self._openapi)

    async def metrics_route(self, request: Request) -> Response:
        stats = await asyncio.to_thread(self.engine.stats)  # may ask the ranks: off the loop
        body, content_type = self.metrics.sample(stats).render()
        return Response(body, media_type=content_type)

    async def state(self, request: Request) -> Response:
        """The page's JSON: the figures of /metrics (one Sample), the server's shape,
        its health and rates over the last seconds (serve/api/state.py)."""
        stats = await asyncio.to_thread(self.engine.stats)
        sample = self.metrics.sample(stats)
        doc = state_document(sample, self._rates.add(time.monotonic(), sample),
                             self.settings.info, self.settings.served_model_name,
                             self.engine.health(), self.settings.api_key is not None)
        return Response(msgspec.json.encode(doc), media_type="application/json",
                        headers={"Cache-Control": "no-store"})

    async def tokenize(self, request: Request) -> Response:
        req = decode_request(await request.body(), TokenizeRequest)
        self._check_model(req.model)
        self._check_serving()
        if req.messages is not None:
            messages = _messages(req.messages)
            ids = await self._off_loop(_chars(messages), self.engine.chat_prompt, messages)
        else:
            assert req.prompt is not None
            ids = await self._off_loop(len(req.prompt), self.engine.tokenize, req.prompt,
                                       req.add_special_tokens)
        return _json({"tokens": ids, "count": len(ids), "max_model_len":
                      self.engine.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        req = decode_request(await request.body(), DetokenizeRequest)
        self._check_model(req.model)
        self._check_serving()
        text = await self._off_loop(len(req.tokens), self.engine.detokenize, req.tokens)
        return _json({"prompt": text})

    async def completions(self, request: Request) -> Response:
        req = decode_request(await request.body(), CompletionRequest)
        self._check_model(req.model)
        given = req.prompts()
        if len(given) * req.n > self.settings.max_prompts:
            raise APIError(400, f"{len(given)} prompts of n={req.n} choices each make "
                           f"{len(given) * req.n} choices; this server admits at most "
                           f"{self.settings.max_prompts} at once (its --max-num-seqs plus "
                           f"--max-waiting): send fewer per request",
                           param="n" if req.n > 1 else "prompt", code="too_many_prompts")
        self._check_serving()
        grammar = await structured.grammar_of(req.response_format, req.structured_outputs)
        texts = [p for p in given if isinstance(p, str)]
        encoded = iter(await self._off_loop(sum(map(len, texts)), self._tokenize_all, texts))
        prompts = [next(encoded) if isinstance(p, str) else p for p in given]
        params = [sp for p in prompts for sp in self._params(
            req, self._budget(len(p), req.max_tokens, "max_tokens"), req.logprobs, grammar)]
        rid = f"cmpl-{uuid.uuid4().hex}"
        n = req.n
        choices = await self._start(prompts, params, rid, n)
        text = self.engine.token_text
        want_lp = req.logprobs is not None
        model = self.settings.served_model_name
        if not req.stream:
            states = await _collect(choices, len(params), request)
            return _json(rsp.completion_response(rid, model, states, text, want_lp, n))
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events() -> AsyncIterator[bytes]:
            states = [rsp.ChoiceState(i) for i in range(len(params))]
            async for i, d in choices.merged():
                states[i].add(d)
                if d.text or d.finish_reason is not None or d.token_ids:
                    yield _sse(rsp.completion_chunk(rid, model, created, i, d, text, want_lp))
            if include_usage:
                yield _sse(rsp.usage_chunk(rid, model, created, "text_completion", states, n))
            yield b"data: [DONE]\n\n"

        return _stream(events(), choices)

    async def chat(self, request: Request) -> Response:
        req = decode_request(await request.body(), ChatCompletionRequest)
        self._check_model(req.model)
        self._check_serving()
        tools = ToolSetup.of(req.tools, req.tool_choice, req.parallel_tool_calls,
                             self.engine.chat_template)
        grammar = await self._grammar(req, tools)
        messages = _messages(req.messages)
        prompt = await self._off_loop(_chars(messages), self.engine.chat_prompt, messages,
                                      tools.tools if tools is not None else None)
        param = "max_completion_tokens" if req.max_completion_tokens is not None \
            else "max_tokens"
        k = (req.top_logprobs or 0) if req.logprobs else None
        n = req.n
        params = self._params(req, self._budget(len(prompt), req.token_limit, param), k,
                              grammar)
        if tools is not None:
            params = tools.sampling(params)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        choices = await self._start([prompt], params, rid, n)
        text = self.engine.token_text
        model = self.settings.served_model_name
        if not req.stream:
            states = await _collect(choices, n, request)
            return _json(shape_response(
                rsp.chat_response(rid, model, states, text, req.logprobs, n), tools))
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events() -> AsyncIterator[bytes]:
            states = [rsp.ChoiceState(i) for i in range(n)]
            for i in range(n):
                yield _sse(rsp.chat_chunk(rid, model, created, i,
                                          {"role": "assistant", "content": ""}, None, None))
            deltas = [ChoiceDeltas(tools) for _ in range(n)]  # content or tool calls
            async for i, d in choices.merged():
                states[i].add(d)
                lp = rsp.chat_logprobs(d.logprobs, text) if req.logprobs else None
                if d.text or d.token_ids:
                    for delta in deltas[i].feed(d.text) or [{"content": ""}]:
                        yield _sse(rsp.chat_chunk(rid, model, created, i, delta, None, lp))
                        lp = None
                if d.finish_reason is not None:
                    rest, reason = deltas[i].finish(d.finish_reason)
                    for delta in rest:
                        yield _sse(rsp.chat_chunk(rid, model, created, i, delta, None, None))
                    yield _sse(rsp.chat_chunk(rid, model, created, i, {}, reason, None))
            if include_usage:
                yield _sse(rsp.usage_chunk(rid, model, created, "chat.completion.chunk",
                                           states, n))
            yield b"data: [DONE]\n\n"

        return _stream(events(), choices)

    async def responses(self, request: Request) -> Response:
        """``POST /v1/responses``, stateless (responses_protocol.py, responses_api.py)."""
        req = decode_request(await request.body(), ResponsesRequest)
        self._check_model(req.model)
        self._check_serving()
        tools = responses_tools(req, self.engine.chat_template)
        grammar = await responses_grammar(req, tools)
        messages = req.messages()
        prompt = await self._off_loop(_chars(messages), self.engine.chat_prompt, messages,
                                      tools.tools if tools is not None else None)
        params = [SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, grammar=grammar,
            max_tokens=self._budget(len(prompt), req.max_output_tokens, "max_output_tokens"))]
        if tools is not None:
            params = tools.sampling(params)
        out = ResponseBuilder(req, self.settings.served_model_name, tools)
        choices = await self._start([prompt], params, out.id)
        if not req.stream:
            states = await _collect(choices, 1, request)
            return _json(out.response(states[0]))
        return _stream(out.events(choices), choices)


def _messages(messages: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.text(i)}
        for extra in ("tool_calls", "tool_call_id"):
            if getattr(m, extra, None) is not None:
                msg[extra] = getattr(m, extra)
        out.append(msg)
    return out


def _chars(messages: list[dict[str, Any]]) -> int:
    return sum(len(m["content"]) for m in messages)


def _sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def _engine_error(exc: EngineError) -> APIError:
    if isinstance(exc, StepFailedError):  # the engine's own code failed on it: a bug
        return APIError(500, f"{exc}; please report it", code="step_failed")
    if isinstance(exc, RequestError):  # this request was refused; the engine lives on
        return APIError(400, str(exc), code="invalid_request")
    return APIError(503, f"the engine failed this request: {exc}", code="engine_unavailable",
                    retry_after=5)


async def _collect(choices: Choices, n: int, request: Request) -> list[rsp.ChoiceState]:
    """A non-streaming request's choices; a client that disconnects aborts them."""
    states = [rsp.ChoiceState(i) for i in range(n)]

    async def consume() -> None:
        async for i, d in choices.merged():
            states[i].add(d)

    task = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:  # the client went away: abort the engine requests
            raise APIError(499, "the client closed the connection")
        try:
            task.result()
        except EngineError as exc:
            raise _engine_error(exc) from exc
    finally:  # every exit (an error, a disconnect, a cancel) aborts what is left
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
        await choices.aclose()
    return states


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _ChoicesResponse(StreamingResponse):
    """A streamed answer that closes its choices on every exit: the body ran out, the
    client went away before or during it, the server cancelled it. (A body generator
    that never started never runs its own ``finally``.)"""

    def __init__(self, events: AsyncIterator[bytes], choices: Choices) -> None:
        super().__init__(_events_or_error(events), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.choices = choices

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.choices.aclose()


async def _events_or_error(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The events; a failure mid-stream (the status is sent) is said in the stream as
    an error event, then ``[DONE]``, so a client never sees a stream simply cut."""
    try:
        async for chunk in events:
            yield chunk
    except EngineError as exc:
        yield b"data: " + _engine_error(exc).body() + b"\n\n"
        yield b"data: [DONE]\n\n"


def _stream(events: AsyncIterator[bytes], choices: Choices) -> StreamingResponse:
    return _ChoicesResponse(events, choices)


def build_app(engine: EngineClient, settings: ServeSettings, metrics: Metrics, *,
              lifespan: Any = None) -> ASGIApp:
    """The ASGI application: routes, errors in OpenAI's shape, the guard middleware."""
    api = _Api(engine, settings, metrics)
    routes = [
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/responses", api.responses, methods=["POST"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics_route, methods=["GET"]),
        Route("/state", api.state, methods=["GET"]),
        Route("/openapi.json", api.openapi, methods=["GET"]),
        *(web_routes() if settings.web_ui else []),
    ]

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        metrics.client_error(exc.status)
        return _error(exc)

    async def on_engine_error(request: Request, exc: Exception) -> Response:
        # an engine state met outside a request's stream (its tokenizer while the
        # engine heals, ...): 503 + Retry-After, never the bug handler's 500
        assert isinstance(exc, EngineError)
        return await on_api_error(request, _engine_error(exc))

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}
        err = APIError(exc.status_code, message.get(exc.status_code, str(exc.detail)))
        return _error(err)

    async def on_bug(request: Request, exc: Exception) -> Response:
        log.exception("bug while serving %s %s", request.method, request.url.path)
        what = f"{type(exc).__name__}: {exc}"[:300]
        return Response(error_body(f"internal error ({what}); this is a bug in phalanx, "
                                   f"please report it", "server_error", None, None),
                        status_code=500, media_type="application/json")

    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        APIError: on_api_error, EngineError: on_engine_error, HTTPException: on_http_error,
        Exception: on_bug}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    return _Guard(app, settings)
