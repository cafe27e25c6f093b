"""Stage `download`: fetch URLs with asyncio + aiohttp and extract the main text with trafilatura.

Owns the network side: a per-request timeout that cancels the whole fetch (connect, redirects,
body), a size cap, HTML/text content types only, per-host concurrency, retries with backoff on
5xx/timeouts, bounded manual redirects (loops detected), charset detection, and refusal of
loopback/private/link-local addresses (checked on every hop and at DNS resolution) unless
--allow-private. Records are appended in input order through a bounded reorder window, one
write per line, so a killed run leaves a clean prefix; re-running skips URLs already in OUT or
OUT.failed.jsonl and never duplicates or truncates a complete record. A failure that a flag decided
(private_address, too_large, timeout, too_many_redirects) records that flag's value and is fetched
again once the flag changes; --retry-failed fetches every failure again, --force starts over.
Without a terminal (logs, CI), a progress line is printed every --log-interval seconds.

    python -m data_pipeline download urls.clean.txt --output raw.jsonl --workers 32
"""
from __future__ import annotations

import argparse
import asyncio
import codecs
import concurrent.futures
import contextlib
import ipaddress
import json
import multiprocessing
import os
import re
import socket
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from data_pipeline.cli_args import add_common_args, add_output_arg, check_input
from data_pipeline.files import atomic_write
from data_pipeline.jsonl import BadLineReporter, dumps, iter_text_lines
from data_pipeline.stats import is_complete as _is_complete, write_stats
from data_pipeline.workers import progress

USER_AGENT = "zerogpt-webtext/0.1 (research crawler)"
HTML_TYPES = ("text/html", "application/xhtml+xml")
TEXT_TYPES = ("text/plain",)
REDIRECT_CODES = (301, 302, 303, 307, 308)
RETRY_CODES = (429, 500, 502, 503, 504)
_META_CHARSET_RE = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?\s*([a-zA-Z0-9_\-:.]+)""", re.I)
# The flags that decide a failure: the failed record keeps their values, and a re-run with other
# values fetches the URL again instead of skipping it as done (a run without --allow-private must
# not poison the workdir for the run with it).
SETTINGS_OF_REASON = {"private_address": ("allow_private",), "too_large": ("max_bytes",),
                      "timeout": ("timeout", "retries"), "too_many_redirects": ("max_redirects",)}


class FetchError(OSError):
    """A failed URL: `reason` is the stats key, `retry` whether another attempt may succeed."""

    def __init__(self, reason: str, detail: str = "", status: int | None = None, retry: bool = False):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail, self.status, self.retry = reason, detail, status, retry


def is_public_ip(host: str) -> bool:
    """False for loopback, private, link-local, multicast, reserved and unspecified addresses."""
    ip = ipaddress.ip_address(host.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def check_url(url: str, allow_private: bool) -> None:
    """Reject a URL (first or a redirect target) by scheme, missing host or a private IP literal."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port
    except ValueError as e:
        raise FetchError("invalid_url", str(e)) from None
    if parts.scheme not in ("http", "https") or not host:
        raise FetchError("invalid_url", f"need an http(s) URL with a host, got {url[:200]!r}")
    try:
        host.encode("idna")
    except UnicodeError:
        raise FetchError("invalid_url", f"host {host[:100]!r} is not a valid hostname") from None
    if allow_private:
        return
    try:
        public = is_public_ip(host)
    except ValueError:
        if host == "localhost" or host.endswith(".localhost"):
            raise FetchError("private_address", host) from None
        return  # a name: the resolver checks the addresses it resolves to
    if not public:
        raise FetchError("private_address", host)


