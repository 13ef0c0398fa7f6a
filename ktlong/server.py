"""`ktlong serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn, the `serve` extra).

Endpoints: POST /v1/chat/completions and /v1/completions (stream or not), GET /v1/models,
GET /health (whether the engine is busy, how many requests wait), and the chat page at `/` with
its routes (`ktlong.chatpage`). Requests are checked here
(JSON, model name, parameters, prompt length: a 4xx with an OpenAI error body, never a
traceback), rendered to ids, and handed to `serving.Engine`, which runs one at a time on the same
`Session` as `ktlong chat` and reuses the longest prefix it already holds or the prompt cache has.

A stream is Server-Sent Events as OpenAI sends them: `data: {json}` chunks of object
"chat.completion.chunk" (the first with the role, then content deltas, then one with
finish_reason; a usage chunk when `stream_options.include_usage`), then `data: [DONE]`. While a
long prompt is prefilled, SSE comments (`: prefill DONE/TOTAL tokens`) keep the connection alive;
clients ignore them. A client that leaves stops its request at the next token or prefill chunk.

A chat request may carry `"ktlong": {"document": ID, "passages": K}` (the page sends it; OpenAI
clients through `extra_body`): ID an uploaded document (`ktlong.chatpage`), placed as `-f` places
its document; K > 0 asks for the K passages the answer's selection attended most
(`ktlong.passages`). The answer then ends with `"ktlong": {"passages": [...], "stats": {...}}`
(the engine's prefill seconds, tok/s, context): a field of the response, or, streamed, one more
`data:` event before `[DONE]` with `"object": "ktlong.answer"` and no choices.

A chat longer than max_seq_len (`overflow: SHIFT`, the default) loses its oldest turns instead of
a 400 (`serving.Renderer.fit`: never the system messages, the `-f` document or the last user
message; the prompt keeps room for min(max_tokens, settings.max_new_tokens) tokens of answer),
and an answer that fills the store drops more of them to go on. What went is told without
breaking OpenAI clients: `usage.dropped_messages` and `usage.dropped_tokens` (extra fields), the
header `X-Ktlong-Dropped-Messages` (the count before the answer began, for a stream), and an SSE
comment when a stream's answer drops more. Only when the system messages and the last user
message alone do not fit is it a 400 `context_length_exceeded`, as always with `overflow: STOP`
and for /v1/completions (a raw prompt has no turns to drop). Under attention LOCRET the document
(or a whole prompt read at once) counts as the rows it keeps, its budget: a document longer than
max_seq_len is served.

No `from __future__ import annotations` here: FastAPI reads the handlers' annotations (`Request`,
imported with FastAPI inside `Server._build`, so the module imports without the extra).
"""
import asyncio
import hmac
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ktlong import __version__, chatpage
from ktlong.config import Settings
from ktlong.engine import Sampling, check_fits
from ktlong.errors import KtlongError
from ktlong.serving import Engine, Fitted, Job, Prompt, Renderer, prompt_rows

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOPS = 4  # as OpenAI
MAX_BODY = 64 << 20  # bytes of a JSON request (a 1M-token document is ~5 MB of text)
POLL_S = 0.5  # how often a waiting non-streamed request checks that its client is still there
DROPPED_HEADER = "X-Ktlong-Dropped-Messages"  # a chat's oldest messages left out (overflow SHIFT)


def require() -> None:
    """Refuse in one line when the `serve` extra is missing."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise KtlongError(f"ktlong serve needs FastAPI and uvicorn ({e.name} is missing)",
                          hint="pip install 'ktlong[serve]'") from None


class ApiError(Exception):
    """An OpenAI-style error: HTTP status and the body's message, type, param, code."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (status, message, type_,
                                                                       param, code)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _from_exception(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, KtlongError):  # the engine refused (too long, no room): the client's to fix
        return ApiError(400, str(e), code="context_length_exceeded"
                        if "max_seq_len" in e.message else None)
    first = str(e).splitlines()[0] if str(e) else ""
    return ApiError(500, f"internal error: {type(e).__name__}: {first}", "server_error")


# --- request checks ------------------------------------------------------------------------------
def _number(body: dict[str, Any], name: str, lo: float, hi: float, integer: bool = False,
            lo_open: bool = False) -> Any:
    v = body.get(name)
    if v is None:
        return None
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if not ok or isinstance(v, bool) or v < lo or v > hi or (lo_open and v == lo):
        what = "an integer" if integer else "a number"
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise ApiError(400, f"{name} must be {what} in {rng}, got {json.dumps(v)}", param=name,
                       code="invalid_value")
    return v


