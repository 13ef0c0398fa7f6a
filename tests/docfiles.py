"""Real PDF, EPUB, HTML and DOCX files built in the test, from the formats' own structure.

`pdf` writes objects, a content stream per page (standard Helvetica, WinAnsi text) and the xref
table by hand, so its bytes are exactly what a PDF writer would produce for those pages; a page
given as None draws only an image (what a scanned page is). `epub` and `docx` write the zip
members the formats require.
"""
from __future__ import annotations

import io
import zipfile
from collections.abc import Sequence

from ktlong.bench.hostile import pdf as pdf_file

_IMAGE = b"<< /Type /XObject /Subtype /Image /Width 2 /Height 2 /ColorSpace /DeviceGray " \
         b"/BitsPerComponent 8 /Length 4 >>\nstream\n\x00\x80\x80\xff\nendstream"


def _pdf_string(line: str) -> bytes:
    raw = line.encode("cp1252")
    return b"(" + raw.replace(b"\\", b"\\\\").replace(b"(", b"\\(").replace(b")", b"\\)") + b")"


def pdf(pages: Sequence[Sequence[str] | None], image_on_text_pages: bool = False) -> bytes:
    """A PDF whose page i shows the lines pages[i] (None: an image and no text)."""
    objects: list[bytes] = [b"<< /Type /Catalog /Pages 2 0 R >>", b"",
                            b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica "
                            b"/Encoding /WinAnsiEncoding >>", _IMAGE]
    kids = []
    for lines in pages:
        ops = []
        if lines is None or image_on_text_pages:
            ops.append(b"q 200 0 0 200 72 300 cm /Im1 Do Q")
        if lines is not None:
            ops.append(b"BT /F1 11 Tf 14 TL 72 770 Td")
            ops += [_pdf_string(line) + b" Tj T*" for line in lines]
            ops.append(b"ET")
        stream = b"\n".join(ops)
        objects.append(b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream")
        content = len(objects)
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents %d 0 R "
                       b"/Resources << /Font << /F1 3 0 R >> /XObject << /Im1 4 0 R >> >> >>"
                       % content)
        kids.append(b"%d 0 R" % len(objects))
    objects[1] = b"<< /Type /Pages /Kids [" + b" ".join(kids) + b"] /Count %d >>" % len(kids)
    return pdf_file(objects)


def encrypt_pdf(data: bytes, user_password: str) -> bytes:
    """The same PDF encrypted with pypdf's writer (RC4-128: no crypto package needed)."""
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(data)))
    writer.encrypt(user_password=user_password, owner_password="owner", algorithm="RC4-128")
    buf = io.BytesIO()
    writer.write(buf)
    return buf.getvalue()


def _zip(members: dict[str, str | bytes], stored: Sequence[str] = ()) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, body in members.items():
            z.writestr(name, body, zipfile.ZIP_STORED if name in stored
                       else zipfile.ZIP_DEFLATED)
    return buf.getvalue()


def xhtml(title: str, body: str) -> str:
    return ('<?xml version="1.0" encoding="utf-8"?>\n<html xmlns="http://www.w3.org/1999/xhtml">'
            f"<head><title>{title}</title></head><body>{body}</body></html>")


def epub(chapters: Sequence[str], encrypted: Sequence[int] = ()) -> bytes:
    """An EPUB 3 whose spine lists `chapters` (XHTML documents) in order; chapters whose index
    is in `encrypted` are listed in META-INF/encryption.xml as AES-encrypted (DRM)."""
    manifest = "".join(f'<item id="c{i}" href="text/ch{i}.xhtml" '
                       'media-type="application/xhtml+xml"/>' for i in range(len(chapters)))
    spine = "".join(f'<itemref idref="c{i}"/>' for i in range(len(chapters)))
    members: dict[str, str | bytes] = {
        "mimetype": "application/epub+zip",
        "META-INF/container.xml": (
            '<?xml version="1.0"?><container version="1.0" '
            'xmlns="urn:oasis:names:tc:opendocument:xmlns:container"><rootfiles>'
            '<rootfile full-path="OEBPS/content.opf" '
            'media-type="application/oebps-package+xml"/></rootfiles></container>'),
        "OEBPS/content.opf": (
            '<?xml version="1.0"?><package xmlns="http://www.idpf.org/2007/opf" version="3.0" '
            'unique-identifier="id"><metadata xmlns:dc="http://purl.org/dc/elements/1.1/">'
            '<dc:identifier id="id">test</dc:identifier><dc:title>A Test Book</dc:title>'
            f"<dc:language>en</dc:language></metadata><manifest>{manifest}</manifest>"
            f"<spine>{spine}</spine></package>"),
    }
    for i, chapter in enumerate(chapters):
        members[f"OEBPS/text/ch{i}.xhtml"] = chapter
    if encrypted:
        refs = "".join(
            '<enc:EncryptedData><enc:EncryptionMethod '
            'Algorithm="http://www.w3.org/2001/04/xmlenc#aes128-cbc"/><enc:CipherData>'
            f'<enc:CipherReference URI="OEBPS/text/ch{i}.xhtml"/></enc:CipherData>'
            "</enc:EncryptedData>" for i in encrypted)
        members["META-INF/encryption.xml"] = (
            '<encryption xmlns="urn:oasis:names:tc:opendocument:xmlns:container" '
            f'xmlns:enc="http://www.w3.org/2001/04/xmlenc#">{refs}</encryption>')
    return _zip(members, stored=["mimetype"])


_W = 'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"'


def docx_paragraph(text: str, style: str = "", image: bool = False) -> str:
    props = f'<w:pPr><w:pStyle w:val="{style}"/></w:pPr>' if style else ""
    pic = "<w:r><w:drawing/></w:r>" if image else ""
    return f'<w:p>{props}<w:r><w:t xml:space="preserve">{text}</w:t></w:r>{pic}</w:p>'


def docx(body: str) -> bytes:
    """A DOCX whose word/document.xml body is `body` (WordprocessingML paragraphs, tables)."""
    return _zip({
        "[Content_Types].xml": (
            '<?xml version="1.0"?><Types xmlns="http://schemas.openxmlformats.org/package/2006/'
            'content-types"><Default Extension="rels" ContentType="application/vnd.openxmlformats'
            '-package.relationships+xml"/><Default Extension="xml" ContentType="application/xml"/>'
            '<Override PartName="/word/document.xml" ContentType="application/vnd.openxmlformats'
            '-officedocument.wordprocessingml.document.main+xml"/></Types>'),
        "_rels/.rels": (
            '<?xml version="1.0"?><Relationships xmlns="http://schemas.openxmlformats.org/package/'
            '2006/relationships"><Relationship Id="rId1" Type="http://schemas.openxmlformats.org/'
            'officeDocument/2006/relationships/officeDocument" Target="word/document.xml"/>'
            "</Relationships>"),
        "word/document.xml": (f'<?xml version="1.0"?><w:document {_W}><w:body>{body}'
                              "<w:sectPr/></w:body></w:document>"),
    })
