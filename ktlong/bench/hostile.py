"""`ktlong bench hostile`: hostile documents given to `ktlong chat`, each in a child process: what
ktlong said, its exit code, peak memory and time, as a markdown table.

Each input is built here from the formats' own structure (a PDF's objects and xref, an EPUB's or a
DOCX's zip members), so every row can be made again (tests/test_hostile_documents.py builds them
too). The child's peak RSS is its own VmHWM, which it prints as it exits (os.wait4's figure
only for a child killed at its timeout).
"""
from __future__ import annotations

import io
import os
import random
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

QUESTION = "What is this document about?"


# --- PDF ----------------------------------------------------------------------------------------
def pdf(objects: list[bytes]) -> bytes:
    """A PDF of `objects` (object 1 is the catalog) with its xref table and trailer."""
    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")  # the second line: binary content
    offsets = []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
        len(objects) + 1, xref)
    return bytes(out)


def _stream(data: bytes) -> bytes:
    packed = zlib.compress(data, 9)
    return b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(packed) + packed + \
        b"\nendstream"


def pdf_pages(content: bytes, kids: bytes = b"4 0 R", count: int = 1) -> bytes:
    """A PDF whose page tree `kids` (objects 4: a page, 5: its content stream) counts `count`."""
    return pdf([b"<< /Type /Catalog /Pages 2 0 R >>",
                b"<< /Type /Pages /Kids [" + kids + b"] /Count %d >>" % count,
                b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
                b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 5 0 R "
                b"/Resources << /Font << /F1 3 0 R >> >> >>", _stream(content)])


TEXT = b"BT /F1 11 Tf 72 700 Td (A page of text.) Tj ET"


def encrypted_pdf(algorithm: str = "AES-256") -> bytes:
    """A one-page PDF that needs the user password "secret" (pypdf's writer)."""
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(pdf_pages(TEXT))))
    writer.encrypt(user_password="secret", owner_password="owner", algorithm=algorithm)
    buf = io.BytesIO()
    writer.write(buf)
    return buf.getvalue()


# --- zip: EPUB and DOCX -------------------------------------------------------------------------
_CONTAINER = ('<?xml version="1.0"?><container version="1.0" xmlns="urn:oasis:names:tc:'
              'opendocument:xmlns:container"><rootfiles><rootfile full-path="content.opf" '
              'media-type="application/oebps-package+xml"/></rootfiles></container>')


def _opf(hrefs: list[str]) -> str:
    items = "".join(f'<item id="c{i}" href="{h}" media-type="application/xhtml+xml"/>'
                    for i, h in enumerate(dict.fromkeys(hrefs)))
    ids = {h: i for i, h in enumerate(dict.fromkeys(hrefs))}
    spine = "".join(f'<itemref idref="c{ids[h]}"/>' for h in hrefs)
    return ('<?xml version="1.0"?><package xmlns="http://www.idpf.org/2007/opf" version="3.0">'
            f"<manifest>{items}</manifest><spine>{spine}</spine></package>")


