"""The chat page of `ktlong serve`: `/` serves `ktlong/web/index.html` (one file, its script and
style inline: no build step, no CDN), and the few routes it needs besides the OpenAI API.

- `GET /api/info`: the model, its context and what the page may upload.
- `POST /api/documents?name=FILE` (the file's bytes as the body): read with ktlong's own readers
  (`documents.from_bytes`: .txt .md .pdf .epub .html .docx, the same checks and limits as
  `-f`), at most MAX_UPLOAD bytes (the readers' `MAX_BYTES`); kept in memory (the last
  KEEP_DOCUMENTS) under an id, with a `Renderer` that places it as `ktlong chat -f` does, so
  its prompt-cache entry is the chat's and `prefill`'s.
- `POST /api/documents/{id}/read`: prefill it now (a Server-Sent Events stream of
  `{"done", "total", "seconds", "eta_s"}` (eta_s: ktlong.eta's time left, null at first) then
  `{"done": true, ...the engine's numbers}`), so it is read while the user types. A chat
  request names it as `"ktlong": {"document": ID}`.

With `--api-key`, the page too: `/` answers a small form (401) until `POST /login` with the key
sets an HttpOnly, SameSite=Strict cookie that holds an HMAC of the key (never the key), which the
API accepts as it accepts `Authorization: Bearer KEY`.

No `from __future__ import annotations`: FastAPI reads the handlers' annotations.
"""
import asyncio
import hashlib
import hmac
import html
import json
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import resources
from pathlib import PurePath
from typing import Any
from urllib.parse import parse_qs

from ktlong.documents import MAX_BYTES
from ktlong.errors import KtlongError
from ktlong.eta import Eta, keys_curve
from ktlong.serving import Job, Prompt, Renderer, prompt_rows

COOKIE = "ktlong_key"
MAX_UPLOAD = MAX_BYTES  # bytes of one uploaded file: the readers' own limit, as for `-f`
KEEP_DOCUMENTS = 4  # uploaded documents kept in memory (the oldest goes first)
LOGIN = """<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1"><title>ktlong</title>
<style>body{{font:16px system-ui,sans-serif;display:grid;place-items:center;height:90vh}}
form{{display:grid;gap:.6em}}p{{color:#b00020;margin:0}}</style></head><body>
<form method="post" action="/login"><b>ktlong serve</b><label>API key
<input type="password" name="key" autofocus></label>{message}<button>Open</button></form>
</body></html>"""


def page_token(api_key: str) -> str:
    """What the page's cookie holds: an HMAC of the key, so the key itself is never stored."""
    return hmac.new(api_key.encode(), b"ktlong chat page", hashlib.sha256).hexdigest()


def cookie_ok(api_key: str, request: Any) -> bool:
    got = request.cookies.get(COOKIE, "")
    return bool(got) and hmac.compare_digest(got.encode(), page_token(api_key).encode())


@dataclass
class Upload:
    id: str
    name: str
    kind: str
    pages: int | None
    chars: int
    tokens: int  # of the document's prefix (template head + document), as the chat reads it
    dropped: tuple[str, ...]
    renderer: Renderer
    read: Prompt  # the prefix alone: what `/read` prefills

    def info(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "kind": self.kind, "pages": self.pages,
                "chars": self.chars, "tokens": self.tokens, "dropped": list(self.dropped)}


class Documents:
    """The uploaded documents by id, the newest KEEP_DOCUMENTS."""

    def __init__(self) -> None:
        self._docs: OrderedDict[str, Upload] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, doc: Upload) -> None:
        with self._lock:
            self._docs[doc.id] = doc
            self._docs.move_to_end(doc.id)
            while len(self._docs) > KEEP_DOCUMENTS:
                self._docs.popitem(last=False)

    def get(self, doc_id: str) -> Upload:
        from ktlong.server import ApiError

        with self._lock:
            doc = self._docs.get(doc_id)
        if doc is None:
            raise ApiError(404, f"no uploaded document {json.dumps(doc_id)} (the server keeps "
                           f"the last {KEEP_DOCUMENTS}; attach it again)", param="ktlong.document",
                           code="document_not_found")
        return doc


