"""Hostile documents: each gets one `error:` line (and a hint), exit 2, no traceback, in bounded
memory and time. The inputs are those of `ktlong bench hostile` (ktlong.bench.hostile), built in
tmp_path; the reader is called in-process, and a few go through `ktlong chat` in a child."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from ktlong import docformats
from ktlong.bench import hostile
from ktlong.documents import Document, check_length, read_document
from ktlong.errors import KtlongError

CASES = {file: case for case in hostile.cases() for file in [case[1]]}
EXPECT = {  # file name -> what the one line says
    "cut.pdf": "is a damaged PDF: it is truncated",
    "garbage.pdf": "is a damaged PDF (PdfReadError",
    "cycle.pdf": "is a damaged PDF (PdfReadError: Detected cyclic page references",
    "deep.pdf": "is a damaged PDF: page 1 cannot be read (RecursionError",
    "rc4.pdf": "is an encrypted PDF (it needs a password)",
    "aes.pdf": "is an encrypted PDF (it needs a password)",
    "bomb.pdf": "is a PDF bomb: its pages' drawing instructions inflate to 40,000,047 bytes by "
                "page 1",
    "bomb.epub": "is a zip bomb, not an EPUB: c.xhtml declares more than 128 MiB",
    "liar.epub": "is a damaged EPUB (c.xhtml cannot be unpacked: Bad CRC-32",
    "ratio.epub": "is a zip bomb, not an EPUB: c.xhtml declares 20,971,520 bytes from",
    "spine.epub": "is a zip bomb, not an EPUB: the members it reads declare 314,",
    "bomb.docx": "is a zip bomb, not a DOCX: word/document.xml declares more than 128 MiB",
    "laughs.docx": "is a damaged DOCX (word/document.xml is not well-formed XML: limit on input "
                   "amplification factor",
    "deep.docx": "is a damaged DOCX (word/document.xml nests its elements too deep to read)",
    "up.epub": "is a damaged EPUB (a member's path '../../etc/passwd' leaves the archive)",
    "abs.epub": "is a damaged EPUB (a member's path '/etc/passwd' leaves the archive)",
    "link.epub": "is a damaged EPUB (member c.xhtml is a symbolic link)",
    "latin.txt": "is not UTF-8 text (byte 0xe9 at offset 3 does not decode)",
    "odd.txt": "is not utf-16 text (byte 0x21 at offset 16,000 does not decode)",
    "utf8.txt": "is not ascii text (byte 0xc3 at offset 2 does not decode)",
    "ok.txt": "unknown encoding 'klingon'",
    "random.txt": "looks binary, not text (a NUL byte at offset",
    "nonul.txt": "looks binary, not text (6,637 control characters in its first 65,536 bytes)",
    "empty.txt": "is empty (0 bytes)",
    "loops": "holds no document (2 other files)",
    "self.txt": "is a symbolic link to a missing file, or a loop of links",
    "fifo.txt": "is a pipe with nothing written to it",
    "zero.txt": "is a character device, not a document",
}
SLOW = {"pages.pdf", "line.txt"}  # their own tests below


def test_every_bench_case_is_checked_here() -> None:
    assert set(CASES) == set(EXPECT) | SLOW


@pytest.mark.parametrize("file", sorted(EXPECT))
def test_the_reader_refuses_with_one_line(tmp_path: Path, file: str) -> None:
    _, _, make, extra = CASES[file]
    make(tmp_path / file)
    encoding = extra[1] if extra[:1] == ("--encoding",) else None
    with pytest.raises(KtlongError) as e:
        read_document(tmp_path / file, encoding)
    assert EXPECT[file] in e.value.message, e.value.message
    assert "\n" not in e.value.message and e.value.hint and "\n" not in e.value.hint


def test_a_folder_skips_a_looping_link_and_reads_the_rest(tmp_path: Path) -> None:
    folder = tmp_path / "book"
    CASES["loops"][2](folder)  # a.txt -> b.txt -> a.txt, up -> ..
    (folder / "real.txt").write_text("Real text.")
    doc = read_document(folder)
    assert doc.text == "=== real.txt ===\nReal text.\n"
    assert doc.dropped == ("skipped 2 files: a.txt (a broken or looping link), b.txt (a broken "
                           "or looping link)",)


def test_a_pipe_with_a_writer_is_read(tmp_path: Path) -> None:
    """`-f <(cmd)` hands ktlong /dev/fd/N, a pipe whose writer is already there."""
    r, w = os.pipe()
    writer = threading.Thread(target=lambda: (os.write(w, b"Piped text.\n"), os.close(w)))
    writer.start()
    try:
        doc = read_document(f"/dev/fd/{r}")
    finally:
        writer.join()
        os.close(r)
    assert doc.text == "Piped text.\n"


def test_streams_and_files_past_the_cap_are_refused(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from ktlong import documents

    monkeypatch.setattr(documents, "MAX_BYTES", 1000)
    with pytest.raises(KtlongError, match="is over 0 GiB, more than ktlong reads"):
        read_document("-", stdin=io.BytesIO(b"x" * 1001))
    (tmp_path / "big.txt").write_bytes(b"x" * 1001)
    with pytest.raises(KtlongError, match="big.txt is over"):
        read_document(tmp_path / "big.txt")
    (tmp_path / "fits.txt").write_bytes(b"x" * 1000)
    assert len(read_document(tmp_path / "fits.txt").text) == 1000


def test_the_total_a_zip_inflates_is_counted_across_reads(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Members that each pass, read one after another (a spine listing one chapter many times
    and declaring less than it holds), stop at MAX_UNPACKED as they stream."""
    monkeypatch.setattr(docformats, "MAX_UNPACKED", 300_000)
    data = hostile.epub({"c.xhtml": hostile.chapter("word " * 20_000)})  # 100 KB a read
    z = docformats._Zip(data, "book.epub", "EPUB")
    z.read("c.xhtml")
    z.read("c.xhtml")
    with pytest.raises(KtlongError, match="the members it reads come to more than 0 MiB"):
        z.read("c.xhtml")
    assert z.unpacked == 2 * len(hostile.chapter("word " * 20_000))


