"""Text out of PDF, EPUB, HTML and DOCX files, with what was left out (`ktlong.documents` calls it).

Each reader takes the file's bytes (HTML: its decoded text) and returns an `Extracted`: the text
the model reads, the page or chapter count, and one line per kind of thing dropped (pages without
text, images, scripts and styles). A file it cannot read raises one KtlongError naming the file and
the reason (damaged, encrypted, no text layer). Only PDF needs a package (pypdf, in the optional
`ktlong[docs]`); EPUB and DOCX are zip archives of XML read with the standard library, HTML goes
through `html.parser`.
"""
from __future__ import annotations

import io
import posixpath
import re
import stat
import zipfile
import zlib
from collections import Counter
from dataclasses import dataclass, field
from html.parser import HTMLParser
from typing import Any
from urllib.parse import unquote
from xml.etree import ElementTree as ET

from ktlong.errors import KtlongError

DOCS_EXTRA = "pip install 'ktlong[docs]'"
AGAIN = "the file is incomplete or corrupt: download or export it again"
# Zip bombs are refused while inflating, never inflated whole: a member may hold MAX_MEMBER bytes,
# all members read from one file MAX_UNPACKED, and past RATIO_FROM bytes a member may not inflate
# more than MAX_RATIO times its compressed size (XML deflates 5-30x; a bomb ~1000x).
MAX_MEMBER = 128 << 20
MAX_UNPACKED = 256 << 20
MAX_RATIO, RATIO_FROM = 200, 1 << 20
# A PDF page's drawing instructions (its content stream) are parsed in Python at ~1 MB/s: past
# CONTENT_FROM bytes, all pages' instructions may not exceed CONTENT_RATIO times the file's size
# (one small stream inflated 1000x, or one stream drawn on thousands of pages, is a time bomb).
CONTENT_RATIO, CONTENT_FROM = 100, 8 << 20


@dataclass
class Extracted:
    text: str
    pages: int | None = None  # PDF pages, EPUB chapters (spine items)
    dropped: list[str] = field(default_factory=list)  # e.g. "page 3: no text (1 image)"


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _tidy(text: str) -> str:
    """Strip line ends, keep at most one blank line in a row, no blank lines at either end."""
    text = re.sub(r"[ \t]+\n", "\n", text.replace("\r\n", "\n").replace("\r", "\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n")


# --- HTML ---------------------------------------------------------------------------------------
_SKIP = {"script": "script", "style": "style", "noscript": "noscript block",
         "template": "template", "svg": "SVG drawing", "canvas": "canvas", "iframe": "iframe",
         "object": "embedded object", "select": "drop-down list"}
_MEDIA = {"img": "image", "video": "video", "audio": "audio clip", "embed": "embedded object"}
_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param",
         "source", "track", "wbr"}
_PARAGRAPH = {"p", "pre", "blockquote", "table", "ul", "ol", "dl", "figure", "h1", "h2", "h3",
              "h4", "h5", "h6", "section", "article", "header", "footer", "aside", "nav", "main",
              "details", "address", "hr", "title"}
_BLOCK = _PARAGRAPH | {"div", "li", "dt", "dd", "tr", "caption", "figcaption", "summary", "body",
                       "html", "form", "fieldset", "legend", "dialog", "center", "option"}


