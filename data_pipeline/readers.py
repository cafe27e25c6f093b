"""Users' own data as the records cleanup reads: JSONL with any text key (a folder of files, .gz/.zst too), Parquet
files or folders, a Hugging Face dataset (saved with `save_to_disk`, or a folder in the Hub's layout) and
WARC/WET files (warc.py: pages typed, decoded and later extracted as `download` does).

A `Source` names the input and its keys. `units()` cuts it into work units of whole files (a saved dataset:
contiguous ranges of rows) in input order, and `read(unit)` yields the unit's documents in order, so a task per
unit writes what one process writes: cleanup's output is the same on every executor. A record is
{"text", "id", "url" (when the input has one), ...the row's other fields}; `id` is the input's own (`--id-key`,
a WARC-Record-ID) or FILE/ROW, so dedup and provenance work as for downloaded pages. Files are opened through
datatrove's folders and read by its readers (ParquetReader, warc.WarcPageReader) or, JSONL, line by line here, so
a bad line is counted and reported as FILE:LINE and the lines after it read on; datasets through `datasets`
(memory-mapped or streamed, never loaded whole). A plain JSONL file, the download output's format, is not read
here: cleanup reads it by lines (byte-range shards, bad lines reported by number).

    python -m data_pipeline cleanup shards/ --input-format parquet --text-key content --output clean.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any, Iterator

from data_pipeline.jsonl import parse_jsonl_line

INPUT_FORMATS = ("auto", "jsonl", "parquet", "hf", "warc")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
COMPRESSED = (".gz", ".zst", ".bz2", ".xz")  # what datatrove's readers (fsspec's compression="infer") open
ROWS_PER_BATCH = 1000  # rows of a saved dataset read from its memory map at once
# A folder holding these is a Hugging Face dataset: save_to_disk's files, or a Hub dataset card.
HF_MARKERS = ({"state.json", "dataset_info.json"}, {"dataset_dict.json"}, {"README.md"})

# What `read` yields, in input order: ("doc", record, is_page), is_page True for a WARC page whose main text is
# still to be extracted (warc.extract_page, in cleanup's workers); or ("skip", id, reason, detail, url) for an
# input document with no text, or a WARC response that is not a page (download's reasons: http_404, content_type).
Item = tuple


def add_input_args(p: argparse.ArgumentParser) -> None:
    """cleanup's flags that say what its input is."""
    p.add_argument("--input-format", choices=INPUT_FORMATS, default="auto",
                   help="what IN is: jsonl (a file or folder, .gz/.zst too), parquet (a file or folder), hf (a "
                        "datasets folder: save_to_disk or the Hub's layout), warc (WARC/WET files; HTML extracted as "
                        "download does); auto tells them by file names and a folder's files")
    p.add_argument("--text-key", default="text", help="the key or column that holds the text (jsonl, parquet, hf)")
    p.add_argument("--id-key", default="id", help="the key or column of the document's id, kept as `id` "
                                                  "(without one: FILE/ROW)")
    p.add_argument("--url-key", default="url", help="the key or column of the document's URL, kept as `url`")
    p.add_argument("--split", default="train", help="--input-format hf: the split to read")


# ------------------------------------------------------------------------------------------------- formats

def format_of_name(name: str) -> str | None:
    """The format a file's name says, or None."""
    from data_pipeline.warc import WARC_SUFFIXES

    name = name.lower()
    if name.endswith(WARC_SUFFIXES):
        return "warc"
    if name.endswith(".parquet"):
        return "parquet"
    stem = next((name[:-len(c)] for c in COMPRESSED if name.endswith(c)), name)
    return "jsonl" if stem.endswith(JSONL_SUFFIXES) else None


def _fs(path: str):
    import fsspec

    return fsspec.core.url_to_fs(path)


def is_dir(path: str) -> bool:
    fs, p = _fs(path)
    return fs.isdir(p)