def zipped(members: dict[str, bytes | str | int], links: tuple[str, ...] = ()) -> bytes:
    """A zip of `members`, deflated; an int body is that many bytes of an XML element of spaces
    (~1000:1), streamed in, never whole in memory; `links` are symbolic links (body: target)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for name, body in members.items():
            info = zipfile.ZipInfo(name)
            info.compress_type = zipfile.ZIP_STORED if name == "mimetype" else \
                zipfile.ZIP_DEFLATED
            if name in links:
                info.external_attr = 0o120777 << 16  # S_IFLNK
            if not isinstance(body, int):
                z.writestr(info, body)
                continue
            with z.open(info, "w", force_zip64=body > 0xFFFF0000) as f:
                f.write(b"<a>")
                for at in range(0, body - 7, 1 << 22):
                    f.write(b" " * min(body - 7 - at, 1 << 22))
                f.write(b"</a>")
    return buf.getvalue()


def epub(chapters: dict[str, bytes | str | int], spine: list[str] | None = None,
         links: tuple[str, ...] = ()) -> bytes:
    """An EPUB whose spine reads `spine` (default: every chapter once)."""
    return zipped({"mimetype": "application/epub+zip", "META-INF/container.xml": _CONTAINER,
                   "content.opf": _opf(spine or list(chapters)), **chapters}, links)


def chapter(text: str) -> str:
    return ('<?xml version="1.0" encoding="utf-8"?><html xmlns="http://www.w3.org/1999/xhtml">'
            f"<body><p>{text}</p></body></html>")


_W = 'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"'


def docx(document: bytes | str | int) -> bytes:
    """A DOCX whose word/document.xml is `document`."""
    return zipped({"[Content_Types].xml": '<?xml version="1.0"?><Types xmlns="http://schemas.'
                   'openxmlformats.org/package/2006/content-types"/>',
                   "word/document.xml": document})


def docx_body(body: str) -> str:
    return f'<?xml version="1.0"?><w:document {_W}><w:body>{body}</w:body></w:document>'


def lying_size(data: bytes, name: str, declared: int) -> bytes:
    """The zip `data` with its central directory declaring `declared` bytes for member `name`."""
    at = data.index(b"PK\x01\x02")
    while True:
        n = int.from_bytes(data[at + 28:at + 30], "little")
        if data[at + 46:at + 46 + n] == name.encode():
            return data[:at + 24] + declared.to_bytes(4, "little") + data[at + 28:]
        at = data.index(b"PK\x01\x02", at + 46)


def billion_laughs() -> str:
    ents = '<!ENTITY l0 "lol">' + "".join(
        f'<!ENTITY l{i} "{("&l" + str(i - 1) + ";") * 10}">' for i in range(1, 10))
    return f'<?xml version="1.0"?><!DOCTYPE w [{ents}]><w:document {_W}>&l9;</w:document>'


# --- the cases ----------------------------------------------------------------------------------
def _text_line(n: int) -> bytes:
    rng = random.Random(0)
    words = [b"river", b"stone", b"house", b"light", b"garden", b"evening", b"copper"]
    out = bytearray()
    while len(out) < n:
        out += b" ".join(rng.choices(words, k=4096)) + b" "
    return bytes(out[:n])


# (name, file name, bytes or a callable making the file at a path, extra CLI args)
Case = tuple[str, str, Callable[[Path], None], tuple[str, ...]]


def _bytes(make: Callable[[], bytes]) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(make())


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _device(path: Path) -> None:
    path.symlink_to("/dev/zero")


def _loop_folder(path: Path) -> None:
    path.mkdir()
    (path / "a.txt").symlink_to("b.txt")
    (path / "b.txt").symlink_to("a.txt")
    (path / "up").symlink_to("..")


def _loop_link(path: Path) -> None:
    path.symlink_to(path.name)


def cases() -> list[Case]:
    return [
        ("PDF cut in half", "cut.pdf", _bytes(lambda: pdf_pages(TEXT)[:300]), ()),
        ("PDF, garbage between header and %%EOF", "garbage.pdf",
         _bytes(lambda: b"%PDF-1.7\n" + bytes(range(1, 256)) * 400 + b"\n%%EOF\n"), ()),
        ("PDF whose page tree holds itself", "cycle.pdf",
         _bytes(lambda: pdf_pages(TEXT, b"2 0 R 4 0 R", 2)), ()),
        ("PDF nesting arrays 100,000 deep", "deep.pdf",
         _bytes(lambda: pdf_pages(TEXT + b" " + b"[" * 100_000)), ()),
        ("PDF encrypted, RC4 (a password)", "rc4.pdf",
         _bytes(lambda: encrypted_pdf("RC4-128")), ()),
        ("PDF encrypted, AES-256 (a password)", "aes.pdf",
         _bytes(lambda: encrypted_pdf("AES-256")), ()),
        ("PDF page inflating 40 KB to 40 MB", "bomb.pdf",
         _bytes(lambda: pdf_pages(TEXT + b"\n" + b"q Q " * 10_000_000)), ()),
        ("PDF, one 2 MB page drawn 5,000 times", "pages.pdf",
         _bytes(lambda: pdf_pages(TEXT + b"\n" + b"q Q " * 500_000, b"4 0 R " * 5000, 5000)),
         ()),
        ("EPUB chapter inflating to 1 GiB (1 MB zip)", "bomb.epub",
         _bytes(lambda: epub({"c.xhtml": 1 << 30})), ()),
        ("EPUB chapter inflating to 100 MB, declaring 100 bytes", "liar.epub",
         _bytes(lambda: lying_size(epub({"c.xhtml": 100 << 20}), "c.xhtml", 100)), ()),
        ("EPUB chapter inflating to 20 MB at 1000:1", "ratio.epub",
         _bytes(lambda: epub({"c.xhtml": 20 << 20})), ()),
        ("EPUB spine reading one 30 MB chapter 10 times", "spine.epub", _bytes(lambda: epub(
            {"c.xhtml": chapter(_words(30 << 20))}, ["c.xhtml"] * 10)), ()),
        ("DOCX document.xml inflating to 1 GiB", "bomb.docx", _bytes(lambda: docx(1 << 30)), ()),
        ("DOCX billion laughs (XML entities)", "laughs.docx",
         _bytes(lambda: docx(billion_laughs())), ()),
        ("DOCX nesting 20,000 elements deep", "deep.docx", _bytes(lambda: docx(docx_body(
            "<w:sdt>" * 20_000 + "</w:sdt>" * 20_000))), ()),
        ("EPUB member ../../etc/passwd", "up.epub", _bytes(lambda: epub(
            {"c.xhtml": chapter("x"), "../../etc/passwd": "root"})), ()),
        ("EPUB member /etc/passwd", "abs.epub", _bytes(lambda: epub(
            {"c.xhtml": chapter("x"), "/etc/passwd": "root"})), ()),
        ("EPUB chapter that is a symbolic link", "link.epub", _bytes(lambda: epub(
            {"c.xhtml": "/etc/passwd"}, links=("c.xhtml",))), ()),
        ("text, one 50 MB line", "line.txt", _bytes(lambda: _text_line(50_000_000)), ()),
        ("text, invalid UTF-8", "latin.txt",
         _bytes(lambda: "Caf\u00e9 cr\u00e8me, na\u00efve.\n".encode("latin-1") * 1000), ()),
        ("text, --encoding utf-16 on odd-length UTF-8", "odd.txt",
         _bytes(lambda: b"odd length text\n" * 1000 + b"!"), ("--encoding", "utf-16")),
        ("text, --encoding ascii on UTF-8", "utf8.txt",
         _bytes(lambda: "na\u00efve\n".encode() * 1000), ("--encoding", "ascii")),
        ("text, --encoding that does not exist", "ok.txt",
         _bytes(lambda: b"plain text\n"), ("--encoding", "klingon")),
        ("binary (random bytes) named .txt", "random.txt",
         _bytes(lambda: random.Random(1).randbytes(1 << 20)), ()),
        ("binary without NUL bytes named .txt", "nonul.txt",
         _bytes(lambda: bytes(random.Random(2).choices(range(1, 256), k=1 << 20))), ()),
        ("empty file", "empty.txt", _bytes(lambda: b""), ()),
        ("folder of looping links", "loops", _loop_folder, ()),
        ("a link to itself", "self.txt", _loop_link, ()),
        ("FIFO with no writer", "fifo.txt", _fifo, ()),
        ("/dev/zero (a link to it)", "zero.txt", _device, ()),
    ]


def _words(n: int) -> str:
    return _text_line(n).decode()


# --- running them -------------------------------------------------------------------------------
# The child runs `ktlong` (its console entry point) and says its own VmHWM as it exits: wait4's
# ru_maxrss would carry this process's high-water mark across fork + exec (a killed child's does).
_PEAK = "ktlong-bench-peak-rss"
_CHILD = ("import atexit, sys\nfrom ktlong.bench.rss import peak_rss\n"
          f"atexit.register(lambda: print('{_PEAK}', peak_rss(), file=sys.stderr))\n"
          "from ktlong.cli import main\nmain(sys.argv[1:])")


def run_case(case: Case, folder: Path, model: str, timeout: float = 600) -> dict[str, Any]:
    """Build `case` in `folder`, give it to `ktlong chat` in a child run there; what came back:
    the `error:`/`hint:` lines, exit code, seconds, the child's peak RSS in MiB."""
    from ktlong.bench.rss import peak_rss

    name, file, make, extra = case
    path = folder / file
    make(path)
    argv = [sys.executable, "-c", _CHILD, "chat", "-m", model, "-f", file, "-q", QUESTION,
            "--no-cache", "-n", "8", *extra]
    peak_rss(reset=True)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                 cwd=folder, env={**os.environ, "NO_COLOR": "1",
                                                  "COLUMNS": "200"})
        while not (done := os.wait4(child.pid, os.WNOHANG))[0]:  # wait4: the child's rusage
            if time.perf_counter() - t0 > timeout:
                child.kill()
                done = os.wait4(child.pid, 0)
                break
            time.sleep(0.02)
        seconds = time.perf_counter() - t0
        child.returncode = code = os.waitstatus_to_exitcode(done[1])
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    said = [line for line in stderr.splitlines() if line.startswith(("error:", "hint:"))]
    own = [int(line.split()[1]) for line in stderr.splitlines() if line.startswith(_PEAK)]
    return {"input": name, "said": said, "exit": code, "seconds": seconds,
            "peak_mb": (own[0] if own else done[2].ru_maxrss * 1024) / 2**20,
            "traceback": "Traceback" in stderr, "size": _size(path)}