class _HtmlText(HTMLParser):
    """Visible text of an HTML page: block elements become line breaks, list items "- " lines,
    headings "# " lines, table cells " | "; scripts, styles and the like are dropped (counted)."""

    def __init__(self, title: bool = True) -> None:
        super().__init__(convert_charrefs=True)
        self.keep_title = title
        self.lines: list[str] = []
        self.cur: list[str] = []
        self.prefix = ""  # put before the current line when it is flushed ("- ", "## ")
        self.skip: list[str] = []  # open skipped elements (script, style, ...)
        self.pre = 0  # depth of <pre>
        self.head = False  # inside <head>: only <title> is read
        self.title = False
        self.lists: list[int] = []  # per open list: next number (0 = bullets)
        self.cells = 0  # cells so far in the current table row
        self.dropped: Counter[str] = Counter()

    # a line is built from pieces, then flushed at a block boundary
    def _flush(self, blank: bool = False) -> None:
        line = "".join(self.cur).rstrip()
        if not self.pre:
            line = line.lstrip()
        self.cur.clear()
        if line or self.pre:
            self.lines.append(self.prefix + line if line else "")
            self.prefix = ""
        if blank and self.lines and self.lines[-1]:
            self.lines.append("")

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self.skip:
            if tag == self.skip[-1] and tag not in _VOID:
                self.skip.append(tag)
            return
        if tag in _SKIP:
            self.dropped[_SKIP[tag]] += 1
            if tag not in _VOID:
                self.skip.append(tag)
            return
        if tag == "head":
            self.head = True
        elif tag == "title":
            self.title = True
        if tag in _MEDIA:
            self.dropped[_MEDIA[tag]] += 1
        if tag == "br":
            self._flush()
        elif tag in _BLOCK:
            self._flush(blank=tag in _PARAGRAPH and not (tag in ("ul", "ol") and self.lists))
        if tag == "pre":
            self.pre += 1
        elif tag in ("ul", "ol"):
            self.lists.append(1 if tag == "ol" else 0)
        elif tag == "li":
            n = self.lists[-1] if self.lists else 0
            if n:
                self.lists[-1] += 1
            self.prefix = "  " * max(len(self.lists) - 1, 0) + (f"{n}. " if n else "- ")
        elif len(tag) == 2 and tag[0] == "h" and tag[1] in "123456":
            self.prefix = "#" * int(tag[1]) + " "
        elif tag == "tr":
            self.cells = 0
        elif tag in ("td", "th"):
            if self.cells:
                self.cur.append(" | ")
            self.cells += 1

    def handle_endtag(self, tag: str) -> None:
        if self.skip:
            if tag == self.skip[-1]:
                self.skip.pop()
            return
        if tag == "head":
            self.head = False
        elif tag == "title":
            self.title = False
        elif tag == "pre" and self.pre:
            self._flush()
            self.pre -= 1
        elif tag in ("ul", "ol") and self.lists:
            self.lists.pop()
        if tag in _BLOCK:
            self._flush(blank=tag in _PARAGRAPH and not (tag in ("ul", "ol") and self.lists))

    def handle_data(self, data: str) -> None:
        if self.skip or (self.head and not (self.title and self.keep_title)):
            return
        if self.pre:
            first, *rest = data.split("\n")
            self.cur.append(first)
            for line in rest:
                self._flush()
                self.cur.append(line)
            return
        data = re.sub(r"\s+", " ", data)
        if not self.cur or "".join(self.cur[-1:]).endswith(" "):
            data = data.lstrip()
        if data:
            self.cur.append(data)


def html_text(text: str, title: bool = True) -> tuple[str, Counter[str]]:
    """The visible text of an HTML (or XHTML) page, and what was dropped ({"script": 2});
    `title`: whether the <title> opens the text."""
    parser = _HtmlText(title)
    parser.feed(text)
    parser.close()
    parser._flush()
    return _tidy("\n".join(parser.lines)), parser.dropped


def _counted(counts: Counter[str]) -> list[str]:
    return [_plural(n, what) for what, n in sorted(counts.items())]


def html(text: str) -> Extracted:
    body, dropped = html_text(text)
    return Extracted(body, None, _counted(dropped))


_CHARSET = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?\s*([A-Za-z0-9_.:-]+)""", re.I)
_XML_ENCODING = re.compile(rb"""^\s*<\?xml[^>]*encoding\s*=\s*["']([A-Za-z0-9_.:-]+)""")


def declared_charset(data: bytes) -> str | None:
    """The encoding a page declares (XML prolog or <meta charset>), if any."""
    m = _XML_ENCODING.match(data[:200]) or _CHARSET.search(data[:4096])
    return m.group(1).decode("ascii").lower() if m else None