def data_files(path: str) -> list[str]:
    """The files of folder `path` that hold documents, relative to it and sorted (datatrove's listing), without
    hidden ones (`.x`, `_x`: as `datasets` skips them) and the pipeline's own stats files."""
    from datatrove.io import get_datafolder

    from data_pipeline.stats import STATS_SUFFIX

    return [f for f in get_datafolder(path).list_files(recursive=True)
            if not any(part.startswith((".", "_")) for part in f.split("/")) and not f.endswith(STATS_SUFFIX)]


def detect_format(path: str) -> str:
    """--input-format auto: a folder with save_to_disk's files or a dataset card is `hf`; otherwise the format
    its files' names (or the file's name) say. A file of another name is JSONL, as the download output
    under any name (the Colossal-AI tutorial's raw.json)."""
    if not is_dir(path):
        return format_of_name(path) or "jsonl"
    fs, p = _fs(path)
    names = {os.path.basename(child.rstrip("/")) for child in fs.ls(p, detail=False)}
    if any(marker <= names for marker in HF_MARKERS):
        return "hf"
    kinds = {}
    for f in data_files(path):
        kinds.setdefault(format_of_name(f), f)
    kinds.pop(None, None)
    if len(kinds) != 1:
        found = ", ".join(f"{k} ({f})" for k, f in kinds.items()) or "no .jsonl, .parquet or .warc files"
        raise ValueError(f"cannot tell the format of folder {path!r}: {found}; pass --input-format "
                         f"{'|'.join(INPUT_FORMATS[1:])}")
    return next(iter(kinds))


def input_format(args: argparse.Namespace) -> str:
    """The format of cleanup's input (`args.input_format`, resolved when auto)."""
    return detect_format(args.input) if args.input_format == "auto" else args.input_format


def is_line_input(args: argparse.Namespace) -> bool:
    """True when cleanup reads its input by lines: one uncompressed JSONL file (the download output's format)."""
    return (input_format(args) == "jsonl" and not is_dir(args.input)
            and not args.input.lower().endswith(COMPRESSED))


def rename_keys(rec: dict, text_key: str, id_key: str, url_key: str) -> dict:
    """A JSONL record read by lines with its text, id and URL under the names the later stages read."""
    if text_key == "text" and id_key == "id" and url_key == "url":
        return rec  # the download output: written back as it was
    out = {"text": rec.pop(text_key)}
    for key, name in ((id_key, "id"), (url_key, "url")):
        if key != name and key in rec:
            out[name] = rec.pop(key)
    return out | rec


# -------------------------------------------------------------------------------------------------- source