@dataclass
class Params:
    sampling: Sampling
    stop: list[str]
    stream: bool
    include_usage: bool
    document: str | None = None  # "ktlong": {"document": ID}: an uploaded document
    passages: int = 0  # "ktlong": {"passages": K}
    extra: bool = False  # "ktlong" was given: the answer ends with its "ktlong" numbers


def _extra(body: dict[str, Any]) -> tuple[str | None, int, bool]:
    """The request's `"ktlong"` object: (document id, passages, whether it was given)."""
    opts = body.get("ktlong")
    if opts is None:
        return None, 0, False
    if not isinstance(opts, dict):
        raise ApiError(400, "ktlong must be an object, e.g. {\"passages\": 3}", param="ktlong",
                       code="invalid_value")
    doc = opts.get("document")
    if doc is not None and not isinstance(doc, str):
        raise ApiError(400, "ktlong.document must be the id an upload returned",
                       param="ktlong.document", code="invalid_value")
    passages = opts.get("passages", 0)
    if not isinstance(passages, int) or isinstance(passages, bool) or not 0 <= passages <= 16:
        raise ApiError(400, f"ktlong.passages must be an integer in [0, 16], got "
                       f"{json.dumps(passages)}", param="ktlong.passages", code="invalid_value")
    return doc, passages, True


def _params(body: dict[str, Any], settings: Settings) -> Params:
    """The sampling parameters; request values over the settings' defaults."""
    max_tokens = body.get("max_completion_tokens")
    max_tokens = _number(body, "max_completion_tokens" if max_tokens is not None
                         else "max_tokens", 1, 1 << 30, integer=True)
    temperature = _number(body, "temperature", 0, 2)
    top_p = _number(body, "top_p", 0, 1, lo_open=True)
    top_k = _number(body, "top_k", 0, 1 << 30, integer=True)
    seed = _number(body, "seed", -(1 << 63), (1 << 64) - 1, integer=True)
    if body.get("n") not in (None, 1) or isinstance(body.get("n"), bool):
        raise ApiError(400, "n must be 1: one choice per request", param="n",
                       code="invalid_value")
    if body.get("best_of") not in (None, 1):
        raise ApiError(400, "best_of must be 1: one answer per request", param="best_of",
                       code="invalid_value")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise ApiError(400, "logprobs are not supported", param="logprobs",
                       code="unsupported_parameter")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) \
            or len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOPS} strings",
                       param="stop", code="invalid_value")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", param="stream", code="invalid_value")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options",
                       code="invalid_value")
    base = Sampling.from_settings(settings)
    sampling = Sampling(
        max_new_tokens=max_tokens if max_tokens is not None else base.max_new_tokens,
        temperature=float(temperature) if temperature is not None else base.temperature,
        top_p=float(top_p) if top_p is not None else base.top_p,
        top_k=top_k if top_k is not None else base.top_k,
        seed=seed % (1 << 63) if seed is not None else base.seed,
    )
    return Params(sampling, stops, stream, bool(opts.get("include_usage")), *_extra(body))


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "messages must be a non-empty list", param="messages",
                       code="invalid_value")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}",
                           param=f"{where}.role", code="invalid_value")
        content = m.get("content")
        if content is None and m["role"] == "assistant":
            content = ""
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise ApiError(400, f"{where}.content: only text parts are supported",
                               param=f"{where}.content", code="invalid_value")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"{where}.content must be a string or a list of text parts",
                           param=f"{where}.content", code="invalid_value")
        out.append({"role": ROLES[m["role"]], "content": content})
    return out


def _prompt(body: dict[str, Any], vocab: int) -> str | list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                         and 0 <= t < vocab for t in p):
        return p
    raise ApiError(400, f"prompt must be a string or a non-empty list of token ids below "
                   f"{vocab} (one prompt per request)", param="prompt", code="invalid_value")