# --- PDF ----------------------------------------------------------------------------------------
def _page_text(page: Any) -> tuple[str, int]:
    """A page's text and how many images it draws (XObjects and inline), none of them decoded."""
    kinds: dict[str, str] = {}
    try:
        resources = page.get("/Resources")
        xobjects = resources.get_object().get("/XObject") if resources is not None else None
        for name, ref in (xobjects.get_object().items() if xobjects is not None else ()):
            kinds[name] = ref.get_object().get("/Subtype")
    except Exception:  # a malformed resource dictionary: images uncounted, the text still read
        pass
    images = 0

    def visit(op: bytes, operands: list[Any], cm: Any, tm: Any) -> None:
        nonlocal images
        if op == b"INLINE IMAGE" or (op == b"Do" and operands and kinds.get(operands[0]) ==
                                     "/Image"):
            images += 1

    return page.extract_text(visitor_operand_before=visit) or "", images


def pdf(data: bytes, label: str) -> Extracted:
    """Text of every page (pages joined by a blank line); pages without text are dropped."""
    import logging

    try:
        from pypdf import PdfReader
        from pypdf.errors import DependencyError
    except ImportError:
        raise KtlongError(f"reading {label} (a PDF) needs pypdf, which is not installed: "
                          f"{DOCS_EXTRA}") from None
    start = data.find(b"%PDF-", 0, 1024)
    if start < 0:
        what = "an HTML page" if data.lstrip()[:1] == b"<" else "something else"
        raise KtlongError(f"{label} is not a PDF: it has no %PDF header (it looks like {what})",
                          hint=AGAIN)
    if b"%%EOF" not in data[-4096:]:
        raise KtlongError(f"{label} is a damaged PDF: it is truncated (no %%EOF marker at its "
                          "end)", hint=AGAIN)
    log = logging.getLogger("pypdf")
    level = log.level
    log.setLevel(logging.ERROR)  # pypdf warns about every detail it repairs
    try:
        try:
            reader = PdfReader(io.BytesIO(data), strict=False)
            if reader.is_encrypted:
                try:
                    opened = reader.decrypt("")  # no user password: only its owner's rights
                except DependencyError:
                    raise KtlongError(f"{label} is an encrypted PDF whose AES encryption needs "
                                      f"the cryptography package: {DOCS_EXTRA}") from None
                if not opened:
                    raise KtlongError(f"{label} is an encrypted PDF (it needs a password)",
                                      hint="remove the password first, e.g. qpdf --decrypt "
                                           "--password=PASSWORD in.pdf out.pdf")
            pages = list(reader.pages)
        except KtlongError:
            raise
        except Exception as e:  # pypdf raises many types on a broken file
            raise KtlongError(f"{label} is a damaged PDF ({_why(e)})", hint=AGAIN) from None
        texts, dropped, blank_images, other_images = [], [], 0, 0
        budget, drawn = max(CONTENT_FROM, CONTENT_RATIO * len(data)), 0
        for i, page in enumerate(pages, 1):
            try:
                contents = page.get_contents()
                drawn += len(contents.get_data()) if contents is not None else 0
                if drawn > budget:
                    raise KtlongError(
                        f"{label} is a PDF bomb: its pages' drawing instructions inflate to "
                        f"{drawn:,} bytes by page {i:,}, from a {len(data):,}-byte file (over "
                        f"{CONTENT_RATIO}:1)", hint=AGAIN)
                text, images = _page_text(page)
            except KtlongError:
                raise
            except Exception as e:
                raise KtlongError(f"{label} is a damaged PDF: page {i} cannot be read "
                                  f"({_why(e)})", hint=AGAIN) from None
            text = _tidy(text.replace("\x00", ""))
            if text.strip():
                texts.append(text)
                other_images += images
            else:
                blank_images += images
                dropped.append(f"page {i}: no text" + (f" ({_plural(images, 'image')})"
                                                       if images else " (blank)"))
    finally:
        log.setLevel(level)
    if not texts:
        if not pages:
            raise KtlongError(f"{label} is a PDF without pages", hint=AGAIN)
        scanned = f", {_plural(blank_images, 'image')}: a scanned PDF?" if blank_images else ""
        raise KtlongError(f"{label} has no text layer ({_plural(len(pages), 'page')}{scanned})",
                          hint="run OCR on it first, e.g. ocrmypdf in.pdf out.pdf, then pass "
                               "out.pdf")
    if other_images:
        dropped.append(f"{_plural(other_images, 'image')} on pages with text")
    return Extracted("\n\n".join(texts), len(pages), dropped)