def _cause(exc: BaseException) -> FetchError | None:
    """A FetchError hidden inside an aiohttp exception (the resolver's refusal gets wrapped)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, FetchError):
            return exc
        exc = getattr(exc, "os_error", None) or exc.__cause__ or exc.__context__
    return None


def make_resolver(allow_private: bool):
    """An aiohttp resolver that drops non-public addresses, so DNS cannot point us inward."""
    import aiohttp
    from aiohttp.abc import AbstractResolver

    class PublicResolver(AbstractResolver):
        def __init__(self) -> None:
            self._inner = aiohttp.ThreadedResolver()

        async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET):
            addrs = await self._inner.resolve(host, port, family)
            if allow_private:
                return addrs
            public = [a for a in addrs if is_public_ip(a["host"])]
            if not public:
                raise FetchError("private_address", f"{host} resolves only to non-public addresses")
            return public

        async def close(self) -> None:
            await self._inner.close()

    return PublicResolver()


def decode_body(body: bytes, header_charset: str | None, is_html: bool) -> tuple[str, str, bool]:
    """Bytes -> (text, encoding, replaced). Order: BOM, HTTP charset, <meta> charset, UTF-8,
    charset_normalizer's guess, then UTF-8 with U+FFFD replacement (`replaced=True`, counted)."""
    for bom, enc in ((codecs.BOM_UTF8, "utf-8-sig"), (codecs.BOM_UTF16_LE, "utf-16"),
                     (codecs.BOM_UTF16_BE, "utf-16")):
        if body.startswith(bom):
            return body.decode(enc, errors="replace"), enc, False
    candidates = [header_charset]
    if is_html:
        m = _META_CHARSET_RE.search(body[:4096])
        candidates.append(m.group(1).decode("ascii") if m else None)
    candidates.append("utf-8")
    for enc in candidates:
        if not enc:
            continue
        try:
            return body.decode(codecs.lookup(enc).name), enc.lower(), False
        except (LookupError, UnicodeDecodeError):
            continue
    try:
        from charset_normalizer import from_bytes

        best = from_bytes(body[:200_000]).best()
        if best is not None:
            return body.decode(best.encoding, errors="replace"), best.encoding, False
    except (ImportError, LookupError):
        pass
    return body.decode("utf-8", errors="replace"), "utf-8", True


def body_type(ctype: str, body: bytes, status: int | None = None) -> str:
    """The media type of a fetched body: `ctype` (its Content-Type's, "" when there was none), or for an
    untyped body text/html or text/plain sniffed from its start. FetchError "binary" for NUL bytes near
    the start. Also how a WARC response is typed (warc.py), so a page gives the same text either way."""
    if b"\x00" in body[:4096]:
        raise FetchError("binary", f"NUL bytes in a {ctype or 'untyped'} body", status)
    if ctype:
        return ctype
    head = body[:2048].lower()
    return "text/html" if (b"<html" in head or b"<!doctype html" in head or b"<body" in head) else "text/plain"


def extract(payload: tuple[str, str, bool]) -> tuple[str, str]:
    """(text, title) of a page; runs in a worker process (trafilatura is CPU-bound)."""
    body, url, is_html = payload
    if not is_html:
        return body.strip(), ""
    import logging

    import trafilatura

    logging.getLogger("trafilatura").setLevel(logging.CRITICAL)
    doc = trafilatura.bare_extraction(body, url=url, with_metadata=True, include_comments=False,
                                      include_tables=False)
    if doc is None:
        return "", ""
    return (doc.text or "").strip(), (doc.title or "").strip()


@dataclass
class Page:
    url: str
    final_url: str
    status: int
    body: bytes
    content_type: str
    charset: str | None


