"""Stage `blacklist`: filter a URL list before downloading anything.

Rejects malformed and too-short URLs, non-http(s) schemes, blacklisted registered domains
(tldextract with its bundled public-suffix snapshot, never the network), blacklisted file
extensions of the path (query ignored), and exact duplicates. Keeps first occurrences in
input order. Does not resolve hosts (download refuses private addresses).

    python -m data_pipeline blacklist urls/ --output urls.clean.txt --extra-domains mine.txt
"""
from __future__ import annotations

import argparse
import os
import re
import time
from collections import Counter
from urllib.parse import urlsplit

from data_pipeline.cli_args import add_common_args, add_output_arg, check_input
from data_pipeline.files import atomic_write
from data_pipeline.jsonl import BadLineReporter, dumps, iter_text_lines
from data_pipeline.stats import write_stats
from data_pipeline.workers import progress

ASSETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
DEFAULT_MIN_LENGTH = 10  # "http://a.b"; Megatron dropped len(url) <= 8
SCHEMES = ("http", "https")
# A hostname: dot-separated labels of letters/digits/hyphens (IDNA is ASCII), or an IP literal.
_HOST_RE = re.compile(r"^(?=.{1,253}$)([a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?\.)*[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?\.?$")
_IP_RE = re.compile(r"^(\d{1,3}\.){3}\d{1,3}$|:")
_BAD_CHARS_RE = re.compile(r"[\s\x00-\x1f\x7f<>\"{}|\\^`\ufffd]")


def read_list(path: str) -> list[str]:
    """Entries of a list file: one per line, lowercased, `#` comments and blanks skipped."""
    check_input(path, "list file")
    return [line.lower() for _, line in iter_text_lines(path)]


def default_list(name: str) -> list[str]:
    """A list shipped in data_pipeline/assets/ (setup.py ships assets/*)."""
    return read_list(os.path.join(ASSETS_DIR, name))


class UrlFilter:
    """Decides keep/reject for one URL; `check(url)` returns None to keep or a reason string.

    Domain entries without a dot ("youtube") match the registrable label under any public
    suffix; entries with a dot ("bit.ly", "play.google.com") match that host and its subdomains.
    """

    def __init__(self, domains: list[str], extensions: list[str], min_length: int = DEFAULT_MIN_LENGTH):
        import tldextract

        # suffix_list_urls=() and cache_dir=None: use the snapshot bundled with the package, never
        # fetch or write a cache, so results are the same offline and across machines. Private
        # suffixes (github.io, blogspot.com) count, so user.github.io is its own site, not GitHub.
        self._extract = tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None,
                                              include_psl_private_domains=True)
        self.labels = {d for d in domains if "." not in d}
        self.hosts = {d.strip(".") for d in domains if "." in d}
        bad = [e for e in extensions if not e.startswith(".")]
        if bad:
            raise ValueError(f"extensions must start with '.', got {bad[:3]}; write e.g. '.pdf'")
        self.extensions = tuple(sorted(set(extensions)))
        self.min_length = min_length

    def check(self, url: str) -> str | None:
        if _BAD_CHARS_RE.search(url):
            return "malformed"
        try:
            parts = urlsplit(url)
            host = parts.hostname
            parts.port  # raises ValueError on a non-numeric or out-of-range port
        except ValueError:
            return "malformed"
        if parts.scheme.lower() not in SCHEMES:
            return "scheme"
        if not host or not (_HOST_RE.match(host) or _IP_RE.search(host)):
            return "malformed"
        if len(url) < self.min_length:
            return "too_short"
        if self.blocked_domain(host):
            return "domain"
        if parts.path.lower().endswith(self.extensions):
            return "extension"
        return None

    def blocked_domain(self, host: str) -> bool:
        host = host.rstrip(".")
        labels = host.split(".")
        if any(".".join(labels[i:]) in self.hosts for i in range(len(labels))):
            return True
        return self._extract(host).domain in self.labels


def input_files(path: str) -> list[str]:
    """A .txt file, or every *.txt under a directory in sorted order (deterministic)."""
    check_input(path)
    if os.path.isfile(path):
        return [path]
    found = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        found += [os.path.join(root, f) for f in sorted(files) if f.endswith(".txt") and not f.startswith(".")]
    if not found:
        raise ValueError(f"directory {path!r} has no *.txt URL files")
    return found


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("blacklist", help="filter a URL list by domain, extension, scheme, duplicates",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="a .txt file of URLs (one per line) or a directory of them")
    add_output_arg(p, "kept URLs, one per line, first occurrence order")
    p.add_argument("--extra-domains", help="file of extra domains to reject (one per line)")
    p.add_argument("--extra-extensions", help="file of extra path extensions to reject ('.foo' per line)")
    p.add_argument("--no-default-lists", action="store_true",
                   help="use only the --extra-* lists, not data_pipeline/assets/blacklist_*.txt")
    p.add_argument("--min-length", type=int, default=DEFAULT_MIN_LENGTH, help="shorter URLs are rejected")
    add_common_args(p)
    return p



REASONS = ("malformed", "scheme", "too_short", "domain", "extension", "duplicate")


def record_url(url: str, reason: str | None, source: str, seen: set[str], counts: Counter, out, rej,
               report_malformed) -> None:
    """Write a URL the filter passed and that was not seen before to `out`; any other goes to the rejects
    file `rej` with its reason and `source` (file:line). Shared by the in-process and the task stage."""
    counts["input"] += 1
    if reason is None and url in seen:
        reason = "duplicate"
    if reason == "malformed":
        report_malformed()
    if reason is not None:
        counts[reason] += 1
        rej.write(dumps({"url": url, "reason": reason, "source": source}))
        return
    seen.add(url)
    counts["kept"] += 1
    out.write(url + "\n")

def run(args: argparse.Namespace) -> int:
    started = time.time()
    files = input_files(args.input)
    domains = [] if args.no_default_lists else default_list("blacklist_domains.txt")
    extensions = [] if args.no_default_lists else default_list("blacklist_extensions.txt")
    if args.extra_domains:
        domains += read_list(args.extra_domains)
    if args.extra_extensions:
        extensions += read_list(args.extra_extensions)
    url_filter = UrlFilter(domains, extensions, args.min_length)

    counts: Counter = Counter()
    seen: set[str] = set()
    with atomic_write(args.output) as out, atomic_write(args.output + ".rejected.jsonl") as rej:
        for path in files:
            report = BadLineReporter(path, args.strict)
            for lineno, url in progress(iter_text_lines(path), desc=f"blacklist {os.path.basename(path)}",
                                        unit="url"):
                record_url(url, url_filter.check(url), f"{path}:{lineno}", seen, counts, out, rej,
                           lambda: report(lineno, f"malformed URL {url[:200]!r}"))
    for reason in REASONS:
        counts.setdefault(reason, 0)
    # the directory itself too: its mtime changes when a URL file is added or removed
    inputs = ([args.input] if os.path.isdir(args.input) else []) + files + \
        [f for f in (args.extra_domains, args.extra_extensions) if f]
    write_stats(args.output, "blacklist", counts, args, inputs, started,
                num_domains=len(set(domains)), num_extensions=len(set(extensions)))
    return 0