def _why(e: Exception) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# --- zip-based formats (EPUB, DOCX) -------------------------------------------------------------
class _Zip:
    """A zip archive whose every failure is one KtlongError naming the file and the format.

    Members are only ever read into memory, never extracted; names that would leave a folder
    (absolute, `..`) or symbolic links are refused all the same, as no writer makes them."""

    def __init__(self, data: bytes, label: str, kind: str) -> None:
        self.label, self.kind = label, kind
        self.unpacked = 0  # bytes inflated so far, all members
        try:
            self.zf = zipfile.ZipFile(io.BytesIO(data))
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            raise self.damaged(f"not a readable zip archive: {e}") from None
        for info in self.zf.infolist():
            name = info.filename
            if name.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", name) or ".." in \
                    re.split(r"[/\\]", name):
                raise self.damaged(f"a member's path {name!r} leaves the archive")
            if stat.S_ISLNK(info.external_attr >> 16):
                raise self.damaged(f"member {name} is a symbolic link")
        self.names = set(self.zf.namelist())

    def damaged(self, why: str) -> KtlongError:
        return KtlongError(f"{self.label} is a damaged {self.kind} ({why})", hint=AGAIN)

    def bomb(self, why: str) -> KtlongError:
        article = "an" if self.kind[0] in "AEIOU" else "a"
        return KtlongError(f"{self.label} is a zip bomb, not {article} {self.kind}: {why}",
                           hint="ktlong reads what EPUB and DOCX writers make; "
                                "export the document again")

    def read(self, name: str) -> bytes:
        """The member `name` inflated, checked against the limits as it streams."""
        try:
            info = self.zf.getinfo(name)
        except KeyError:
            raise self.damaged(f"{name} is missing") from None
        if info.flag_bits & 0x1:
            raise KtlongError(f"{self.label} is an encrypted {self.kind} (its zip archive needs "
                              "a password)", hint="save or export it again without a password")
        self._check(name, info.file_size, info.compress_size, "declares")
        out = bytearray()
        try:
            with self.zf.open(info) as f:
                while chunk := f.read(1 << 20):
                    out += chunk
                    self._check(name, len(out), info.compress_size, "inflates to")
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError,
                zlib.error) as e:
            raise self.damaged(f"{name} cannot be unpacked: {e}") from None
        if len(out) != info.file_size:
            raise self.damaged(f"{name} inflates to {len(out):,} bytes, not the "
                               f"{info.file_size:,} it declares")
        self.unpacked += len(out)
        return bytes(out)

    def check_total(self, names: list[str]) -> None:
        """Refuse at once when the members about to be read (`names`, a name as often as it will
        be read) declare more than the limits allow."""
        infos = [self.zf.getinfo(n) for n in names if n in self.names]
        for info in {i.filename: i for i in infos}.values():
            self._check(info.filename, info.file_size, info.compress_size, "declares")
        declared = sum(i.file_size for i in infos)
        if declared > MAX_UNPACKED:
            raise self.bomb(f"the members it reads declare {declared:,} bytes in all, over "
                            f"{MAX_UNPACKED >> 20} MiB")

    def _check(self, name: str, size: int, packed: int, verb: str) -> None:
        if size > MAX_MEMBER:
            raise self.bomb(f"{name} {verb} more than {MAX_MEMBER >> 20} MiB")
        if self.unpacked + size > MAX_UNPACKED:
            raise self.bomb(f"the members it reads come to more than {MAX_UNPACKED >> 20} MiB "
                            "in all")
        if size > RATIO_FROM and size > MAX_RATIO * max(packed, 1):
            raise self.bomb(f"{name} {verb} {size:,} bytes from {packed:,} "
                            f"(over {MAX_RATIO}:1)")

    def xml(self, name: str) -> ET.Element:
        try:
            return ET.fromstring(self.read(name))
        except ET.ParseError as e:
            raise self.damaged(f"{name} is not well-formed XML: {e}") from None