# --- the app -------------------------------------------------------------------------------------
class Server:
    """The FastAPI app over one Engine."""

    def __init__(self, engine: Engine, renderer: Renderer, model_id: str,
                 api_key: str | None = None) -> None:
        self.engine, self.renderer, self.model_id = engine, renderer, model_id
        self.api_key = api_key or None
        self.created = int(time.time())
        self.documents = chatpage.Documents()
        self.app = self._build()

    def _build(self) -> Any:
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse
        from starlette.exceptions import HTTPException

        app = FastAPI(title="ktlong", version=__version__, docs_url=None, redoc_url=None,
                      openapi_url=None)

        @app.exception_handler(ApiError)
        async def _api_error(request: Request, e: ApiError) -> JSONResponse:
            return JSONResponse(e.body(), status_code=e.status)

        @app.exception_handler(HTTPException)
        async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
            code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
            return JSONResponse(ApiError(e.status_code, f"{e.detail}: {request.method} "
                                         f"{request.url.path}", code=code).body(),
                                status_code=e.status_code)

        @app.exception_handler(Exception)
        async def _any_error(request: Request, e: Exception) -> JSONResponse:
            err = _from_exception(e)
            return JSONResponse(err.body(), status_code=err.status)

        @app.get("/health")
        async def health() -> dict[str, Any]:
            return {"status": "ok", "model": self.model_id, **self.engine.health()}

        @app.get("/v1/models")
        async def models(request: Request) -> dict[str, Any]:
            self._auth(request)
            return {"object": "list", "data": [self._model()]}

        @app.get("/v1/models/{name:path}")
        async def model(name: str, request: Request) -> dict[str, Any]:
            self._auth(request)
            self._check_model(name)
            return self._model()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            body = await self._body(request)
            return await self._complete(request, body, "chat", _messages(body))

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            body = await self._body(request)
            if body.get("echo"):
                raise ApiError(400, "echo is not supported", param="echo",
                               code="unsupported_parameter")
            if body.get("suffix"):
                raise ApiError(400, "suffix is not supported", param="suffix",
                               code="unsupported_parameter")
            prompt = _prompt(body, self.engine.lm.spec.vocab_size)
            return await self._complete(request, body, "text", prompt)

        chatpage.add_routes(app, self)
        return app

    # --- pieces ------------------------------------------------------------------------------
    def _model(self) -> dict[str, Any]:
        return {"id": self.model_id, "object": "model", "created": self.created,
                "owned_by": "ktlong"}

    def authorized(self, request: Any) -> bool:
        """No --api-key, `Authorization: Bearer KEY`, or the chat page's cookie."""
        if self.api_key is None:
            return True
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              self.api_key.encode()):
            return True
        return chatpage.cookie_ok(self.api_key, request)

    def _auth(self, request: Any) -> None:
        if not self.authorized(request):
            raise ApiError(401, "invalid API key: send the server's --api-key as "
                                "'Authorization: Bearer KEY'", code="invalid_api_key")

    def _check_model(self, name: Any) -> None:
        if name is None:
            raise ApiError(400, "model is required", param="model", code="missing_required")
        if name != self.model_id:
            raise ApiError(404, f"model {json.dumps(name)} is not served here; this server "
                           f"serves {json.dumps(self.model_id)}", param="model",
                           code="model_not_found")

    async def _body(self, request: Any) -> dict[str, Any]:
        self._auth(request)
        raw = await _read_limited(request, MAX_BODY)
        try:
            body = json.loads(raw)
        except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
            raise ApiError(400, f"the request body is not valid JSON: {e}",
                           code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        self._check_model(body.get("model"))
        return body

    def _render(self, kind: str, what: Any, params: Params) -> tuple[Fitted, Any]:
        """The request's prompt (a chat's without its oldest turns when it would not leave room
        for the answer, with overflow SHIFT) and the job's `fit` (None: no turns to drop)."""
        st = self.engine.settings
        if kind != "chat":
            if params.document is not None:
                raise ApiError(400, "ktlong.document is for /v1/chat/completions",
                               param="ktlong.document", code="invalid_value")
            return Fitted(self.renderer.completion(what)), None
        renderer = self.renderer
        if params.document is not None:
            if self.renderer.document:
                raise ApiError(400, "this server serves its --prompt-file document with every "
                               "chat: ktlong.document cannot replace it",
                               param="ktlong.document", code="invalid_value")
            renderer = self.documents.get(params.document).renderer
        if st.overflow != "SHIFT":
            return Fitted(renderer.chat(what)), None
        room = min(params.sampling.max_new_tokens, st.max_new_tokens)

        def fit(limit: int) -> Fitted:
            return renderer.fit(what, limit, lambda p: prompt_rows(st, p))

        return fit(st.max_seq_len - room), fit

    async def _complete(self, request: Any, body: dict[str, Any], kind: str, what: Any) -> Any:
        from fastapi.responses import JSONResponse, StreamingResponse

        params = _params(body, self.engine.settings)
        loop = asyncio.get_running_loop()
        try:  # tokenizing a long document takes a while: off the event loop
            fitted, fit = await loop.run_in_executor(None, self._render, kind, what, params)
        except KtlongError as e:
            raise ApiError(400, str(e), param="messages" if kind == "chat" else "prompt") \
                from None
        prompt: Prompt = fitted.prompt
        try:
            check_fits(self.engine.lm.spec, self.engine.settings,
                       prompt_rows(self.engine.settings, prompt), self.engine.settings.max_seq_len)
        except KtlongError as e:
            more = (f" (without its {fitted.dropped} oldest messages: the system messages, "
                    "the served document and the last user message must fit)"
                    if fitted.dropped else "")
            raise ApiError(400, str(e) + more, param="messages" if kind == "chat" else "prompt",
                           code="context_length_exceeded") from None
        dropped = [fitted.dropped, fitted.dropped_tokens] if kind == "chat" else None
        headers = {DROPPED_HEADER: str(fitted.dropped)} if kind == "chat" else {}
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": self.model_id,
                "system_fingerprint": f"ktlong-{__version__}"}
        if params.stream:
            return StreamingResponse(self._stream(prompt, params, head, kind, fit, dropped),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no", **headers})
        job, events = self._submit(prompt, params, loop, fit, dropped)
        text, end, passages = [], None, []
        try:
            while end is None:
                try:
                    ev = await asyncio.wait_for(events.get(), POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return JSONResponse({}, status_code=499)
                    continue
                if ev[0] == "text":
                    text.append(ev[1])
                elif ev[0] == "passages":
                    passages = ev[1]
                elif ev[0] == "error":
                    raise _from_exception(ev[1])
                elif ev[0] == "end":
                    end = ev
        finally:
            job.cancel.set()  # no-op once it ended; frees the engine when the client left
        finish, usage = end[1], end[2]
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": "".join(text),
                                              "refusal": None},
                      "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": "".join(text), "logprobs": None,
                      "finish_reason": finish}
        if "dropped_messages" in usage:  # and more may have gone mid-answer
            headers[DROPPED_HEADER] = str(usage["dropped_messages"])
        out = {**head, "choices": [choice], "usage": usage}
        if params.extra:
            out["ktlong"] = self._extra_answer(passages, end[3])
        return JSONResponse(out, headers=headers)

    def _extra_answer(self, passages: list[dict[str, Any]],
                      stats: dict[str, Any]) -> dict[str, Any]:
        """The answer's `"ktlong"` object: the passages it attended most and the engine's
        numbers (prefill seconds, tok/s, context used)."""
        health = self.engine.health()
        return {"passages": passages, "stats": {
            **stats, "context_tokens": health["context_tokens"],
            "max_seq_len": health["max_seq_len"]}}

    def _submit(self, prompt: Prompt, params: Params, loop: asyncio.AbstractEventLoop,
                fit: Any = None, dropped: list[int] | None = None) -> tuple[Job, asyncio.Queue]:
        events: asyncio.Queue = asyncio.Queue()
        job = Job(prompt, params.sampling, lambda ev: loop.call_soon_threadsafe(
            events.put_nowait, ev), params.stop, fit=fit, dropped=dropped,
            passages=params.passages)
        self.engine.submit(job)
        return job, events

    async def _stream(self, prompt: Prompt, params: Params, head: dict[str, Any], kind: str,
                      fit: Any = None, dropped: list[int] | None = None) -> AsyncIterator[str]:
        head = {**head, "object": "chat.completion.chunk" if kind == "chat"
                else "text_completion"}

        def chunk(finish: str | None = None, **delta: Any) -> str:
            if kind == "chat":
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta.get("content", ""), "logprobs": None,
                          "finish_reason": finish}
            return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

        job, events = self._submit(prompt, params, asyncio.get_running_loop(), fit, dropped)
        passages: list[dict[str, Any]] = []
        try:
            while True:
                ev = await events.get()
                if ev[0] == "progress":
                    yield f": prefill {ev[1]}/{ev[2]} tokens\n\n"
                elif ev[0] == "shift":
                    yield (f": context full: the oldest {ev[1]} messages ({ev[2]} tokens) are "
                           "left out now\n\n")
                elif ev[0] == "start":
                    if kind == "chat":
                        yield chunk(role="assistant", content="")
                elif ev[0] == "text":
                    yield chunk(content=ev[1])
                elif ev[0] == "passages":
                    passages = ev[1]
                elif ev[0] == "error":
                    yield f"data: {json.dumps(_from_exception(ev[1]).body())}\n\n"
                    return
                elif ev[0] == "end":
                    yield chunk(ev[1])
                    if params.include_usage:
                        yield f"data: {json.dumps({**head, 'choices': [], 'usage': ev[2]})}\n\n"
                    if params.extra:
                        extra = {**head, "object": "ktlong.answer", "choices": [],
                                 "ktlong": self._extra_answer(passages, ev[3])}
                        yield f"data: {json.dumps(extra)}\n\n"
                    yield "data: [DONE]\n\n"
                    return
        finally:
            job.cancel.set()  # the client left (the task is cancelled) or the answer ended