@dataclass
class Source:
    """cleanup's input read through a reader: picklable (it crosses to datatrove's tasks), opened per unit."""

    path: str
    format: str
    """jsonl, parquet, hf or warc (resolved, never auto)."""
    text_key: str = "text"
    id_key: str = "id"
    url_key: str = "url"
    split: str = "train"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Source":
        fmt = input_format(args)
        if fmt == "hf" and not is_dir(args.input):
            raise ValueError(f"--input-format hf: {args.input!r} is not a folder; give the folder that save_to_disk "
                             f"wrote, or a dataset folder in the Hub's layout")
        return cls(args.input.rstrip("/") if "://" not in args.input else args.input, fmt, args.text_key,
                   args.id_key, args.url_key, args.split)

    # ------------------------------------------------------------- what there is
    def files(self) -> list[str]:
        """Every file the documents come from (full paths or URLs), for the stats' input signatures; a folder
        is listed too, so a file added to it makes the output stale."""
        if not is_dir(self.path):
            return [self.path]
        from datatrove.io import get_datafolder

        folder = get_datafolder(self.path)
        listed = folder.list_files(recursive=True) if self.format == "hf" else data_files(self.path)
        return [self.path] + folder.resolve_paths(listed)

    def units(self, tasks: int = 1) -> list[Any]:
        """Work units in input order: each file's path relative to the folder; for a saved dataset about
        `tasks` (start, end) row ranges; for a streamed one, its shards (data files) by index."""
        if self.format != "hf":
            if not is_dir(self.path):
                return [os.path.basename(self.path)]
            files = [f for f in data_files(self.path) if format_of_name(f) == self.format]
            if not files:
                raise ValueError(f"{self.path!r} holds no {self.format} files (names ending in "
                                 f"{_suffixes(self.format)}); check the folder or --input-format")
            return files
        ds = self._dataset()
        if self._saved():
            n = max(1, min(tasks, len(ds)))
            return [(len(ds) * i // n, len(ds) * (i + 1) // n) for i in range(n)]
        return list(range(ds.n_shards))

    # ------------------------------------------------------------- reading
    def read(self, unit: Any) -> Iterator[Item]:
        """The items of `unit` (see Item) in input order."""
        skipped: list[Item] = []
        if self.format == "hf":
            for data, where, index in self._rows(unit):
                yield from self._row_items(data, where, index, skipped)
            return
        if self.format == "jsonl":
            yield from self._jsonl(unit)
            return
        reader = self._reader(skipped)
        for doc in reader.read_file(unit):
            yield from _drain(skipped)
            yield "doc", {"text": doc.text, "id": doc.id, **plain(doc.metadata)}, self.format == "warc"
        yield from _drain(skipped)

    def _jsonl(self, unit: str) -> Iterator[Item]:
        """A JSONL file's documents line by line, opened through datatrove's folder (compression by the name, any
        fsspec filesystem). A line that is no UTF-8 JSON object is a ("malformed", "FILE:LINE", reason, the line)
        item, and the lines after it are read on: datatrove's JsonlReader logged such a line and passed over it,
        uncounted, and past a byte that is not UTF-8 dropped the rest of the file."""
        from datatrove.io import get_datafolder

        skipped: list[Item] = []
        folder = self._folder()
        with get_datafolder(folder).open(unit, "rb", compression="infer") as f:
            for index, raw in enumerate(f):
                rec, err = parse_jsonl_line(raw, None)
                if rec is not None:
                    yield from self._row_items(rec, unit, index, skipped)
                elif err:
                    yield ("malformed", f"{os.path.join(folder, unit)}:{index + 1}", err,
                           raw.decode("utf-8", errors="replace").rstrip("\n"))

    def _row_items(self, data: dict, where: str, index: Any, skipped: list[Item]) -> Iterator[Item]:
        """A row's items: what parse_row passed over, then its document when it has text."""
        doc = parse_row(data, where, index, self.text_key, self.id_key, self.url_key, skipped)
        yield from _drain(skipped)
        if doc["text"]:
            yield "doc", {"text": doc["text"], "id": doc["id"], **plain(doc["metadata"])}, False

    def _folder(self) -> str:
        """The folder the units' paths are relative to (a single file's own)."""
        return self.path if is_dir(self.path) else os.path.dirname(self.path) or "."

    def _reader(self, skipped: list[Item]):
        """The datatrove reader of this source's files; `skipped` collects the documents it passes over."""
        folder = self._folder()
        if self.format == "warc":
            from data_pipeline.warc import WarcPageReader

            return WarcPageReader(folder, on_skip=lambda *skip: skipped.append(("skip", *skip)),
                                  adapter=_adapter("text", "id", "url", skipped))
        adapter = _adapter(self.text_key, self.id_key, self.url_key, skipped)
        if self.format == "parquet":
            from datatrove.pipeline.readers import ParquetReader

            return ParquetReader(folder, adapter=adapter, text_key=self.text_key, id_key=self.id_key)
        raise ValueError(f"unknown input format {self.format!r}; one of {', '.join(INPUT_FORMATS[1:])}")

    # ------------------------------------------------------------- Hugging Face datasets
    # datatrove's HuggingFaceDatasetReader deals rows to tasks round-robin and numbers them per task, so the
    # order and the FILE/ROW ids would change with the number of tasks; units of contiguous rows keep both.
    def _saved(self) -> bool:
        fs, p = _fs(self.path)
        return fs.exists(f"{p}/state.json") or fs.exists(f"{p}/dataset_dict.json")

    def _dataset(self):
        """The split to read: memory-mapped (save_to_disk) or streamed (a Hub-layout folder)."""
        import datasets

        if self._saved():
            ds = datasets.load_from_disk(self.path)
            if isinstance(ds, datasets.DatasetDict):
                if self.split not in ds:
                    raise ValueError(f"{self.path}: no split {self.split!r}; it has {', '.join(ds)} (pass --split)")
                ds = ds[self.split]
            return ds
        try:
            return datasets.load_dataset(self.path, split=self.split, streaming=True)
        except ValueError as e:  # "Bad split: ...", with the splits it has
            raise ValueError(f"{self.path}: {e} (pass --split)") from None

    def _rows(self, unit: Any) -> Iterator[tuple[dict, str, Any]]:
        """(row, where, index) of `unit`: index is the row's number in the split (saved) or in its shard."""
        name = os.path.basename(self.path.rstrip("/"))
        ds = self._dataset()
        if self._saved():
            start, end = unit
            for lo in range(start, end, ROWS_PER_BATCH):
                batch = ds[lo:min(end, lo + ROWS_PER_BATCH)]
                for i, values in enumerate(zip(*batch.values())):
                    yield dict(zip(batch, values)), f"{name}/{self.split}", lo + i
            return
        for i, row in enumerate(ds.shard(num_shards=ds.n_shards, index=unit)):
            yield row, f"{name}/{self.split}/{unit:05d}", i


def parse_row(data: dict, where: str, index: Any, text_key: str, id_key: str, url_key: str,
              skipped: list[Item]) -> dict:
    """A row as datatrove's Document fields (text, id, media, metadata: the other fields, `url` among them).
    A row without a string text is appended to `skipped` and given text "", which datatrove's readers drop."""
    data = dict(data)
    doc_id = data.pop(id_key, None)
    doc_id = f"{where}/{index}" if doc_id is None else str(doc_id)
    text = data.pop(text_key, None)
    if url_key != "url" and url_key in data:
        data["url"] = data.pop(url_key)
    if not isinstance(text, str) or not text:
        if text == "":  # as cleanup counts an empty JSONL text
            skipped.append(("skip", doc_id, "empty", "", data.get("url")))
        else:  # as a JSONL line without a string text is malformed
            got = "missing" if text is None else type(text).__name__
            skipped.append(("skip", doc_id, "malformed", f"field {text_key!r} must be a string, got {got}",
                            data.get("url")))
        text = ""
    return {"text": text, "id": doc_id, "media": [], "metadata": data}


def _adapter(text_key: str, id_key: str, url_key: str, skipped: list[Item]):
    """A datatrove reader adapter (reader, data, path, id_in_file) -> Document fields, by parse_row."""
    def adapter(reader, data: dict, path: str, id_in_file: Any) -> dict:
        return parse_row(data, path, id_in_file, text_key, id_key, url_key, skipped)
    return adapter


def _drain(items: list[Item]) -> Iterator[Item]:
    while items:
        yield items.pop(0)


def plain(metadata: dict) -> dict:
    """JSON-safe row fields: a Parquet timestamp or a decimal becomes its str(), as datatrove's writers do."""
    try:
        json.dumps(metadata)
        return metadata
    except (TypeError, ValueError):
        return json.loads(json.dumps(metadata, default=str))


def _suffixes(fmt: str) -> str:
    from data_pipeline.warc import WARC_SUFFIXES

    return ", ".join({"jsonl": JSONL_SUFFIXES, "parquet": (".parquet",), "warc": WARC_SUFFIXES}.get(fmt, ()))