def _local(tag: Any) -> str:
    return tag.rsplit("}", 1)[-1] if isinstance(tag, str) else ""


# --- EPUB ---------------------------------------------------------------------------------------
_FONT_OBFUSCATION = {"http://www.idpf.org/2008/embedding", "http://ns.adobe.com/pdf/enc#RC"}


def epub(data: bytes, label: str) -> Extracted:
    """Text of the chapters in reading order (the OPF spine), joined by a blank line."""
    z = _Zip(data, label, "EPUB")
    root = z.xml("META-INF/container.xml")
    opf = next((el.get("full-path") for el in root.iter() if _local(el.tag) == "rootfile"), None)
    if not opf:
        raise z.damaged("META-INF/container.xml names no package file")
    pkg = z.xml(opf)
    base = posixpath.dirname(opf)
    items = {el.get("id"): el for el in pkg.iter() if _local(el.tag) == "item"}
    spine = [el.get("idref") for el in pkg.iter() if _local(el.tag) == "itemref"]
    if not spine:
        raise z.damaged(f"{opf} lists no chapters (an empty spine)")
    encrypted = _epub_encrypted(z)
    paths = [posixpath.normpath(posixpath.join(base, unquote(items[i].get("href", "").split(
        "#")[0]))) for i in spine if i in items]
    z.check_total(paths)
    texts: list[str] = []
    dropped: list[str] = []
    counts: Counter[str] = Counter()
    chapters = 0
    for n, idref in enumerate(spine, 1):
        item = items.get(idref)
        if item is None or not item.get("href"):
            raise z.damaged(f"chapter {n} ({idref}) is not in the manifest of {opf}")
        href = unquote(item.get("href", "").split("#")[0])
        path = posixpath.normpath(posixpath.join(base, href))
        chapters += 1
        if path in encrypted:
            raise KtlongError(f"{label} is DRM-protected: its chapters are encrypted",
                              hint="ktlong reads DRM-free EPUBs only")
        media = item.get("media-type", "")
        if "html" not in media and "xml" not in media:
            dropped.append(f"chapter {n} ({posixpath.basename(path)}): not text ({media})")
            continue
        raw = z.read(path)
        try:
            page = raw.decode(declared_charset(raw) or "utf-8").lstrip("\ufeff")
        except (UnicodeDecodeError, LookupError) as e:
            raise z.damaged(f"{path} is not readable text: {e}") from None
        text, what = html_text(page, title=False)  # a chapter's title is the book's, mostly
        counts.update(what)
        if text.strip():
            texts.append(text)
        else:
            dropped.append(f"chapter {n} ({posixpath.basename(path)}): no text")
    if not texts:
        raise KtlongError(f"{label} has no text in its {_plural(chapters, 'chapter')} "
                          "(images only?)", hint="convert it to text with calibre's "
                                                 "ebook-convert, with OCR for images")
    return Extracted("\n\n".join(texts), chapters, dropped + _counted(counts))


