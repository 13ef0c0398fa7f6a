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


def test_empty_folder_empty_file_and_whitespace(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    e = refused(tmp_path / "empty")
    assert e.message == f"prompt file folder {tmp_path / 'empty'} holds no document"
    assert refused(write(tmp_path, b"")).message.endswith("is empty (0 bytes)")
    assert "only whitespace" in refused(write(tmp_path, b" \n\t\n")).message


def test_binary_files_are_named(tmp_path: Path) -> None:
    e = refused(write(tmp_path, b"abc\x00\x01\x02"))
    assert "looks binary, not text (a NUL byte at offset 3)" in e.message
    assert "--encoding utf-16" in e.hint
    e = refused(write(tmp_path, b"\x89PNG\r\n\x1a\n..."))
    assert e.message.endswith("doc.txt is a PNG image, which ktlong does not read")
    assert ".pdf, .epub, .html, .docx" in e.hint
    e = refused(write(tmp_path, b"%PDF-1.7\n..."))  # a PDF named .txt is read as a PDF
    assert e.message.endswith("doc.txt is a damaged PDF: it is truncated (no %%EOF marker at "
                              "its end)")


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


# --- PDF, EPUB, HTML, DOCX ----------------------------------------------------------------------
from tests import docfiles  # noqa: E402

PAGE = """<!DOCTYPE html><html><head><meta charset="utf-8"><title>The Page</title>
<style>body { color: red }</style><script>var hidden = "not for the model";</script></head>
<body><nav><ul><li>Home</li><li>About <b>us</b></li></ul></nav>
<h1>Main   heading</h1><p>First  paragraph with <a href="#">a link</a>
  across lines.</p><p>Caf&eacute; &amp; more<br>after a break</p>
<script type="module">alert("no")</script><noscript>Enable JavaScript</noscript>
<table><tr><th>Name</th><th>Age</th></tr><tr><td>Ann</td><td>41</td></tr></table>
<pre>  code
    indented</pre><img src="x.png" alt="a picture"><div>last</div></body></html>"""


def test_pdf_pages_become_text_and_an_image_page_is_dropped(tmp_path: Path) -> None:
    p = write(tmp_path, docfiles.pdf([["Zürich (first) page", "second line"], None,
                                      ["Third page \\\\ here"]]), "book.pdf")
    doc = read_document(p)
    assert doc.text == "Zürich (first) page\nsecond line\n\nThird page \\\\ here\n"
    assert (doc.kind, doc.pages, doc.dropped) == ("pdf", 3, ("page 2: no text (1 image)",))
    doc = read_document(write(tmp_path, docfiles.pdf([["a"], [], ["b"]], image_on_text_pages=True),
                              "figures.pdf"))
    assert doc.text == "a\n\nb\n"
    assert doc.dropped == ("page 2: no text (1 image)", "2 images on pages with text")


def test_scanned_and_encrypted_pdfs_get_one_line(tmp_path: Path) -> None:
    e = refused(write(tmp_path, docfiles.pdf([None, None, None]), "scan.pdf"))
    assert e.message.endswith("scan.pdf has no text layer (3 pages, 3 images: a scanned PDF?)")
    assert "ocrmypdf" in e.hint
    locked = docfiles.encrypt_pdf(docfiles.pdf([["secret"]]), user_password="pw")
    e = refused(write(tmp_path, locked, "locked.pdf"))
    assert e.message.endswith("locked.pdf is an encrypted PDF (it needs a password)")
    assert "qpdf --decrypt" in e.hint
    # encrypted for its owner's rights only (no user password): read as any PDF
    open_pdf = docfiles.encrypt_pdf(docfiles.pdf([["readable"]]), user_password="")
    assert read_document(write(tmp_path, open_pdf, "rights.pdf")).text == "readable\n"


def test_epub_chapters_in_spine_order(tmp_path: Path) -> None:
    book = docfiles.epub([
        docfiles.xhtml("Cover", '<img src="cover.jpg" alt="cover"/>'),
        docfiles.xhtml("Book", "<h1>Chapter One</h1><p>It was a dark &amp; quiet night.</p>"),
        docfiles.xhtml("Book", "<p>The second <i>chapter</i>.</p><script>track()</script>")])
    doc = read_document(write(tmp_path, book, "book.epub"))
    assert doc.text == "# Chapter One\n\nIt was a dark & quiet night.\n\nThe second chapter.\n"
    assert (doc.kind, doc.pages) == ("epub", 3)
    assert doc.dropped == ("chapter 1 (ch0.xhtml): no text", "1 image", "1 script")
    assert read_document(write(tmp_path, book, "book.txt")).kind == "epub"  # sniffed
    e = refused(write(tmp_path, docfiles.epub([docfiles.xhtml("a", "<p>x</p>")], encrypted=[0]),
                      "drm.epub"))
    assert e.message.endswith("drm.epub is DRM-protected: its chapters are encrypted")


def test_html_text_only_without_scripts_and_styles(tmp_path: Path) -> None:
    doc = read_document(write(tmp_path, PAGE.encode(), "page.html"))
    assert doc.text == (
        "The Page\n\n- Home\n- About us\n\n# Main heading\n\n"
        "First paragraph with a link across lines.\n\nCafé & more\nafter a break\n\n"
        "Name | Age\nAnn | 41\n\n  code\n    indented\n\nlast\n")
    assert "hidden" not in doc.text and "color" not in doc.text and "alert" not in doc.text
    assert doc.dropped == ("1 image", "1 noscript block", "2 scripts", "1 style")
    latin = b'<meta charset="iso-8859-1"><p>caf\xe9 \x93quoted\x94</p>'  # as cp1252 bytes
    assert read_document(write(tmp_path, latin, "old.htm")).text == "café “quoted”\n"


def test_docx_paragraphs_headings_tables(tmp_path: Path) -> None:
    cell = "<w:tc>{}</w:tc>".format
    body = (docfiles.docx_paragraph("Report", "Title")
            + docfiles.docx_paragraph("Intro", "Heading2")
            + docfiles.docx_paragraph("Fish &amp; chips", image=True)
            + "<w:tbl><w:tr>" + cell(docfiles.docx_paragraph("a")) + cell(
                docfiles.docx_paragraph("b")) + "</w:tr></w:tbl>"
            + '<w:p><w:pPr><w:tabs><w:tab w:val="left" w:pos="720"/></w:tabs></w:pPr>'
            "<w:r><w:t>The</w:t><w:tab/><w:t>end.</w:t></w:r></w:p>")
    doc = read_document(write(tmp_path, docfiles.docx(body), "report.docx"))
    assert doc.text == "# Report\n\n## Intro\n\nFish & chips\n\na | b\n\nThe\tend.\n"
    assert (doc.kind, doc.dropped) == ("docx", ("1 image",))


@pytest.mark.parametrize("name,make,expect", [
    ("cut.pdf", lambda: docfiles.pdf([["x"]])[:300], "is a damaged PDF: it is truncated"),
    ("bad.pdf", lambda: docfiles.pdf([["x"]])[:-400] + b"%%EOF\n", "is a damaged PDF ("),
    ("page.pdf", lambda: b"<html>Not found</html>", "is not a PDF: it has no %PDF header "
                                                     "(it looks like an HTML page)"),
    ("cut.epub", lambda: docfiles.epub([docfiles.xhtml("a", "<p>x</p>")])[:-60],
     "is a damaged EPUB (not a readable zip archive"),
    ("bare.epub", lambda: docfiles.docx("<w:p/>"), "is a damaged EPUB (META-INF/container.xml "
                                                   "is missing)"),
    ("cut.docx", lambda: docfiles.docx(docfiles.docx_paragraph("x"))[:-80],
     "is a damaged DOCX (not a readable zip archive"),
    ("xml.docx", lambda: docfiles.docx("<w:p>"), "is a damaged DOCX (word/document.xml is not "
                                                 "well-formed XML"),
    ("locked.docx", lambda: b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + b"\0" * 100,
     "is an encrypted DOCX (a password-protected Office file)"),
    ("old.doc", lambda: b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1", "is a Word 97-2003 file, which "
                                                              "ktlong does not read"),
    ("sheet.xlsx", lambda: b"PK\x03\x04", "is a spreadsheet, which ktlong does not read"),
    ("data.zip", lambda: docfiles.docx("<w:p/>").replace(b"word/document.xml", b"word/other.xml"),
     "is a zip archive, which ktlong does not read"),
])
def test_broken_and_unsupported_files_get_one_line(tmp_path: Path, name: str, make, expect: str
                                                   ) -> None:  # type: ignore[no-untyped-def]
    e = refused(write(tmp_path, make(), name))
    assert e.message.startswith(f"prompt file {tmp_path / name} ") and expect in e.message, e
    assert "\n" not in e.message and e.hint


def test_a_pdf_through_stdin(tmp_path: Path) -> None:
    doc = read_document("-", stdin=io.BytesIO(docfiles.pdf([["piped page"]])))
    assert (doc.name, doc.kind, doc.text) == ("<stdin>", "pdf", "piped page\n")


def test_missing_pypdf_says_which_pip_command(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "pypdf", None)  # import pypdf now raises ImportError
    e = refused(write(tmp_path, docfiles.pdf([["x"]]), "a.pdf"))
    assert e.message == (f"reading prompt file {tmp_path / 'a.pdf'} (a PDF) needs pypdf, which "
                         "is not installed: pip install 'ktlong[docs]'")


# --- several files ------------------------------------------------------------------------------
def test_several_files_each_introduced_by_its_name_in_the_order_given(tmp_path: Path) -> None:
    a = write(tmp_path, b"First file.\n", "b.txt")
    b = write(tmp_path, docfiles.pdf([["A PDF page."]]), "a.pdf")
    doc = read_document([a, b])
    assert doc.text == "=== b.txt ===\nFirst file.\n\n=== a.pdf ===\nA PDF page.\n"
    assert doc.kind == "several" and [p.kind for p in doc.parts] == ["text", "pdf"]
    assert doc.name == f"{a}, {b} (2 files)" or doc.name.endswith(", ... (2 files)")
    assert "cannot be read together" in refused([a, "-"]).message


def test_a_folder_in_natural_order_skipping_other_files(tmp_path: Path) -> None:
    book = tmp_path / "book"
    (book / "part2").mkdir(parents=True)
    write(book, b"Ten.", "ch10.md")
    write(book, b"Two.", "ch2.txt")
    write(book, b"<p>Inside.</p>", "part2/ch1.html")
    write(book, b"   \n", "blank.txt")
    write(book, b"\x89PNG", "cover.png")
    write(book, b"secret", ".notes.txt")
    doc = read_document(book)
    assert doc.text == ("=== ch2.txt ===\nTwo.\n\n=== ch10.md ===\nTen.\n\n"
                        "=== part2/ch1.html ===\nInside.\n")
    assert doc.dropped == ("skipped 2 files: cover.png, blank.txt (empty)",)
    assert [p.kind for p in doc.parts] == ["text", "markdown", "html"]
    assert doc.name == f"{book} (3 files)"
    only = tmp_path / "only"
    only.mkdir()
    write(only, b"Alone.", "one.txt")
    assert read_document(only).text == "Alone."  # one file: read as it is, without a name line


# --- inspect document and chat ------------------------------------------------------------------
def test_inspect_document_json_and_show(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ktlong.cli import app

    pdf = write(tmp_path, docfiles.pdf([["Page one."], None]), "a.pdf")
    page = write(tmp_path, PAGE.encode(), "b.html")
    r = CliRunner().invoke(app, ["inspect", "document", str(pdf), str(page), "--json", "--show"])
    assert r.exit_code == 0, r.output
    import json

    info = json.loads(r.stdout)
    assert [(f["kind"], f.get("pages")) for f in info["files"]] == [("pdf", 2), ("html", None)]
    assert info["files"][0]["dropped"] == ["page 2: no text (1 image)"]
    assert info["files"][0]["characters"] == len("Page one.\n")
    assert info["text"].startswith("=== a.pdf ===\nPage one.\n\n=== b.html ===\nThe Page")
    assert info["tokens"] == -(-len(info["text"]) // 4) and not info["tokens_exact"]
    r = CliRunner().invoke(app, ["inspect", "document", str(pdf), "--show"],
                           env={"COLUMNS": "200"})
    assert r.exit_code == 0 and r.stdout == "Page one.\n"
    assert "page 2: no text (1 image)" in r.stderr and "~3 tokens" in r.stderr
    r = CliRunner().invoke(app, ["inspect", "document", str(write(tmp_path, b"\x89PNG", "x.png"))])
    assert r.exit_code == 2 and "is a PNG image, which ktlong does not read" in r.stderr


needs_demo = pytest.mark.skipif(
    not (Path(__file__).parents[1] / "ktlong/demo/model/model.safetensors").exists(),
    reason="the demo model is not trained yet")


@needs_demo
def test_inspect_document_counts_tokens_with_a_model(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ktlong.cli import app
    from ktlong.demo import MODEL_DIR
    from ktlong.inspect import token_counter

    pdf = write(tmp_path, docfiles.pdf([["The pass key is 12345."]]), "a.pdf")
    r = CliRunner().invoke(app, ["inspect", "document", str(pdf), "-m", str(MODEL_DIR), "--json"])
    assert r.exit_code == 0, r.output
    import json

    info = json.loads(r.stdout)
    assert info["tokens_exact"] and info["tokens"] == token_counter(MODEL_DIR)(
        "The pass key is 12345.\n")


@needs_demo
def test_chat_finds_a_pass_key_on_page_4_of_a_pdf(tmp_path: Path) -> None:
    """The demo model reads a 5-page PDF (~3.2K tokens; page 2 a scanned image) and answers."""
    import json
    import textwrap

    from typer.testing import CliRunner

    from ktlong.cli import app
    from ktlong.demo import MODEL_DIR, tasks

    sample = tasks.make_sample(1, 3000, task="passkey", depth=0.6)
    key = sample.asked[0].value
    lines = textwrap.wrap(sample.document, 90)
    pages: list[list[str] | None] = [lines[i:i + 40] for i in range(0, len(lines), 40)]
    pages.insert(1, None)
    assert len(pages) == 5 and key in " ".join(pages[3] or []) and key not in " ".join(
        sum((p or [] for p in pages[:3] + pages[4:]), []))
    pdf = write(tmp_path, docfiles.pdf(pages), "report.pdf")
    r = CliRunner().invoke(app, ["chat", "-m", str(MODEL_DIR), "--prompt-file", str(pdf),
                                 "-q", "What is the pass key?", "--json", "--no-cache"])
    assert r.exit_code == 0, r.output
    answer = json.loads(r.stdout.strip().splitlines()[-1])["answer"]
    assert answer.strip().rstrip(".") == f"The pass key is {key}"