# --- running -------------------------------------------------------------------------------------
def model_id(model: Path) -> str:
    """What clients send as `model`: the file's stem or the folder's name (a Hugging Face hub
    snapshot's: its repo's, not the revision's)."""
    p = Path(model)
    if p.suffix.lower() == ".gguf":
        return p.stem
    p = p.resolve()
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        return p.parent.parent.name.split("--", 2)[-1]
    return p.name


class Running:
    """A server on a uvicorn thread (tests, `ktlong bench serve`); `port` 0 picks a free one."""

    def __init__(self, server: Server, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self.server = server
        config = uvicorn.Config(server.app, host=host, port=port, log_level="warning",
                                lifespan="off")
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, name="ktlong-http", daemon=True)
        self.thread.start()
        while not self.uvicorn.started:
            if not self.thread.is_alive():
                raise KtlongError(f"the server could not start on {host}:{port}")
            time.sleep(0.02)
        self.port = self.uvicorn.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{host}:{self.port}"

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(timeout=30)
        self.server.engine.close()

    def __enter__(self) -> "Running":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def build(lm: Any, settings: Settings, document: str = "", name: str | None = None,
          api_key: str | None = None, use_cache: bool = True,
          cache_dir: Path | None = None) -> Server:
    """A Server over `lm` (an Engine with its worker thread, kernels warmed up)."""
    from ktlong.warmup import warm_up

    warm_up(lm, settings)
    engine = Engine(lm, settings, use_cache, cache_dir)
    return Server(engine, Renderer(lm.tokenizer, document), name or model_id(lm.spec.path),
                  api_key)