def _size(path: Path) -> int:
    return path.lstat().st_size if path.is_symlink() or not path.is_file() else \
        path.stat().st_size


def main(model: str, as_json: bool, command: str) -> list[dict[str, Any]]:
    """Run every case against `model` ("" = a tiny random one); print the table (or JSON)."""
    from ktlong import render

    rows = []
    with tempfile.TemporaryDirectory(prefix="ktlong-hostile-") as tmp:
        if not model:  # a tiny random model: the documents are refused before it is loaded
            from ktlong.tinymodel import make_model

            model = str(make_model(Path(tmp) / "model", "llama", seed=1))
        model = str(Path(model).resolve()) if Path(model).exists() else model  # cwd moves
        work = Path(tmp) / "inputs"
        work.mkdir()
        for case in cases():
            row = run_case(case, work, model)
            rows.append(row)
            print(f"{row['input']}: exit {row['exit']}, {row['seconds']:.1f} s", file=sys.stderr)
            for p in work.iterdir():  # the next case starts from an empty folder
                if p.is_dir() and not p.is_symlink():
                    for q in p.iterdir():
                        q.unlink()
                    p.rmdir()
                else:
                    p.unlink()
    if as_json:
        render.print_json({"command": command, "rows": rows})
    else:
        print(table(rows, command))
    return rows


def table(rows: list[dict[str, Any]], command: str = "") -> str:
    lines = ([f"`{command}`", ""] if command else []) + [
        "| input | what ktlong said | exit | peak MB | s |", "|---|---|---:|---:|---:|"]
    for r in rows:
        said = "<br>".join(s.replace("|", "\\|") for s in r["said"]) or "(nothing)"
        if r["traceback"]:
            said += " **(a traceback)**"
        lines.append(f"| {r['input']} | {said} | {r['exit']} | {r['peak_mb']:,.0f} | "
                     f"{r['seconds']:.1f} |")
    return "\n".join(lines)