def test_a_pdf_drawing_one_stream_on_many_pages_stops_at_its_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's row (5,000 pages of one 2 MB stream) in small: 500 pages of one 80 KB stream
    under a 200 KB budget are refused on the page that passes it, not after parsing them all."""
    monkeypatch.setattr(docformats, "CONTENT_FROM", 200_000)
    content = hostile.TEXT + b"\n" + b"q Q " * 20_000
    data = hostile.pdf_pages(content, b"4 0 R " * 500, 500)
    budget = max(200_000, docformats.CONTENT_RATIO * len(data))
    page = budget // len(content) + 1
    with pytest.raises(KtlongError) as e:
        docformats.pdf(data, "pages.pdf")
    assert f"inflate to {page * len(content):,} bytes by page {page}, from a {len(data):,}-byte " \
           "file (over 100:1)" in e.value.message
    assert page < 10


class _Tokenizer:
    """A vocabulary whose longest entry is 4 characters; 2 characters a token."""

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "abcd": 1}

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [0] * (len(text) // 2)}


def test_a_document_far_past_max_seq_len_is_refused_before_tokenizing() -> None:
    doc = Document("book.txt", "ab " * 1000, 3000)
    check_length(doc, _Tokenizer(), 3000)  # 1,500 tokens: fits
    check_length(doc, _Tokenizer(), 1000)  # 1,500 tokens of 1,000: the chat's own check says so
    with pytest.raises(KtlongError) as e:
        check_length(doc, _Tokenizer(), 300)  # past 8 characters a token: estimated
    assert e.value.message == ("the document book.txt holds 3,000 characters, far more than "
                               "max_seq_len 300 tokens hold (about 1,500 tokens at the rate of "
                               "its first 3,000 characters)")
    with pytest.raises(KtlongError, match=r"at most 4 characters\)"):
        check_length(doc, _Tokenizer(), 100)  # past 4 x 4 characters a token: certain


# --- through the CLI, in a child: one line, exit 2, no traceback, bounded memory and time ------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.models import hf_model

    return str(hf_model("llama"))


@pytest.mark.parametrize("file,peak_mb,seconds", [
    ("fifo.txt", 600, 30), ("zero.txt", 600, 30), ("ratio.epub", 600, 30),
    ("bomb.pdf", 700, 30), ("spine.epub", 600, 30), ("loops", 600, 30),
    ("line.txt", 1200, 60),  # 50 MB: read, then refused on an estimate of its tokens
])
def test_the_cli_says_one_line_in_bounded_memory_and_time(tmp_path: Path, tiny: str, file: str,
                                                          peak_mb: int, seconds: int) -> None:
    row = hostile.run_case(CASES[file], tmp_path, tiny, timeout=seconds)
    errors = [s for s in row["said"] if s.startswith("error:")]
    assert row["exit"] == 2 and len(errors) == 1 and not row["traceback"], row
    assert EXPECT.get(file, "far more than max_seq_len") in errors[0]
    assert row["peak_mb"] < peak_mb and row["seconds"] < seconds, row
