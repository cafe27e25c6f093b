"""A local HTTP server for the download and CLI tests: real-looking English articles, German and Chinese pages,
near-duplicates, slow, hanging and trickling endpoints, huge bodies, errors, redirects and odd encodings."""
from __future__ import annotations

import http.server
import json
import threading
import time
from collections import Counter


def _prose_topics() -> list[tuple[str, list[str]]]:
    """Real English prose: the Python language reference topics shipped with the stdlib (offline)."""
    import pydoc_data.topics

    out = []
    for key, text in sorted(pydoc_data.topics.topics.items()):
        paras = [" ".join(p.split()) for p in text.split("\n\n")
                 if len(p.split()) > 15 and not p.startswith(" ")]
        if len(paras) >= 6:
            out.append((key.replace("-", " ").capitalize(), paras[:8]))
    return out


TOPICS = _prose_topics()
GERMAN = ("Die Geschichte der Stadt beginnt im Mittelalter, als Händler an der Brücke einen Markt "
          "gründeten. Über viele Jahrhunderte wuchs die Siedlung langsam, und die Bürger bauten eine "
          "Kirche, ein Rathaus und mehrere Schulen. Heute leben dort ungefähr zwanzigtausend Menschen, "
          "die stolz auf ihre alten Häuser und ihre ruhigen Straßen sind. ") * 4
CHINESE = "这是一个关于城市历史的长篇文章。人们在河边建立了市场，城市慢慢发展起来。" * 20


def article_text(i: int, variant: int = 0) -> tuple[str, list[str]]:
    title, paras = TOPICS[i % len(TOPICS)]
    paras = list(paras)
    if variant:  # a near-duplicate: a few words changed, a footer line added
        paras[1] = paras[1].replace(" the ", " this ", 3)
        paras.append("This article was republished with permission.")
    return f"{title} ({i})", paras


def article_html(i: int, variant: int = 0, charset: str = "utf-8") -> bytes:
    title, paras = article_text(i, variant)
    body = "".join(f"<p>{p}</p>\n" for p in paras)
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='{charset}'><title>{title}</title></head>"
            f"<body><nav><a href='/'>Home</a> | <a href='/about'>About</a> | <a href='/contact'>Contact</a></nav>"
            f"<article><h1>{title}</h1>\n{body}</article>"
            f"<footer>Copyright 2024 Example Media. All rights reserved.</footer></body></html>").encode(charset)


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    counters: Counter = Counter()
    delay = 0.0
    # requests in flight now / at most, per Host header and in total ("*"); the fixture gives fresh ones
    active: Counter = Counter()
    peak: Counter = Counter()
    lock = threading.Lock()
    stamps: dict = {}  # path -> arrival times (time.monotonic) of its requests

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_GET(self):
        # Requests count as in flight while the handler waits `delay`, before any byte is sent: a
        # client sends its next request only after this reply, so the count never overstates.
        cls, host = type(self), self.headers.get("Host", "")
        with cls.lock:
            cls.stamps.setdefault(self.path.split("?")[0], []).append(time.monotonic())
            for key in (host, "*"):
                cls.active[key] += 1
                cls.peak[key] = max(cls.peak[key], cls.active[key])
        time.sleep(self.delay)
        with cls.lock:
            cls.active[host] -= 1
            cls.active["*"] -= 1
        self.respond()

    def send(self, status: int, body: bytes, ctype: str | None = "text/html; charset=utf-8", headers=()):
        self.send_response(status)
        if ctype:
            self.send_header("Content-Type", ctype)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def respond(self):  # noqa: C901 - one branch per endpoint is the clearest layout here
        path = self.path.split("?")[0]
        type(self).counters[path] += 1
        try:
            if path.startswith("/article/"):
                self.send(200, article_html(int(path.rsplit("/", 1)[1])))
            elif path.startswith("/dup/"):
                self.send(200, article_html(int(path.rsplit("/", 1)[1]), variant=1))
            elif path == "/german":
                self.send(200, f"<html><head><title>Stadt</title></head><body><article><p>{GERMAN}</p>"
                               f"</article></body></html>".encode())
            elif path == "/chinese-gbk":
                self.send(200, f"<html><head><meta charset='gbk'><title>城市</title></head><body><article>"
                               f"<p>{CHINESE}</p></article></body></html>".encode("gbk"), "text/html")
            elif path == "/latin1":
                self.send(200, article_html(2, charset="windows-1252").replace(b"</h1>", b" caf\xe9 cr\xe8me</h1>"),
                          "text/html")
            elif path == "/bad-utf8":
                self.send(200, article_html(3).replace(b"Engineers", b"Engin\xff\xfeers"))
            elif path == "/unknown-charset":
                self.send(200, article_html(4), "text/html; charset=no-such-charset")
            elif path == "/plain":
                self.send(200, (" ".join(article_text(5)[1])).encode(), "text/plain; charset=utf-8")
            elif path == "/no-content-type":
                self.send(200, article_html(6), None)
            elif path == "/slow":
                time.sleep(0.5)
                self.send(200, article_html(7))
            elif path == "/hang":
                time.sleep(30)
            elif path == "/drip":  # headers at once, then one byte every 0.1 s: defeats read timeouts
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", "100000")
                self.end_headers()
                for _ in range(300):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.1)
            elif path == "/huge":
                self.send(200, b"<html><body><p>" + b"x" * 3_000_000 + b"</p></body></html>")
            elif path == "/huge-chunked":  # no Content-Length: the cap must hold while streaming
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Connection", "close")
                self.end_headers()
                for _ in range(50):
                    self.wfile.write(b"<p>" + b"y" * 100_000 + b"</p>")
            elif path == "/404":
                self.send(404, b"<html><body>not found</body></html>")
            elif path == "/500":
                self.send(500, b"<html><body>server error</body></html>")
            elif path == "/flaky":  # 503 on the first request, then a page: retries must work
                if type(self).counters[path] == 1:
                    self.send(503, b"busy")
                else:
                    self.send(200, article_html(1))
            elif path == "/redirect":
                self.send(302, b"", None, [("Location", "/article/0")])
            elif path == "/loop-a":
                self.send(302, b"", None, [("Location", "/loop-b")])
            elif path == "/loop-b":
                self.send(301, b"", None, [("Location", "/loop-a")])
            elif path == "/to-private":  # a redirect inward, to a private address and to a loopback name
                self.send(302, b"", None, [("Location", "http://10.0.0.1/admin")])
            elif path == "/to-localhost":
                self.send(302, b"", None, [("Location", f"http://localhost:{self.server.server_address[1]}/")])
            elif path.startswith("/chain/"):
                n = int(path.rsplit("/", 1)[1])
                self.send(302, b"", None, [("Location", f"/chain/{n + 1}")])
            elif path == "/image.png":
                self.send(200, b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 40, "image/png")
            elif path == "/binary-as-html":
                self.send(200, b"\x89PNG\r\n\x1a\n\x00\x00\x00" + bytes(range(256)) * 40)
            elif path == "/empty":
                self.send(200, b"<html><head><title>nothing</title></head><body></body></html>")
            else:
                self.send(404, b"no such page")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (timeout, size cap): expected


class QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # clients hanging up early is expected
        pass


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]
