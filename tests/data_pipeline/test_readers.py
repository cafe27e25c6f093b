"""cleanup on users' own data (readers.py, warc.py, dist_cleanup.py): JSONL with any key, JSONL folders of .gz
files, Parquet, a saved and a Hub-layout Hugging Face dataset give the documents of the same rows as plain JSONL;
a WARC of real HTTP responses gives the documents `download` gets from the same pages; the sharded tasks (local
and Ray) write what one process writes; `all --input` runs the chain from them."""
from __future__ import annotations

import functools
import gzip
import html
import http.server
import json
import os
import threading
import urllib.error
import urllib.request

import pytest

from data_pipeline import readers
from data_pipeline.__main__ import main

pytestmark = pytest.mark.timeout(180)

SAMPLE = os.path.join(os.path.dirname(readers.__file__), "assets", "sample", "stdlib_docs.jsonl")
KEYS = ["--text-key", "content", "--id-key", "doc_id", "--url-key", "link"]
FIELDS = ("text", "id", "url")


def sample_rows(n: int) -> list[dict]:
    """n rows of the bundled sample under other keys, plus a row whose text is null and one whose text is
    empty (a malformed and an empty document, wherever they come from)."""
    with open(SAMPLE) as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(n), f)]
    rows = [{"content": t, "doc_id": f"doc-{i}", "link": f"https://docs.python.org/3/{i}.html", "lang": "en"}
            for i, t in enumerate(texts)]
    rows.insert(5, {"content": None, "doc_id": "doc-null", "link": "https://docs.python.org/3/null", "lang": "en"})
    rows.insert(9, {"content": "", "doc_id": "doc-empty", "link": "https://docs.python.org/3/empty", "lang": "en"})
    return rows