def _epub_encrypted(z: _Zip) -> set[str]:
    """Paths META-INF/encryption.xml says are encrypted (font obfuscation aside)."""
    if "META-INF/encryption.xml" not in z.names:
        return set()
    out = set()
    for data in z.xml("META-INF/encryption.xml").iter():
        if _local(data.tag) != "EncryptedData":
            continue
        method = next((el.get("Algorithm") for el in data.iter()
                       if _local(el.tag) == "EncryptionMethod"), None)
        uri = next((el.get("URI") for el in data.iter() if _local(el.tag) == "CipherReference"),
                   None)
        if uri and method not in _FONT_OBFUSCATION:
            out.add(posixpath.normpath(unquote(uri)))
    return out


# --- DOCX ---------------------------------------------------------------------------------------
# Elements are matched by local name: transitional and strict OOXML differ in the namespace only.
_OFFICE_DOC = "/officeDocument"


def docx(data: bytes, label: str) -> Extracted:
    """Paragraphs (headings as "# " lines, list items as "- "), tables as " | " rows."""
    z = _Zip(data, label, "DOCX")
    main = "word/document.xml"
    if "_rels/.rels" in z.names:
        for rel in z.xml("_rels/.rels").iter():
            if _local(rel.tag) == "Relationship" and rel.get("Type", "").endswith(_OFFICE_DOC):
                main = rel.get("Target", main).lstrip("/")
    body = next((el for el in z.xml(main).iter() if _local(el.tag) == "body"), None)
    if body is None:
        raise z.damaged(f"{main} has no body")
    counts: Counter[str] = Counter()
    try:
        blocks = _docx_blocks(body, counts)
    except RecursionError:  # content controls nested thousands deep
        raise z.damaged(f"{main} nests its elements too deep to read") from None
    dropped = _counted(counts)
    unread = [what for what, pattern in (("headers and footers", r"word/(header|footer)\d*\.xml"),
                                         ("footnotes", r"word/(foot|end)notes\.xml"),
                                         ("comments", r"word/comments\.xml"))
              if any(re.fullmatch(pattern, n) for n in z.names)]
    if unread:
        dropped.append("not read: " + ", ".join(unread))
    return Extracted(_tidy("\n\n".join(blocks)), None, dropped)


def _docx_blocks(parent: ET.Element, counts: Counter[str]) -> list[str]:
    out: list[str] = []
    for el in parent:
        tag = _local(el.tag)
        if tag == "p":
            out.append(_docx_paragraph(el, counts))
        elif tag == "tbl":
            for row in (r for r in el if _local(r.tag) == "tr"):
                cells = [" ".join(b for b in _docx_blocks(tc, counts) if b).replace("\n", " ")
                         for tc in row if _local(tc.tag) == "tc"]
                out.append(" | ".join(cells))
            out.append("")
        elif tag != "sectPr":
            out += _docx_blocks(el, counts)  # content controls, custom XML: their paragraphs
    return out


def _child(el: ET.Element, *path: str) -> ET.Element | None:
    for name in path:
        found = next((c for c in el if _local(c.tag) == name), None)
        if found is None:
            return None
        el = found
    return el


def _docx_paragraph(p: ET.Element, counts: Counter[str]) -> str:
    pieces: list[str] = []
    # the paragraph's properties (pPr) define tab stops, not tabs: only its runs are read
    runs = (el for child in p if _local(child.tag) != "pPr" for el in child.iter())
    for el in runs:
        tag = _local(el.tag)
        if tag == "t":
            pieces.append(el.text or "")
        elif tag == "tab":
            pieces.append("\t")
        elif tag in ("br", "cr"):
            pieces.append("\n")
        elif tag == "noBreakHyphen":
            pieces.append("-")
        elif tag in ("drawing", "pict"):
            counts["image"] += 1
    text = "".join(pieces).strip()
    style = _child(p, "pPr", "pStyle")
    name = next((v for k, v in style.attrib.items() if _local(k) == "val"), "") \
        if style is not None else ""
    level = re.fullmatch(r"(?i)heading\s*([1-6])", name)
    if text and level:
        return "#" * int(level.group(1)) + " " + text
    if text and name.lower() == "title":
        return "# " + text
    if text and _child(p, "pPr", "numPr") is not None:
        return "- " + text
    return text
