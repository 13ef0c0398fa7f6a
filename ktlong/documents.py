"""Reading a document (the prompt file, or a /read file) as text, with one clear error per mistake.

Bytes are read whole, then checked in this order: missing, a directory, unreadable, empty, binary
(NUL bytes or a known binary format), then decoded strictly (UTF-8 unless `encoding` is given; a
UTF-8 byte-order mark is dropped). Windows line ends become `\n`. `-` reads stdin.
"""
from __future__ import annotations

import codecs
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ktlong.errors import KtlongError

_SNIFF = 1 << 16  # bytes looked at for NUL bytes
_MAGIC = {b"%PDF": "a PDF file", b"PK\x03\x04": "a zip archive (docx, epub, xlsx, ...)",
          b"\x1f\x8b": "a gzip file", b"\x7fELF": "a program", b"\x89PNG": "a PNG image",
          b"\xff\xd8\xff": "a JPEG image", b"GGUF": "a GGUF model file"}
_BOMS = {codecs.BOM_UTF32_LE: "utf-32", codecs.BOM_UTF32_BE: "utf-32",
         codecs.BOM_UTF16_LE: "utf-16", codecs.BOM_UTF16_BE: "utf-16"}  # utf-32 first: longer
ENCODING_HINT = "pass --encoding, e.g. --encoding latin-1, --encoding cp1252 or --encoding utf-16"


@dataclass(frozen=True)
class Document:
    name: str  # the path as given, or "<stdin>"
    text: str
    n_bytes: int


def read_document(source: str | Path, encoding: str | None = None,
                  stdin: BinaryIO | None = None, what: str = "prompt file") -> Document:
    """Read `source` (a path, or "-" for `stdin`, default `sys.stdin`) as text.

    `what` names the file in messages ("prompt file", "file"). Raises KtlongError saying which
    check failed and how to fix it.
    """
    if str(source) == "-":
        stream = stdin if stdin is not None else sys.stdin.buffer
        if stream.isatty():
            raise KtlongError(f"{what} '-' reads the document from stdin, but stdin is a terminal",
                              hint="pipe it in: cat book.txt | ktlong chat --prompt-file - ...")
        return decode(stream.read(), "<stdin>", encoding, what)
    path = Path(source).expanduser()
    if not path.exists():
        raise KtlongError(f"{what} {path} does not exist", hint=_nearby(path))
    if path.is_dir():
        raise KtlongError(f"{what} {path} is a directory, not a file",
                          hint="pass one text file; join several with cat first")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise KtlongError(f"cannot read {what} {path}: {e.strerror or e}") from None
    return decode(data, str(path), encoding, what)


def decode(data: bytes, name: str, encoding: str | None = None,
           what: str = "prompt file") -> Document:
    """Check and decode the bytes of a document named `name` (see the module docstring)."""
    label = f"{what} {name}"
    if not data:
        raise KtlongError(f"{label} is empty (0 bytes)", hint="give a file with some text in it")
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
        raise KtlongError(f"{label} holds only whitespace ({len(data):,} bytes)",
                          hint="give a file with some text in it")
    return Document(name=name, text=text, n_bytes=len(data))


def _refuse_binary(data: bytes, label: str) -> None:
    for bom, enc in _BOMS.items():
        if data.startswith(bom):
            raise KtlongError(f"{label} looks like {enc.upper()} text, not UTF-8 (it starts with "
                              f"a {enc.upper()} byte-order mark)", hint=f"add --encoding {enc}")
    for magic, kind in _MAGIC.items():
        if data.startswith(magic):
            raise KtlongError(f"{label} is {kind}, not text",
                              hint="convert it to plain text first (e.g. pdftotext, pandoc)")
    nul = data.find(b"\x00", 0, _SNIFF)
    if nul >= 0:
        raise KtlongError(f"{label} looks binary, not text (a NUL byte at offset {nul:,})",
                          hint="give a text file; if it is UTF-16 text, add --encoding utf-16")


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
