"""WARC and WET files (Common Crawl's, or any crawler's) as pages: `WarcPageReader`, a datatrove disk reader,
and `extract_page`, the main-text extraction that `download` applies to the pages it fetches.

A response is kept or refused by download's own rules (status 200, an HTML or plain-text media type, no NUL
bytes, an untyped body sniffed) and decoded by download's `decode_body` (BOM, HTTP charset, <meta>,
UTF-8, charset_normalizer), so a page read from a WARC gives the same text as the same page downloaded.
WET `conversion` records are already text. Requests, `warcinfo`, `metadata` and `revisit` records are not
pages and are passed over. What happens to the text afterwards is cleanup's.

    python -m data_pipeline cleanup CC-MAIN-...-00000.warc.gz --output clean.jsonl
"""
from __future__ import annotations

import re
from typing import Callable

from datatrove.pipeline.readers.base import BaseDiskReader

from data_pipeline.download import HTML_TYPES, TEXT_TYPES, FetchError, body_type, decode_body, extract

WARC_SUFFIXES = (".warc", ".warc.gz", ".warc.zst", ".wet", ".wet.gz")  # Common Crawl's WET: .warc.wet.gz
_CHARSET_RE = re.compile(r"""charset\s*=\s*["']?([^"';\s]+)""", re.I)


class WarcPageReader(BaseDiskReader):
    """datatrove's BaseDiskReader over WARC/WET files: one Document per page, its text the decoded body.

    datatrove's own WarcReader decodes with cchardet and types bodies with libmagic; this one applies
    download's rules instead (see the module docstring) and needs only warcio.

    Args:
        data_folder: the folder (local or fsspec URL) that holds the files.
        on_skip: called with (id, reason, detail, url) for a response that is not a page (reason as
            download's failures: `http_404`, `content_type`, `binary`), in file order.
        adapter, text_key, id_key: as every datatrove reader's; a page is the dict
            {"text", "id", "url", "date", "status", "encoding", "content_type"}.
    """

    name = "WARC pages"
    _requires_dependencies = ["warcio"]

    def __init__(self, data_folder, on_skip: Callable[[str, str, str, str | None], None] | None = None,
                 compression: str | None = "infer", adapter: Callable | None = None, text_key: str = "text",
                 id_key: str = "id"):
        super().__init__(data_folder, adapter=adapter, text_key=text_key, id_key=id_key)
        self.on_skip = on_skip
        self.compression = compression

    def read_file(self, filepath: str):
        from warcio.archiveiterator import ArchiveIterator

        with self.data_folder.open(filepath, "rb", compression=self.compression) as f:
            for index, record in enumerate(ArchiveIterator(f)):
                with self.track_time():
                    page = warc_page(record)
                if page is None:
                    continue
                if isinstance(page, FetchError):
                    if self.on_skip is not None:
                        self.on_skip(record.rec_headers.get_header("WARC-Record-ID") or f"{filepath}/{index}",
                                     page.reason, page.detail, record.rec_headers.get_header("WARC-Target-URI"))
                    continue
                document = self.get_document_from_dict(page, filepath, index)
                if document:
                    yield document


def warc_page(record) -> dict | FetchError | None:
    """A page from a WARC `response` (or WET `conversion`) record; the FetchError that download would
    have raised for it; or None for a record that is not a response."""
    headers = record.rec_headers
    if record.rec_type == "conversion":  # WET: the text is already extracted
        status, header, ctype = None, None, "text/plain"
    elif record.rec_type == "response" and record.http_headers is not None:
        status = int(record.http_headers.get_statuscode() or 0)
        if status != 200:  # redirects are their own records: the target's response is in the file too
            return FetchError(f"http_{status}", record.http_headers.statusline, status)
        header = record.http_headers.get_header("Content-Type")
        ctype = header.split(";", 1)[0].strip().lower() if header else ""
        if header and ctype not in HTML_TYPES + TEXT_TYPES:
            return FetchError("content_type", ctype, status)
    else:
        return None
    body = record.content_stream().read()  # de-chunked and decompressed as the HTTP client would
    try:
        ctype = body_type(ctype, body, status)
    except FetchError as e:
        return e
    charset = _CHARSET_RE.search(header) if header else None
    text, encoding, _ = decode_body(body, charset.group(1) if charset else None, ctype in HTML_TYPES)
    return {"text": text, "id": headers.get_header("WARC-Record-ID"), "url": headers.get_header("WARC-Target-URI"),
            "date": headers.get_header("WARC-Date"), "status": status, "encoding": encoding, "content_type": ctype}


def extract_page(record: dict) -> dict:
    """`record` (a page from WarcPageReader) with its main text extracted as download extracts it (trafilatura
    for HTML, the stripped body for plain text) and its `title`; `text` is "" when nothing was extracted."""
    rec = dict(record)
    ctype = rec.pop("content_type")
    rec["text"], rec["title"] = extract((rec["text"], rec.get("url"), ctype in HTML_TYPES))
    return rec
