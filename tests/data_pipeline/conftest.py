"""Fixtures shared by the data pipeline's test modules (so that no test module imports another)."""
from __future__ import annotations

import pytest

try:  # the local test web server (rootdir-relative or package import)
    from web_server import Handler, QuietServer
except ImportError:  # pragma: no cover - when tests/data_pipeline becomes a package
    from tests.data_pipeline.web_server import Handler, QuietServer


@pytest.fixture
def site():
    import threading
    from collections import Counter

    handler = type("H", (Handler,), {"counters": Counter(), "delay": 0.0})
    httpd = QuietServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    httpd.shutdown()
    httpd.server_close()