def write_formats(rows: list[dict], root) -> dict[str, str]:
    """The same rows as a JSONL file, a folder of .jsonl.gz files, a folder of Parquet files, a dataset saved with
    save_to_disk and a Hub-layout dataset folder (a card naming its Parquet data files)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    halves = (rows[:len(rows) // 2], rows[len(rows) // 2:])
    paths = {name: str(root / name) for name in ("docs.jsonl", "jsonl_gz", "parquet", "saved", "hub")}
    with open(paths["docs.jsonl"], "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    for d in ("jsonl_gz", "parquet", "hub/data"):
        os.makedirs(root / d)
    for i, half in enumerate(halves):
        with gzip.open(root / "jsonl_gz" / f"part-{i}.jsonl.gz", "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in half)
        pq.write_table(pa.Table.from_pylist(half), root / "parquet" / f"part-{i}.parquet")
        pq.write_table(pa.Table.from_pylist(half), root / "hub" / "data" / f"train-{i:05d}-of-00002.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(paths["saved"])
    (root / "hub" / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
                                            "    path: data/train-*\n---\n# stdlib docs\n")
    return paths


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    return write_formats(sample_rows(80), root), root


def cleanup(path: str, out, *extra: str) -> tuple[list[dict], dict]:
    assert main(["cleanup", path, "--output", str(out), "--min-tokens", "50", "--workers", "1", *KEYS, *extra]) == 0
    return read_jsonl(out), json.loads(open(f"{out}.stats.json").read())


def test_every_format_gives_the_documents_of_its_rows(formats, tmp_path):
    paths, _ = formats
    want, want_stats = cleanup(paths["docs.jsonl"], tmp_path / "jsonl.jsonl")  # the line path, as before
    assert 40 < len(want) < 80 and want_stats["counts"]["malformed"] == 1 and want_stats["counts"]["empty"] == 1
    assert [r["id"] for r in want[:2]] == ["doc-0", "doc-1"] and want[0]["url"] == "https://docs.python.org/3/0.html"
    for name, fmt in (("jsonl_gz", "jsonl"), ("parquet", "parquet"), ("saved", "hf"), ("hub", "hf")):
        got, stats = cleanup(paths[name], tmp_path / f"{name}.jsonl")  # --input-format auto
        assert [{k: r[k] for k in FIELDS} for r in got] == [{k: r[k] for k in FIELDS} for r in want], name
        assert all(r["lang"] == "en" for r in got), name  # the row's other fields travel with it
        assert stats["counts"] == want_stats["counts"] and stats["input_format"] == fmt, name
        rejects = read_jsonl(tmp_path / f"{name}.jsonl.rejected.jsonl")
        assert {r["reason"] for r in rejects} == {"too_short", "malformed", "empty", "wrong_lang"} & \
            {r["reason"] for r in read_jsonl(tmp_path / "jsonl.jsonl.rejected.jsonl")}, name
        assert next(r for r in rejects if r["reason"] == "malformed")["id"] == "doc-null", name
        # a file added to the folder makes the output stale for `all`
        assert stats["inputs"][0]["path"] == os.path.abspath(paths[name]) and len(stats["inputs"]) > 1, name


def test_bad_lines_in_a_folder_of_gz_files_are_counted_and_the_rest_kept(tmp_path, capsys):
    """A line that is no JSON and one that is no UTF-8, between good ones, in a .jsonl.gz of a folder: each is
    malformed, named FILE:LINE and recorded whole, and every good line (after them too) is a document; --strict
    stops at the first. (Read by datatrove's JsonlReader, the first was passed over uncounted and the second
    dropped the rest of its file.)"""
    rows = [json.dumps({"content": text, "doc_id": f"d{i}"}).encode() for i, text in
            enumerate(r["content"] for r in sample_rows(8) if r["content"])]
    lines = rows[:2] + [b'{"content": oops}'] + rows[2:4] + [b'{"content": "caf\xe9 \xff"}'] + rows[4:]
    (tmp_path / "in").mkdir()
    with gzip.open(tmp_path / "in" / "part.jsonl.gz", "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    folder = str(tmp_path / "in")
    assert main(["cleanup", folder, "--output", str(tmp_path / "out.jsonl"), "--min-tokens", "1", "--workers", "1",
                 "--lang", "any", *KEYS]) == 0
    kept, rejects = read_jsonl(tmp_path / "out.jsonl"), read_jsonl(tmp_path / "out.jsonl.rejected.jsonl")
    assert [r["id"] for r in kept] == [f"d{i}" for i in range(len(rows))]
    where = os.path.join(folder, "part.jsonl.gz")
    assert [(r["where"], r["reason"]) for r in rejects] == [(f"{where}:3", "malformed"),
                                                            (f"{where}:6", "malformed")]
    assert f"{where}:6: not valid UTF-8" in capsys.readouterr().err
    assert main(["cleanup", folder, "--output", str(tmp_path / "strict.jsonl"), "--strict", "--workers", "1",
                 *KEYS]) != 0
    assert f"error: {where}:3: malformed JSON" in capsys.readouterr().err


def test_without_an_id_the_id_is_file_and_row(formats, tmp_path):
    paths, _ = formats
    got, _ = cleanup(paths["parquet"], tmp_path / "p.jsonl", "--id-key", "no_such_key")
    assert got[0]["id"] == "part-0.parquet/0" and got[0]["doc_id"] == "doc-0"  # the row's own field stays too
    got, _ = cleanup(paths["saved"], tmp_path / "s.jsonl", "--id-key", "no_such_key")
    assert got[0]["id"] == "saved/train/0" and got[1]["id"] == "saved/train/1"


def test_sharded_tasks_write_what_one_process_writes(formats, tmp_path):
    """Row ranges of a saved dataset and the files of a folder, dealt to 3 tasks, give the in-process bytes."""
    paths, _ = formats
    for name in ("saved", "parquet"):
        one, many = tmp_path / f"{name}-one.jsonl", tmp_path / name / "many.jsonl"
        cleanup(paths[name], one)
        cleanup(paths[name], many, "--executor", "local", "--tasks", "3", "--workers", "2")
        for suffix in ("", ".rejected.jsonl"):
            assert open(f"{many}{suffix}", "rb").read() == open(f"{one}{suffix}", "rb").read(), (name, suffix)
        stats = json.loads(open(f"{many}.stats.json").read())
        assert stats["shards"] == (3 if name == "saved" else 2)  # no more tasks than files
        assert not os.listdir(tmp_path / name / ".tasks")


def test_the_format_is_told_from_names_and_folders(formats, tmp_path, capsys):
    paths, root = formats
    assert [readers.detect_format(p) for p in (paths["docs.jsonl"], paths["jsonl_gz"], paths["parquet"],
                                               paths["saved"], paths["hub"])] == ["jsonl", "jsonl", "parquet", "hf",
                                                                                  "hf"]
    assert readers.detect_format("CC-MAIN-1-00000.warc.wet.gz") == readers.detect_format("x.warc") == "warc"
    assert readers.detect_format("raw.json") == readers.detect_format("raw") == "jsonl"  # the tutorial's names
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.jsonl").write_text("{}\n")
    (mixed / "b.parquet").write_bytes(open(os.path.join(paths["parquet"], "part-0.parquet"), "rb").read())
    assert main(["cleanup", str(mixed), "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "pass --input-format" in capsys.readouterr().err
    assert main(["cleanup", paths["saved"], "--output", str(tmp_path / "o.jsonl"), "--split", "test"]) == 0
    assert main(["cleanup", paths["hub"], "--output", str(tmp_path / "o.jsonl"), "--split", "test"]) == 2
    assert "--split" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------- WARC

@pytest.fixture
def pages(tmp_path):
    """A web site of real HTML pages made from the sample, a PNG and a missing page; its URL list; and a
    WARC of those URLs fetched over HTTP (warcio's capture_http records the real responses)."""
    from warcio.capture_http import capture_http

    site = tmp_path / "site"
    site.mkdir()
    with open(SAMPLE) as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(40), f)]
    for i, text in enumerate(texts):
        body = "".join(f"<p>{html.escape(p)}</p>" for p in text.split("\n\n"))
        # page 1 is in windows-1252, said only by its <meta> (the server sends no charset)
        charset, title = ("windows-1252", "Page 1 caf\u00e9 cr\u00e8me") if i == 1 else ("utf-8", f"Page {i}")
        (site / f"{i}.html").write_bytes(
            f"<html><head><meta charset='{charset}'><title>{title}</title></head><body><nav>Home | Index</nav>"
            f"<article>{body}</article><footer>Python docs</footer></body></html>".encode(charset))
    (site / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    handler = functools.partial(type("Quiet", (http.server.SimpleHTTPRequestHandler,),
                                     {"log_message": lambda *a: None}), directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    urls = [f"{base}/{i}.html" for i in range(len(texts))] + [f"{base}/logo.png", f"{base}/gone.html"]
    (tmp_path / "urls.txt").write_text("".join(u + "\n" for u in urls))
    warc = tmp_path / "crawl" / "pages.warc.gz"
    warc.parent.mkdir()
    with capture_http(str(warc)):
        for url in urls:
            try:
                urllib.request.urlopen(url, timeout=10).read()
            except urllib.error.HTTPError:
                pass  # the 404 is recorded like any response
    yield tmp_path, warc
    httpd.shutdown()
    httpd.server_close()


def test_warc_pages_give_the_documents_download_gets(pages):
    """`all --input` on the WARC writes the clean documents and corpus that `all --urls` writes after
    downloading the same pages: the same extraction, typing and decoding."""
    tmp_path, warc = pages
    common = ["--min-tokens", "50", "--workers", "1", "--tasks", "1"]
    assert main(["all", "--urls", str(tmp_path / "urls.txt"), "--workdir", str(tmp_path / "dl"), "--allow-private",
                 "--extract-workers", "1", *common]) == 0
    assert main(["all", "--input", str(warc), "--workdir", str(tmp_path / "warc"), *common]) == 0
    for name in ("clean.jsonl", "webtext.jsonl"):
        downloaded, from_warc = read_jsonl(tmp_path / "dl" / name), read_jsonl(tmp_path / "warc" / name)
        assert len(from_warc) > 20
        assert [(r["text"], r["url"], r["title"]) for r in from_warc] == \
            [(r["text"], r["url"], r["title"]) for r in downloaded], name
    doc, latin = read_jsonl(tmp_path / "warc" / "clean.jsonl")[:2]
    assert doc["id"].startswith("<urn:uuid:") and doc["status"] == 200 and doc["title"] == "Page 0"
    assert latin["title"] == "Page 1 caf\u00e9 cr\u00e8me" and latin["encoding"] == "windows-1252"
    rejects = {r["reason"]: r for r in read_jsonl(tmp_path / "warc" / "clean.jsonl.rejected.jsonl")}
    assert rejects["content_type"]["url"].endswith("/logo.png") and rejects["http_404"]["url"].endswith("/gone.html")
    assert "too_short" in rejects  # the short pages are cleanup's to reject, as for downloaded ones


def test_wet_records_are_text_already(tmp_path):
    """A WET file (Common Crawl's extracted text: `conversion` records) gives its texts, ids and URLs as they are;
    its warcinfo record is not a document."""
    from io import BytesIO

    from warcio.warcwriter import WARCWriter

    with open(SAMPLE) as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(6), f)]
    path = tmp_path / "CC-MAIN-1-00000.warc.wet.gz"
    with open(path, "wb") as f:
        writer = WARCWriter(f, gzip=True)
        writer.write_record(writer.create_warcinfo_record("CC-MAIN-1-00000.warc.wet.gz", {"software": "test"}))
        for i, text in enumerate(texts):
            writer.write_record(writer.create_warc_record(
                f"https://docs.python.org/3/{i}.html", "conversion", payload=BytesIO(text.encode()),
                warc_content_type="text/plain"))
    got, stats = cleanup(str(path), tmp_path / "wet.jsonl", "--min-tokens", "1", "--lang", "any")
    want, _ = cleanup(str(write_plain(tmp_path / "plain.jsonl", texts)), tmp_path / "plain.jsonl.out",
                      "--min-tokens", "1", "--lang", "any", "--text-key", "text", "--url-key", "url")
    assert stats["input_format"] == "warc" and stats["counts"]["kept"] == len(texts)
    assert [(r["text"], r["url"]) for r in got] == [(r["text"], r["url"]) for r in want]
    assert all(r["id"].startswith("<urn:uuid:") and r["status"] is None for r in got)


def write_plain(path, texts):
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": t, "url": f"https://docs.python.org/3/{i}.html"}) + "\n"
                     for i, t in enumerate(texts))
    return path


@pytest.mark.timeout(300)
def test_cleanup_on_ray_gives_the_in_process_documents(formats, tmp_path):
    """cleanup of a Parquet folder as tasks on a local Ray (2 CPUs) writes the documents that the JSONL of the
    same rows gives in one process (the later stages read JSONL, and run on Ray in test_dist_stages.py)."""
    ray = pytest.importorskip("ray")
    paths, _ = formats
    want, want_stats = cleanup(paths["docs.jsonl"], tmp_path / "one.jsonl")
    started = not ray.is_initialized()  # a Ray another test left running is used as it is
    if started:
        ray.init(num_cpus=2, include_dashboard=False)
    try:
        got, stats = cleanup(paths["parquet"], tmp_path / "ray" / "clean.jsonl", "--executor", "ray", "--tasks", "2",
                             "--workers", "2")
    finally:
        if started:
            ray.shutdown()
    assert [{k: r[k] for k in FIELDS} for r in got] == [{k: r[k] for k in FIELDS} for r in want]
    assert stats["counts"] == want_stats["counts"] and stats["shards"] == 2
