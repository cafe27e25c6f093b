"""Rebuild the bundled demo corpus `stdlib_docs.jsonl` from the running Python's standard library.

The corpus is real English technical prose that every Python install carries, so the demo needs no
download: the 79 language-reference topics of `pydoc_data.topics` (text of the Python docs), then every
module / class / function docstring of at least MIN_CHARS characters in the pure-Python stdlib, read with
`ast` (nothing is imported or executed), in sorted path order, exact duplicates dropped. Licence: PSF
License Version 2 (LICENSE.txt, copied from the same install). The shipped file was built from CPython
3.11.7: 2,088 records, 1.59 M characters (1.75 MB of JSONL). Run: python data_pipeline/assets/sample/build_sample.py
"""
import ast
import json
import os
import shutil
import sysconfig

MIN_CHARS = 200   # shorter docstrings are mostly one-liners ("Return self.") and add little text
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "tkinter",
             "turtledemo", "ensurepip", "pydoc_data"}   # tests/GUI/vendored code; pydoc_data is read below
HERE = os.path.dirname(os.path.abspath(__file__))


def stdlib_records(root: str):
    """Yield {"text", "source"} records: pydoc topics first, then docstrings in sorted path order."""
    from pydoc_data.topics import topics
    for name in sorted(topics):
        yield {"text": topics[name].strip(), "source": f"pydoc_data.topics:{name}"}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith(("__", "config-")))
        for filename in sorted(f for f in filenames if f.endswith(".py")):
            path = os.path.join(dirpath, filename)
            try:
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError):
                continue
            rel = os.path.relpath(path, root)
            nodes = [tree] + [n for n in ast.walk(tree)
                              if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
            for node in nodes:
                doc = ast.get_docstring(node)
                if doc and len(doc) >= MIN_CHARS:
                    yield {"text": doc, "source": f"{rel}:{getattr(node, 'name', '<module>')}"}


def main() -> int:
    root = sysconfig.get_paths()["stdlib"]
    seen, n, chars = set(), 0, 0
    tmp = os.path.join(HERE, "stdlib_docs.jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        for rec in stdlib_records(root):
            if rec["text"] in seen:
                continue
            seen.add(rec["text"])
            out.write(json.dumps(rec, ensure_ascii=False) + "\n")
            n, chars = n + 1, chars + len(rec["text"])
    os.replace(tmp, os.path.join(HERE, "stdlib_docs.jsonl"))
    shutil.copyfile(os.path.join(root, "LICENSE.txt"), os.path.join(HERE, "LICENSE.txt"))
    print(f"wrote {n:,} records, {chars:,} characters to {HERE}/stdlib_docs.jsonl")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
