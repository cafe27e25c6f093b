"""optim/op_build.py: whether a load of a JIT op will compile, and the two lines around a build, from rank 0."""
import os

import pytest

from zerogpt.optim import op_build


@pytest.fixture
def ext_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    source = tmp_path / "op.cpp"
    source.write_text("// source")
    return tmp_path / "ext" / "my_op", str(source)


def test_a_build_is_due_without_a_library_or_with_a_newer_source(ext_dir):
    folder, source = ext_dir
    assert op_build.extension_dir("my_op") == str(folder)
    assert op_build.needs_build("my_op", [source])
    folder.mkdir(parents=True)
    library = folder / "my_op.so"
    library.write_bytes(b"")
    os.utime(source, (1_000, 1_000))
    assert not op_build.needs_build("my_op", [source])
    os.utime(library, (500, 500))                    # the source changed since the build
    assert op_build.needs_build("my_op", [source])


def test_a_build_says_so_before_and_after_and_a_cached_load_says_nothing(ext_dir, capsys, monkeypatch):
    folder, source = ext_dir
    monkeypatch.setitem(op_build.BUILD_SECONDS, "the test op", 7)
    monkeypatch.setenv("RANK", "0")
    with op_build.announced_build("the test op", "my_op", [source]):
        print("compiling")
        folder.mkdir(parents=True)
        (folder / "my_op.so").write_bytes(b"")
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [f"building the test op into {folder} (first run only, about 7 s)", "compiling"]
    assert len(lines) == 3 and lines[2].startswith("built the test op in ") and lines[2].endswith(" s")
    with op_build.announced_build("the test op", "my_op", [source]):
        pass
    assert capsys.readouterr().out == ""


def test_only_rank_0_announces(ext_dir, capsys, monkeypatch):
    _, source = ext_dir
    monkeypatch.setenv("RANK", "1")
    with op_build.announced_build(op_build.HOST_ADAM, "my_op", [source]):
        pass
    assert capsys.readouterr() == ("", "")
