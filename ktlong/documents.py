"""Reading documents (the prompt file or files, a /read file) as the text the model reads.

Kinds: PDF (.pdf, through pypdf: the optional `ktlong[docs]`), EPUB (.epub), HTML (.html, .htm,
.xhtml), DOCX (.docx), Markdown (.md) and text (.txt or any other name). The extension names the
kind; for a text or unknown name the first bytes decide too (a PDF or an EPUB named .txt is read as
what it is). `ktlong.docformats` extracts the text of each format and says what it dropped.

A text file's bytes are checked in this order: empty, binary (a byte-order mark, NUL bytes, a
known binary format), then decoded strictly (UTF-8 unless `encoding` is given; a UTF-8 byte-order
mark is dropped). Windows line ends become `\\n`. `-` reads stdin.

Several sources (files, or folders: their files with a document extension, recursively, in natural
order) are joined in the order given, each file's text introduced by a line `=== NAME ===` (its
file name, or its path inside the folder). One file is read as it is, without that line.
"""
from __future__ import annotations

import codecs
import errno
import os
import re
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ktlong.errors import KtlongError

_SNIFF = 1 << 16  # bytes looked at for NUL bytes and control characters
_SAMPLE = 1 << 20  # characters tokenized to estimate a long document's tokens
MAX_BYTES = 1 << 30  # a file or stream past this is refused (the readers hold it in memory)
_CONTROL = bytes([*range(1, 8), 0x0B, *range(0x0E, 0x1B), *range(0x1C, 0x20), 0x7F])
_OLE = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"  # Office 97-2003 files, and password-protected ones
_MAGIC = {b"\x1f\x8b": "a gzip file", b"\x7fELF": "a program", b"\x89PNG": "a PNG image",
          b"\xff\xd8\xff": "a JPEG image", b"GIF8": "a GIF image", b"GGUF": "a GGUF model file",
          b"PK\x03\x04": "a zip archive", _OLE: "an Office 97-2003 file (.doc, .xls, .ppt)"}
_BOMS = {codecs.BOM_UTF32_LE: "utf-32", codecs.BOM_UTF32_BE: "utf-32",
         codecs.BOM_UTF16_LE: "utf-16", codecs.BOM_UTF16_BE: "utf-16"}  # utf-32 first: longer
ENCODING_HINT = "pass --encoding, e.g. --encoding latin-1, --encoding cp1252 or --encoding utf-16"
KINDS = {".pdf": "pdf", ".epub": "epub", ".html": "html", ".htm": "html", ".xhtml": "html",
         ".docx": "docx", ".md": "markdown", ".markdown": "markdown", ".txt": "text",
         ".text": "text", ".rst": "text"}  # a folder reads the files with these extensions
UNSUPPORTED = {".doc": "a Word 97-2003 file", ".rtf": "an RTF file",
               ".odt": "an OpenDocument text", ".pages": "an Apple Pages file",
               ".mobi": "a Kindle book", ".azw": "a Kindle book", ".azw3": "a Kindle book",
               ".djvu": "a DjVu file", ".xlsx": "a spreadsheet", ".xls": "a spreadsheet",
               ".ods": "a spreadsheet", ".pptx": "a presentation", ".ppt": "a presentation",
               ".odp": "a presentation"}
FORMATS = ".txt, .md, .pdf, .epub, .html, .docx"
CONVERT_HINT = (f"ktlong reads {FORMATS}: save or convert it to one of those (e.g. with "
                "LibreOffice, pandoc or calibre's ebook-convert)")
_LATIN1 = {"iso-8859-1", "latin-1", "latin1", "us-ascii", "ascii"}  # web pages mean cp1252


@dataclass(frozen=True)
class Document:
    name: str  # the path as given, "<stdin>", or what several files were (see read_document)
    text: str  # what the model reads
    n_bytes: int  # of the file(s) as stored
    kind: str = "text"  # text | markdown | pdf | epub | html | docx | several
    pages: int | None = None  # PDF pages, EPUB chapters
    dropped: tuple[str, ...] = ()  # what the text leaves out, e.g. "page 3: no text (1 image)"
    parts: tuple[Document, ...] = ()  # several files: each one as read, in the order joined
    title: str = ""  # the name in the `=== NAME ===` line that introduces it among several


class EmptyDocument(KtlongError):
    """A file with no bytes or only whitespace (a folder skips it; alone it is refused)."""