class Fetcher:
    """One aiohttp session plus the limits; `fetch(url)` returns a Page or raises FetchError."""

    def __init__(self, args: argparse.Namespace) -> None:
        import aiohttp

        self.args = args
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=args.workers, limit_per_host=args.per_host,
                                           resolver=make_resolver(args.allow_private)),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=args.timeout, sock_read=args.timeout),
            headers={"User-Agent": USER_AGENT, "Accept": "text/html,application/xhtml+xml,text/plain;q=0.9"},
            cookie_jar=aiohttp.DummyCookieJar(), trust_env=False)
        self.slots = asyncio.Semaphore(args.workers)
        self.host_slots: dict[str, asyncio.Semaphore] = {}

    async def fetch(self, url: str) -> tuple[Page, int]:
        """Retries on 5xx/429/timeouts/connection errors with exponential backoff."""
        attempt = 0
        while True:
            attempt += 1
            try:
                host = urlsplit(url).hostname or ""
                slot = self.host_slots.setdefault(host, asyncio.Semaphore(self.args.per_host))
                async with slot, self.slots:
                    # asyncio.timeout cancels the whole attempt (connect, every hop, body) even
                    # when the server trickles bytes slowly enough to defeat socket timeouts.
                    async with asyncio.timeout(self.args.timeout):
                        return await self._fetch_once(url), attempt
            except TimeoutError:
                err = FetchError("timeout", f"no complete response within {self.args.timeout}s", retry=True)
            except FetchError as e:
                err = e
            except Exception as e:  # aiohttp.ClientError, OSError, ssl errors, bad headers, ...
                err = _cause(e) or FetchError("connection_error", f"{type(e).__name__}: {e}"[:300], retry=True)
            if not err.retry or attempt > self.args.retries:
                err.detail = f"{err.detail} (attempt {attempt})"
                raise err
            await asyncio.sleep(self.args.backoff * 2 ** (attempt - 1))

    async def _fetch_once(self, url: str) -> Page:
        current, visited = url, {url}
        for _ in range(self.args.max_redirects + 1):
            check_url(current, self.args.allow_private)
            async with self.session.get(current, allow_redirects=False) as resp:
                if resp.status in REDIRECT_CODES:
                    location = resp.headers.get("Location")
                    if not location:
                        raise FetchError("bad_redirect", "redirect without Location", resp.status)
                    current = urljoin(current, location)
                    if current in visited:
                        raise FetchError("redirect_loop", current[:200], resp.status)
                    visited.add(current)
                    continue
                if resp.status != 200:
                    raise FetchError(f"http_{resp.status}", resp.reason or "", resp.status,
                                     retry=resp.status in RETRY_CODES)
                return await self._read(url, current, resp)
        raise FetchError("too_many_redirects", f"more than {self.args.max_redirects}")

    async def _read(self, url: str, final_url: str, resp) -> Page:
        header = resp.headers.get("Content-Type")
        ctype = resp.content_type.lower() if header else ""
        if header and ctype not in HTML_TYPES + TEXT_TYPES:
            raise FetchError("content_type", ctype, resp.status)
        if resp.content_length is not None and resp.content_length > self.args.max_bytes:
            raise FetchError("too_large", f"Content-Length {resp.content_length} > {self.args.max_bytes}",
                             resp.status)
        chunks, size = [], 0
        async for chunk in resp.content.iter_chunked(1 << 16):
            size += len(chunk)
            if size > self.args.max_bytes:
                raise FetchError("too_large", f"body over --max-bytes {self.args.max_bytes}", resp.status)
            chunks.append(chunk)
        body = b"".join(chunks)
        return Page(url, final_url, resp.status, body, body_type(ctype, body, resp.status),
                    resp.charset if header else None)

    async def close(self) -> None:
        await self.session.close()


# ---------------------------------------------------------------------------------------------
# Resume bookkeeping: OUT and OUT.failed.jsonl are append-only; a kill can only leave a partial
# LAST line, which is moved to OUT.partial (its URL is fetched again) before anything else.