def read_upload(server: Any, data: bytes, name: str) -> Upload:
    """The uploaded bytes as a document the engine can read (off the event loop: PDF text
    extraction and tokenizing take a while)."""
    from ktlong.documents import from_bytes
    from ktlong.engine import check_fits
    from ktlong.server import ApiError

    try:
        doc = from_bytes(data, name, what="uploaded file", suffix=PurePath(name).suffix.lower())
    except KtlongError as e:
        raise ApiError(400, str(e), param="file", code="invalid_document") from None
    doc_id = hashlib.sha256(doc.text.encode()).hexdigest()[:16]
    renderer = Renderer(server.engine.lm.tokenizer, doc.text)
    full = renderer.chat([{"role": "user", "content": ""}])
    read = Prompt(full.ids[: full.prefix], full.prefix, full.head)
    st = server.engine.settings
    try:
        check_fits(server.engine.lm.spec, st, prompt_rows(st, read), st.max_seq_len)
    except KtlongError as e:
        raise ApiError(400, f"{name}: {e}", param="file", code="context_length_exceeded") \
            from None
    return Upload(doc_id, name, doc.kind, doc.pages, len(doc.text), full.prefix, doc.dropped,
                  renderer, read)


def add_routes(app: Any, server: Any) -> None:
    """The page, /login and /api/* on `app` (FastAPI) for `server` (`ktlong.server.Server`)."""
    from fastapi import Request
    from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, StreamingResponse

    from ktlong.server import ApiError

    page = (resources.files("ktlong") / "web" / "index.html").read_bytes()  # read once

    @app.get("/", include_in_schema=False)
    async def index(request: Request) -> Any:
        if not server.authorized(request):
            return HTMLResponse(login_page(), status_code=401)
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.post("/login", include_in_schema=False)
    async def login(request: Request) -> Any:
        form = parse_qs((await request.body()).decode("utf-8", "replace"))
        key = form.get("key", [""])[0]
        if server.api_key is not None and not hmac.compare_digest(key.encode(),
                                                                  server.api_key.encode()):
            return HTMLResponse(login_page("That is not the server's key."), status_code=401)
        out = RedirectResponse("/", status_code=303)
        if server.api_key is not None:
            out.set_cookie(COOKIE, page_token(server.api_key), httponly=True, samesite="strict")
        return out

    @app.get("/api/info")
    async def info(request: Request) -> dict[str, Any]:
        server._auth(request)
        from ktlong.documents import FORMATS

        spec, st = server.engine.lm.spec, server.engine.settings
        return {"model": server.model_id, "arch": spec.arch, "trained_context": spec.max_positions,
                "max_seq_len": st.max_seq_len, "attention": st.attention,
                "formats": FORMATS, "max_upload": MAX_UPLOAD,
                "served_document": bool(server.renderer.document), **server.engine.health()}

    @app.post("/api/documents")
    async def upload(request: Request, name: str = "document.txt") -> JSONResponse:
        server._auth(request)
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_UPLOAD:
            raise _too_big(int(size))
        chunks, got = [], 0
        async for chunk in request.stream():
            got += len(chunk)
            if got > MAX_UPLOAD:
                raise _too_big(got)
            chunks.append(chunk)
        name = PurePath(name.replace("\\", "/")).name or "document.txt"
        loop = asyncio.get_running_loop()
        doc = await loop.run_in_executor(None, read_upload, server, b"".join(chunks), name)
        server.documents.add(doc)
        return JSONResponse(doc.info())

    @app.post("/api/documents/{doc_id}/read")
    async def read(doc_id: str, request: Request) -> StreamingResponse:
        server._auth(request)
        doc = server.documents.get(doc_id)
        return StreamingResponse(_read_events(server, doc), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _too_big(n: int) -> ApiError:
        return ApiError(413, f"the file is {n / 2**20:.0f} MiB or more; ktlong reads files of "
                        f"up to {MAX_UPLOAD >> 20} MiB", param="file", code="file_too_large")


async def _read_events(server: Any, doc: Upload) -> AsyncIterator[str]:
    """Prefill `doc` on the engine; its progress as SSE `data:` events."""
    from ktlong.server import _from_exception

    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    job = Job(doc.read, None, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
    eng = server.engine
    eta = Eta(keys_curve(eng.settings, eng.lm.spec, doc.tokens), doc.tokens)
    t0 = time.monotonic()
    server.engine.submit(job)
    try:
        while True:
            ev = await events.get()
            if ev[0] == "progress":
                eta.update(ev[1], ev[2])
                left = eta.remaining()
                yield _data({"done": ev[1], "total": ev[2],
                             "seconds": round(time.monotonic() - t0, 2),
                             "eta_s": None if left is None else round(left, 1)})
            elif ev[0] == "error":
                yield _data(_from_exception(ev[1]).body())
                return
            elif ev[0] == "end":
                health = server.engine.health()
                yield _data({"done": True, "seconds": round(time.monotonic() - t0, 2), **ev[3],
                             "context_tokens": health["context_tokens"],
                             "max_seq_len": health["max_seq_len"]})
                return
    finally:
        job.cancel.set()  # the page left (or it ended): the engine goes on with the next job


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def login_page(message: str = "") -> str:
    return LOGIN.format(message=f"<p>{html.escape(message)}</p>" if message else "")