def read_document(source: str | Path | Sequence[str | Path], encoding: str | None = None,
                  stdin: BinaryIO | None = None, what: str = "prompt file") -> Document:
    """Read `source` as the text the model reads: a path, "-" for `stdin` (default `sys.stdin`),
    a folder, or a list of them (joined, see the module docstring).

    `encoding` applies to text and HTML files. `what` names the file in messages ("prompt file",
    "file"). Raises KtlongError saying which check failed and how to fix it.
    """
    sources = [source] if isinstance(source, (str, Path)) else list(source)
    if not sources:
        raise KtlongError(f"no {what} given")
    if len(sources) == 1 and str(sources[0]) == "-":
        stream = stdin if stdin is not None else sys.stdin.buffer
        if stream.isatty():
            raise KtlongError(f"{what} '-' reads the document from stdin, but stdin is a terminal",
                              hint="pipe it in: cat book.txt | ktlong chat --prompt-file - ...")
        return from_bytes(_read_capped(stream, f"{what} '-' (stdin)"), "<stdin>", encoding,
                          what)
    files: list[tuple[Path, str]] = []  # (path, title)
    skipped: list[str] = []
    for s in sources:
        if str(s) == "-":
            raise KtlongError(f"{what} '-' (stdin) cannot be read together with other files",
                              hint="pass the files by name, or only '-'")
        path = Path(s).expanduser()
        if not path.exists():
            if path.is_symlink():
                raise KtlongError(f"{what} {path} is a symbolic link to a missing file, or "
                                  "a loop of links", hint="give the file it should point to")
            raise KtlongError(f"{what} {path} does not exist", hint=_nearby(path))
        if path.is_dir():
            found, other = _folder(path, what)
            files += found
            skipped += other
        else:
            files.append((path, path.name))
    if len(files) == 1 and not skipped:
        return _read_file(files[0][0], encoding, what)
    parts = []
    for path, title in files:
        try:
            doc = _read_file(path, encoding, what)
        except EmptyDocument:
            skipped.append(f"{title} (empty)")
            continue
        parts.append(Document(doc.name, doc.text, doc.n_bytes, doc.kind, doc.pages, doc.dropped,
                              title=title))
    if not parts:
        raise EmptyDocument(f"{what}s {', '.join(map(str, sources))} hold no text",
                            hint="give a file with some text in it")
    return join(parts, _several_name(sources, len(parts)), skipped)