def repair_tail(path: str) -> int:
    """Move an incomplete last line (no trailing newline) of `path` to `path.partial`; bytes moved."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return 0
        f.seek(0)
        data = f.read()
        keep = data.rfind(b"\n") + 1
        with open(path + ".partial", "ab") as p:
            p.write(data[keep:] + b"\n")
        f.truncate(keep)
    print(f"{path}: moved an incomplete last record ({len(data) - keep} bytes) to {path}.partial; "
          f"its URL will be fetched again", file=sys.stderr)
    return len(data) - keep


def done_urls(path: str) -> set[str]:
    """URLs already recorded in an output or failed file."""
    urls: set[str] = set()
    if os.path.exists(path):
        with open(path, "rb") as f:
            for line in f:
                try:
                    urls.add(json.loads(line)["url"])
                except (ValueError, KeyError, TypeError):
                    continue
    return urls


def _summary(counts: Counter) -> str:
    return ", ".join(f"{k}={v}" for k, v in counts.most_common())


def failure_reasons(path: str) -> Counter:
    """reason -> count over a failed file."""
    reasons: Counter = Counter()
    if os.path.exists(path):
        with open(path, "rb") as f:
            for line in f:
                with contextlib.suppress(ValueError, AttributeError):
                    reasons[json.loads(line).get("reason")] += 1
    return reasons


def _settings_changed(rec: dict, args: argparse.Namespace) -> bool:
    """Whether a flag that decided this failure has another value now."""
    reason = rec.get("reason")
    # records from before settings were kept: private_address can only mean allow_private=False
    settings = rec.get("settings") or ({"allow_private": False} if reason == "private_address" else {})
    return any(name in settings and settings[name] != getattr(args, name)
               for name in SETTINGS_OF_REASON.get(reason, ()))


def requeue_failures(path: str, args: argparse.Namespace) -> Counter:
    """Remove from the failed file `path` the failures to fetch again: every one with --retry-failed,
    else those whose deciding flag changed. Returns their reasons and counts."""
    if not os.path.exists(path):
        return Counter()
    keep, retried = [], Counter()
    with open(path, "rb") as f:
        for line in f:
            try:
                rec = json.loads(line)
                reason, again = rec.get("reason"), args.retry_failed or _settings_changed(rec, args)
            except (ValueError, AttributeError):  # not a record: done_urls ignores it too
                reason, again = None, False
            if again:
                retried[reason] += 1
            else:
                keep.append(line)
    if retried:
        with atomic_write(path, "wb") as f:
            f.writelines(keep)
    return retried


def append_line(fd: int, record: dict) -> None:
    """One os.write per record: a kill leaves whole lines plus at most one partial tail."""
    data = dumps(record).encode("utf-8")
    while data:
        data = data[os.write(fd, data):]


async def _process(fetcher: Fetcher, pool, url: str) -> tuple[dict | None, dict | None, bool]:
    """(ok_record, failed_record, replaced_chars) for one URL; never raises."""
    try:
        check_url(url, fetcher.args.allow_private)
        page, attempts = await fetcher.fetch(url)
        is_html = page.content_type in HTML_TYPES
        text, encoding, replaced = decode_body(page.body, page.charset, is_html)
        try:
            body, title = await asyncio.get_running_loop().run_in_executor(pool, extract, (text, url, is_html))
        except Exception as e:  # a crash in trafilatura/lxml must not lose the record silently
            raise FetchError("extract_error", f"{type(e).__name__}: {e}"[:300], page.status) from None
        if not body:
            raise FetchError("no_text", "no main text extracted", page.status)
        return ({"text": body, "url": url, "title": title, "status": page.status,
                 "final_url": page.final_url, "encoding": encoding}, None, replaced)
    except FetchError as e:
        failed = {"url": url, "reason": e.reason, "detail": e.detail, "status": e.status}
        if e.reason in SETTINGS_OF_REASON:
            failed["settings"] = {name: getattr(fetcher.args, name) for name in SETTINGS_OF_REASON[e.reason]}
        return None, failed, False
    except Exception as e:  # last resort: record it, never drop a URL silently
        return None, {"url": url, "reason": "error", "detail": f"{type(e).__name__}: {e}"[:300],
                      "status": None}, False


async def _log_progress(counts: Counter, total: int, inflight: deque, interval: float) -> None:
    """A line every `interval` seconds, for when stderr is not a terminal and tqdm's bar is off:
    URLs that time out keep a crawl busy for minutes with nothing finished to report."""
    started = time.monotonic()
    while True:
        await asyncio.sleep(interval)
        done = sum(counts.values())  # outcomes only: "ok" and one key per failure reason
        failed = done - counts["ok"]
        elapsed = time.monotonic() - started
        print(f"[download] {done}/{total} URLs done (ok={counts['ok']}, failed={failed}), "
              f"{sum(not t.done() for t in inflight)} in flight, {done / elapsed:.1f} URL/s, {elapsed:.0f}s",
              file=sys.stderr, flush=True)


async def _download(args, todo: list[str], counts: Counter) -> None:
    failed_path = args.output + ".failed.jsonl"
    ctx = multiprocessing.get_context("spawn")  # never fork a process that runs resolver threads
    with concurrent.futures.ProcessPoolExecutor(args.extract_workers, mp_context=ctx) as pool:
        fetcher = Fetcher(args)
        out_fd = os.open(args.output, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        fail_fd = os.open(failed_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        window = max(4 * args.workers, 16)
        inflight: deque = deque()
        urls = iter(todo)
        bar = progress(total=len(todo), desc="download", unit="url")
        run_counts: Counter = Counter()  # this loop's results only, for the progress line
        logger = None if sys.stderr.isatty() else \
            asyncio.create_task(_log_progress(run_counts, len(todo), inflight, args.log_interval))
        try:
            while True:
                while len(inflight) < window and (url := next(urls, None)) is not None:
                    inflight.append(asyncio.create_task(_process(fetcher, pool, url)))
                if not inflight:
                    break
                # Commit strictly in input order: the output is the same however fast hosts answer.
                ok, failed, replaced = await inflight[0]  # stays in the deque (and the progress line) until done
                inflight.popleft()
                if ok is not None:
                    append_line(out_fd, ok)
                    counts["ok"] += 1
                    counts["decode_replaced"] += int(replaced)
                else:
                    append_line(fail_fd, failed)
                    counts[failed["reason"]] += 1
                run_counts["ok" if ok is not None else failed["reason"]] += 1
                bar.update(1)
        finally:
            for task in inflight:
                task.cancel()
            if logger is not None:
                logger.cancel()
            bar.close()
            os.close(out_fd)
            os.close(fail_fd)
            await fetcher.close()


def is_complete(args: argparse.Namespace) -> bool:
    """For `all`: stats.is_complete, except that --retry-failed always runs (it is not a parameter)."""
    return not args.retry_failed and _is_complete(args.output, args)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("download", help="fetch URLs (async, resumable) and extract main text",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("urls", help="text file of URLs, one per line (the blacklist output)")
    add_output_arg(p, "JSONL of {text,url,title,status}; appended, resumable")
    p.add_argument("--workers", "--n_procs", type=int, default=32,
                   help="concurrent requests (--n_procs: the tutorial's name for it)")
    p.add_argument("--per-host", type=int, default=4, help="concurrent requests per host")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per attempt, whole fetch")
    p.add_argument("--max-bytes", type=int, default=5_000_000, help="body size cap (after decompression)")
    p.add_argument("--retries", type=int, default=2, help="extra attempts on 5xx/429/timeouts")
    p.add_argument("--backoff", type=float, default=1.0, help="first retry delay in seconds (doubles)")
    p.add_argument("--max-redirects", type=int, default=5, help="HTTP redirects followed per URL")
    p.add_argument("--allow-private", action="store_true",
                   help="allow loopback/private/link-local addresses (tests, intranet crawls)")
    p.add_argument("--retry-failed", action="store_true",
                   help="fetch every URL in OUT.failed.jsonl again (they are removed from it first); without "
                        "it, only failures whose deciding flag changed (e.g. private_address, now "
                        "--allow-private) are fetched again")
    p.add_argument("--force", action="store_true",
                   help="start over: discard OUT, OUT.failed.jsonl and OUT.partial, fetch every URL")
    p.add_argument("--log-interval", type=float, default=10.0,
                   help="seconds between progress lines when stderr is not a terminal (a terminal gets a bar)")
    p.add_argument("--extract-workers", type=int, default=max(1, min(4, os.cpu_count() or 1)),
                   help="processes for trafilatura extraction")
    add_common_args(p)
    return p


def run(args: argparse.Namespace) -> int:
    started = time.time()
    check_input(args.urls, "URL file")
    for name in ("workers", "per_host", "extract_workers", "max_bytes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.log_interval <= 0:
        raise ValueError(f"--log-interval must be > 0 seconds, got {args.log_interval}")
    failed_path = args.output + ".failed.jsonl"
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    if args.force:
        for path in (args.output, failed_path, args.output + ".partial"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    counts: Counter = Counter()
    counts["repaired_partial_lines"] = int(repair_tail(args.output) > 0) + int(repair_tail(failed_path) > 0)
    retried = requeue_failures(failed_path, args)
    if retried:
        why = "--retry-failed" if args.retry_failed else "the flags that decided them changed"
        print(f"download: fetching again {sum(retried.values())} URLs that failed before "
              f"({_summary(retried)}): {why}", file=sys.stderr)
        counts["retried_failed"] = sum(retried.values())
    failed_before = done_urls(failed_path)
    done = done_urls(args.output) | failed_before

    todo, seen = [], set()
    report = BadLineReporter(args.urls, args.strict, action=f"recorded in {failed_path} as invalid_url")
    for lineno, url in iter_text_lines(args.urls):
        counts["input"] += 1
        try:
            check_url(url, allow_private=True)  # syntax only; addresses are checked when fetching
        except FetchError as e:
            report(lineno, e.detail)
        if url in seen:
            counts["duplicate_input"] += 1
        elif url in done:
            counts["already_done"] += 1
            counts["skipped_failed"] += url in failed_before
        else:
            todo.append(url)
        seen.add(url)
    if counts["skipped_failed"]:
        print(f"download: skipping {counts['skipped_failed']} URLs that failed before "
              f"({_summary(failure_reasons(failed_path))}); --retry-failed fetches them again", file=sys.stderr)
    asyncio.run(_download(args, todo, counts))
    total_ok = len(done_urls(args.output))
    write_stats(args.output, "download", counts, args, [args.urls], started,
                total_ok=total_ok, total_failed=len(done_urls(failed_path)),
                failed_reasons=dict(failure_reasons(failed_path).most_common()))
    return 0