def run(model: Path | None, prompt_file: str | list[str] | None, settings: Settings, *, host: str,
        port: int, api_key: str | None = None, name: str | None = None,
        encoding: str | None = None, use_cache: bool = True,
        cache_dir: Path | None = None) -> None:
    """`ktlong serve`: load, read the --prompt-file document (if any), serve until Ctrl-C."""
    require()
    import uvicorn

    from ktlong import chatui
    from ktlong.documents import read_document
    from ktlong.model import load_model
    from ktlong.spec import read_spec

    if model is None:
        raise KtlongError("no model given", hint="pass --model with a Hugging Face folder or a "
                                                 ".gguf file (or --demo)")
    read_spec(model)
    doc = read_document(prompt_file, encoding) if prompt_file else None
    ui = chatui.TerminalUI()
    with ui.loading(model):
        lm = load_model(model, settings.device, weight_type=settings.weight_type)
    server = build(lm, settings, doc.text if doc else "", name, api_key, use_cache, cache_dir)
    if doc is not None:  # the document every chat opens with: read (or mapped) now
        prompt = server.renderer.chat([{"role": "user", "content": ""}])
        head = Prompt(prompt.ids[: prompt.prefix], prompt.prefix, prompt.head)
        with ui.progress("reading the document") as progress:
            server.engine.run(head, progress)
        st = server.engine.last
        ui.note(f"{doc.name}: {head.prefix:,} tokens, {st['cached_tokens']:,} from the prompt "
                f"cache, prefilled in {st['prefill_s']:.1f} s")
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        ui.note(f"warning: listening on {host} without --api-key: anyone who reaches this "
                "address can use the model")
    ui.note(f"serving {server.model_id} at http://{host}:{port}/v1 (OpenAI API), the chat page "
            f"at http://{host}:{port}/; Ctrl-C stops")
    try:
        uvicorn.run(server.app, host=host, port=port, log_level="info", lifespan="off")
    finally:
        server.engine.close()


async def _read_limited(request: Any, limit: int) -> bytes:
    """The request's body, refused with 413 past `limit` bytes: by its Content-Length before
    anything is read, else as it streams in (a chunked upload), so memory stays bounded."""
    size = request.headers.get("content-length", "")
    too_big = ApiError(413, f"the request body is over {limit >> 20} MiB; send the document to "
                       "`ktlong serve -f FILE` or attach it on the chat page",
                       code="request_too_large")
    if size.isdigit() and int(size) > limit:
        raise too_big
    parts, got = [], 0
    async for part in request.stream():
        got += len(part)
        if got > limit:
            raise too_big
        parts.append(part)
    return b"".join(parts)
