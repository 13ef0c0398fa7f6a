"""Reading the prompt file: each mistake gets its own message; good text comes back clean."""
from __future__ import annotations

import codecs
import io
from pathlib import Path

import pytest

from ktlong.documents import read_document
from ktlong.errors import KtlongError


def refused(source: object, **kw: object) -> KtlongError:
    with pytest.raises(KtlongError) as e:
        read_document(source, **kw)  # type: ignore[arg-type]
    return e.value


def write(tmp_path: Path, data: bytes, name: str = "doc.txt") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_utf8_text_with_bom_and_windows_line_ends(tmp_path: Path) -> None:
    doc = read_document(write(tmp_path, codecs.BOM_UTF8 + "Zürich\r\nline two\n".encode()))
    assert doc.text == "Zürich\nline two\n"
    assert doc.name.endswith("doc.txt") and doc.n_bytes == 3 + len("Zürich\r\nline two\n".encode())


def test_missing_file_suggests_close_names(tmp_path: Path) -> None:
    write(tmp_path, b"text", "book.txt")
    e = refused(tmp_path / "bok.txt")
    assert e.message == f"prompt file {tmp_path / 'bok.txt'} does not exist"
    assert e.hint == f"did you mean {tmp_path / 'book.txt'}?"
    e = refused(tmp_path / "nowhere" / "x.txt")
    assert "does not exist" in e.message and "does not exist either" in e.hint


def test_directory_empty_and_whitespace(tmp_path: Path) -> None:
    assert refused(tmp_path).message == f"prompt file {tmp_path} is a directory, not a file"
    assert refused(write(tmp_path, b"")).message.endswith("is empty (0 bytes)")
    assert "only whitespace" in refused(write(tmp_path, b" \n\t\n")).message


def test_binary_files_are_named(tmp_path: Path) -> None:
    e = refused(write(tmp_path, b"abc\x00\x01\x02"))
    assert "looks binary, not text (a NUL byte at offset 3)" in e.message
    assert "--encoding utf-16" in e.hint
    e = refused(write(tmp_path, b"%PDF-1.7\n..."))
    assert e.message.endswith("is a PDF file, not text") and "pdftotext" in e.hint


def test_not_utf8_says_where_and_offers_encoding(tmp_path: Path) -> None:
    p = write(tmp_path, "café au lait".encode("latin-1"))
    e = refused(p)
    assert e.message == f"prompt file {p} is not UTF-8 text (byte 0xe9 at offset 3 does not decode)"
    assert "--encoding latin-1" in e.hint
    assert read_document(p, encoding="latin-1").text == "café au lait"
    assert refused(p, encoding="klingon").message == "unknown encoding 'klingon'"


def test_utf16_is_recognised_and_readable_with_encoding(tmp_path: Path) -> None:
    p = write(tmp_path, "hello world".encode("utf-16"))
    e = refused(p)
    assert "looks like UTF-16 text" in e.message and e.hint == "add --encoding utf-16"
    assert read_document(p, encoding="utf-16").text == "hello world"


def test_stdin(tmp_path: Path) -> None:
    doc = read_document("-", stdin=io.BytesIO(b"from a pipe"))
    assert (doc.name, doc.text) == ("<stdin>", "from a pipe")
    assert refused("-", stdin=io.BytesIO(b"")).message == "prompt file <stdin> is empty (0 bytes)"

    class Tty(io.BytesIO):
        def isatty(self) -> bool:
            return True

    assert "stdin is a terminal" in refused("-", stdin=Tty()).message


def test_what_names_the_file_in_messages(tmp_path: Path) -> None:
    assert refused(tmp_path / "x", what="file").message.startswith("file ")