def check_length(doc: Document, tokenizer: Any, max_tokens: int) -> None:
    """Refuse a document far past `max_tokens` before the chat tokenizes all of it (~1.4 s and
    ~120 bytes of memory a character: SmolLM2 takes 71 s and 6 GB over 50 MB).

    Exact: no token spells more characters than the vocabulary's longest entry (times 4: a
    normalizer may join a letter and its accents). Estimated, for a text past 8 characters a
    token of `max_tokens`: its first MiB of characters tokenized, the rest at that rate, refused
    past 1.5 times `max_tokens`. A text that may fit is left to the chat's own exact check."""
    n, longest = len(doc.text), max((len(t) for t in tokenizer.get_vocab()), default=1)
    about = ""
    if n > 4 * longest * max_tokens:
        about = f"this model's tokens spell at most {longest} characters"
    elif n > 8 * max_tokens:
        cut = doc.text.rfind(" ", 0, _SAMPLE)
        piece = doc.text[:cut if cut > _SAMPLE // 2 else _SAMPLE]
        rate = len(tokenizer(piece, add_special_tokens=False)["input_ids"]) / len(piece)
        if n * rate > 1.5 * max_tokens:
            about = (f"about {n * rate:,.0f} tokens at the rate of its first {len(piece):,} "
                     "characters")
    if about:
        raise KtlongError(f"the document {doc.name} holds {n:,} characters, far more than "
                          f"max_seq_len {max_tokens:,} tokens hold ({about})",
                          hint="cut the document to the part you want to ask about")


def join(parts: Sequence[Document], name: str, skipped: Sequence[str] = ()) -> Document:
    """Several documents as one: each text after a line `=== TITLE ===`, a blank line between."""
    text = "\n\n".join(f"=== {p.title or p.name} ===\n{p.text.strip(chr(10))}" for p in parts)
    dropped = [f"{p.title or p.name}: {d}" for p in parts for d in p.dropped]
    if skipped:
        dropped.append(f"skipped {len(skipped)} file{'s' if len(skipped) > 1 else ''}: "
                       + ", ".join(skipped))
    return Document(name, text + "\n", sum(p.n_bytes for p in parts), "several", None,
                    tuple(dropped), tuple(parts))


def _several_name(sources: Sequence[str | Path], n: int) -> str:
    shown = ", ".join(str(s) for s in sources)
    if len(sources) > 1 and len(shown) > 60:
        shown = f"{sources[0]}, ..."
    return f"{shown} ({n} files)"


def _natural(text: str) -> tuple[list[int | str], str]:
    """Sort key: "ch2" before "ch10", case aside."""
    return [int(t) if t.isdigit() else t.lower() for t in re.split(r"(\d+)", text)], text


def _folder(path: Path, what: str) -> tuple[list[tuple[Path, str]], list[str]]:
    """The document files under `path` (hidden ones aside) in natural order, titled by their
    path inside it; and the other files, skipped."""
    found, other = [], []
    try:
        entries = sorted(path.rglob("*"), key=lambda p: _natural(p.relative_to(path).as_posix()))
    except OSError as e:
        raise KtlongError(f"cannot list {what} folder {path}: {e.strerror or e}") from None
    for p in entries:
        rel = p.relative_to(path).as_posix()
        if any(part.startswith(".") for part in p.relative_to(path).parts):
            continue
        if not p.is_file():
            if p.is_symlink() and not p.exists():
                other.append((p, f"{rel} (a broken or looping link)"))
            continue
        (found if p.suffix.lower() in KINDS else other).append((p, rel))
    if not found:
        more = f" ({len(other)} other file{'s' if len(other) != 1 else ''})" if other else ""
        raise KtlongError(f"{what} folder {path} holds no document{more}",
                          hint=f"a folder is read for its {FORMATS} files")
    return found, [rel for _, rel in other]


def _read_file(path: Path, encoding: str | None, what: str) -> Document:
    """A regular file, or a pipe (a FIFO, `<(...)`); devices and sockets are refused."""
    label = f"{what} {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO with no writer: no wait
    except OSError as e:
        if e.errno == errno.EISDIR:
            raise KtlongError(f"{label} is a directory, not a file") from None
        if e.errno == errno.ELOOP:
            raise KtlongError(f"{label} is a loop of symbolic links",
                              hint="give the file it should point to") from None
        raise KtlongError(f"cannot read {label}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise KtlongError(f"{label} is a directory, not a file")
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
            kind = ("a character device" if stat.S_ISCHR(mode) else "a block device"
                    if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else
                    "not a regular file")
            raise KtlongError(f"{label} is {kind}, not a document",
                              hint="give a file; pipe a stream in with --prompt-file -")
        os.set_blocking(fd, True)  # a writer's data now waits; none: end of file at once
        try:
            data = _read_capped(f, label, os.fstat(fd).st_size if stat.S_ISREG(mode) else 0)
        except OSError as e:
            raise KtlongError(f"cannot read {label}: {e.strerror or e}") from None
    if not data and stat.S_ISFIFO(mode):
        raise EmptyDocument(f"{label} is a pipe with nothing written to it",
                            hint="start the program that writes it first, or pipe the text "
                                 "in with --prompt-file -")
    return from_bytes(data, str(path), encoding, what, path.suffix.lower())


def _read_capped(stream: BinaryIO, label: str, size: int = 0) -> bytes:
    """All of `stream`, refused past MAX_BYTES (`size`: what the file says it holds)."""
    too_big = KtlongError(f"{label} is over {MAX_BYTES >> 30} GiB, more than ktlong reads",
                          hint="split it, or cut it to the part you want to ask about")
    if size > MAX_BYTES:
        raise too_big
    parts = [stream.read(size)] if size else []  # a regular file in one read
    n = len(parts[0]) if parts else 0
    while chunk := stream.read(1 << 20):  # a pipe (or a file still growing): in pieces
        n += len(chunk)
        if n > MAX_BYTES:
            raise too_big
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def from_bytes(data: bytes, name: str, encoding: str | None = None, what: str = "prompt file",
               suffix: str = "") -> Document:
    """The document in `data`, a file named `name` whose extension is `suffix` ("" = unknown)."""
    from ktlong import docformats

    label = f"{what} {name}"
    if not data:
        raise EmptyDocument(f"{label} is empty (0 bytes)", hint="give a file with some text in it")
    kind = _kind(data, suffix, label)
    if kind in ("text", "markdown"):
        doc = decode(data, name, encoding, what)
        return Document(name, doc.text, doc.n_bytes, kind)
    if kind == "html":
        enc = encoding or _page_charset(data)
        got = docformats.html(decode(data, name, enc, what).text)
    else:
        got = getattr(docformats, kind)(data, label)
    if not got.text.strip():
        raise EmptyDocument(f"{label} has no text" + (f" ({', '.join(got.dropped)})"
                                                      if got.dropped else ""),
                            hint="give a file with some text in it")
    return Document(name, got.text + "\n", len(data), kind, got.pages, tuple(got.dropped))


def _kind(data: bytes, suffix: str, label: str) -> str:
    """pdf | epub | html | docx | markdown | text, from the extension and the first bytes."""
    if suffix in UNSUPPORTED:
        raise KtlongError(f"{label} is {UNSUPPORTED[suffix]}, which ktlong does not read",
                          hint=CONVERT_HINT)
    kind = KINDS.get(suffix)
    if kind == "docx" and data.startswith(_OLE):
        raise KtlongError(f"{label} is an encrypted DOCX (a password-protected Office file)",
                          hint="save it again without a password (Word: File > Info > Protect "
                               "Document)")
    if kind not in (None, "text", "markdown"):
        return kind
    if data.startswith(b"%PDF"):
        return "pdf"
    if data.startswith(b"PK\x03\x04"):
        inside = _zip_kind(data)
        if inside:
            return inside
    for magic, what in _MAGIC.items():
        if data.startswith(magic):
            raise KtlongError(f"{label} is {what}, which ktlong does not read",
                              hint=CONVERT_HINT)
    return kind or "text"


def _zip_kind(data: bytes) -> str | None:
    """epub or docx when a zip archive is one, else None."""
    import io
    import zipfile

    try:
        names = set(zipfile.ZipFile(io.BytesIO(data)).namelist())
    except (zipfile.BadZipFile, OSError, ValueError):
        return None
    if "META-INF/container.xml" in names:
        return "epub"
    return "docx" if "word/document.xml" in names else None


def _page_charset(data: bytes) -> str | None:
    """The charset an HTML page declares, when Python knows it and it is not UTF-8."""
    from ktlong.docformats import declared_charset

    charset = declared_charset(data)
    if charset in _LATIN1:
        return "cp1252"
    try:
        name = codecs.lookup(charset).name if charset else None
    except LookupError:
        return None
    return None if name in (None, "utf-8") else name


def decode(data: bytes, name: str, encoding: str | None = None,
           what: str = "prompt file") -> Document:
    """Check and decode the bytes of a text document named `name` (see the module docstring)."""
    label = f"{what} {name}"
    if not data:
        raise EmptyDocument(f"{label} is empty (0 bytes)", hint="give a file with some text in it")
    if encoding is not None:
        try:
            encoding = codecs.lookup(encoding).name
        except LookupError:
            raise KtlongError(f"unknown encoding {encoding!r}", hint=ENCODING_HINT) from None
    else:
        _refuse_binary(data, label)
        encoding = "utf-8-sig"
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as e:
        shown = "UTF-8" if encoding == "utf-8-sig" else encoding
        raise KtlongError(f"{label} is not {shown} text (byte 0x{data[e.start]:02x} at offset "
                          f"{e.start:,} does not decode)", hint=ENCODING_HINT) from None
    text = text.lstrip("\ufeff").replace("\r\n", "\n")
    if not text.strip():
        raise EmptyDocument(f"{label} holds only whitespace ({len(data):,} bytes)",
                            hint="give a file with some text in it")
    return Document(name=name, text=text, n_bytes=len(data))


def _refuse_binary(data: bytes, label: str) -> None:
    for bom, enc in _BOMS.items():
        if data.startswith(bom):
            raise KtlongError(f"{label} looks like {enc.upper()} text, not UTF-8 (it starts with "
                              f"a {enc.upper()} byte-order mark)", hint=f"add --encoding {enc}")
    nul = data.find(b"\x00", 0, _SNIFF)
    if nul >= 0:
        raise KtlongError(f"{label} looks binary, not text (a NUL byte at offset {nul:,})",
                          hint="give a text file; if it is UTF-16 text, add --encoding utf-16")
    head = data[:_SNIFF]
    control = len(head) - len(head.translate(None, _CONTROL))
    if control * 20 > len(head):  # text has tabs and line ends, hardly ever other controls
        raise KtlongError(f"{label} looks binary, not text ({control:,} control characters "
                          f"in its first {len(head):,} bytes)", hint="give a text file")


def _nearby(path: Path) -> str | None:
    """A hint for a missing path: the closest names in its folder, if any."""
    import difflib

    folder = path.parent if str(path.parent) else Path(".")
    try:
        names = [p.name for p in folder.iterdir()] if folder.is_dir() else []
    except OSError:
        names = []
    close = difflib.get_close_matches(path.name, names, n=3)
    if close:
        return "did you mean " + " or ".join(str(folder / c) for c in close) + "?"
    return None if folder.is_dir() else f"the folder {folder} does not exist either"
