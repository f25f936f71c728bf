"""A kernel library damaged in the cache is built again, never loaded (compile/codegen/cpp_build.py).

A new user's trial (2026-12-07) garbled the cached libraries: a run crashed (a segmentation fault, on
every run until the cache was deleted), or loaded its graphs from the graph cache and trained to wrong
losses (1.03 against eager's 4.91) without a word; emptied ones were never rebuilt, so every later run
compiled afresh and ran attention in ATen."""

from __future__ import annotations

import pytest
import torch

from accelrun.compile.codegen import cpp_build
from accelrun.compile.codegen.cpp_build import (
    build_and_load,
    build_library,
    checksum_path,
    compiler_invocations,
)

SOURCE = 'extern "C" int answer() { return 42; }\n'


def _garble(library) -> None:
    """Flip bytes past the ELF header: the file still looks like a shared library. (Written as a new file:
    this process may have the old one mapped, and changing a mapped file's pages crashes it.)"""
    data = bytearray(library.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0x5A
    garbled = library.with_name("garbled")
    garbled.write_bytes(bytes(data))
    garbled.replace(library)


@pytest.fixture
def fresh_process(monkeypatch):
    monkeypatch.setattr(cpp_build, "_loaded", {})  # nothing loaded yet, as in a new process
    monkeypatch.setattr(cpp_build, "_sound", set())  # nor checked


def test_a_garbled_library_is_built_again(tmp_path, fresh_process):
    library = build_library(SOURCE, tmp_path)
    assert checksum_path(library).is_file()
    _garble(library)
    with pytest.raises(OSError, match="differs from the checksum written beside it"):
        cpp_build.load_library(library)
    built = compiler_invocations()
    with pytest.warns(UserWarning, match="differs from the checksum written beside it when it was built; building"):
        lib = build_and_load(SOURCE, tmp_path)
    assert compiler_invocations() == built + 1 and lib.answer() == 42
    assert cpp_build.damage(library) is None


@pytest.mark.parametrize("cut", [0, 200])  # emptied; cut short after its header
def test_a_library_cached_before_checksums_that_will_not_load_is_built_again(tmp_path, fresh_process, cut):
    library = build_library(SOURCE, tmp_path)
    checksum_path(library).unlink()  # as libraries were cached before
    short = library.with_name("short")
    short.write_bytes(library.read_bytes()[:cut])
    short.replace(library)
    built = compiler_invocations()
    with pytest.warns(UserWarning, match="building it again"):
        lib = build_and_load(SOURCE, tmp_path)
    assert compiler_invocations() == built + 1 and lib.answer() == 42
    assert checksum_path(library).is_file()


def test_a_graph_cache_entry_whose_kernels_were_garbled_is_compiled_afresh(tmp_path, fresh_process):
    from tests.compile.test_graph_cache import COMPILED, assert_close, step

    first = step(*COMPILED)
    libraries = list((tmp_path / "cache" / "compile" / "cpp").glob("*.so"))
    assert libraries
    for library in libraries:
        _garble(library)
    cpp_build._loaded.clear()
    torch._dynamo.reset()
    # In a new process: this one's dynamic loader would hand back the libraries it mapped before (by
    # path), so only a new process runs the rebuilt ones' code.
    again = _step_in_a_new_process(tmp_path)
    stats = again[2]["graph_cache"]
    assert stats["loaded"] == 0 and stats["compiled"] == 2, stats
    assert any("differs from the checksum" in e for e in stats["errors"]), stats["errors"]
    assert again[2]["cache_misses"] > 0  # g++ built them again
    assert "building it again" in again[2]["warnings"]
    assert_close(again, first, rel=1e-7)
    torch._dynamo.reset()
    cpp_build._loaded.clear()
    third = step(*COMPILED)  # and the entries saved again load
    assert third[2].graph_cache["loaded"] == 2, third[2].graph_cache
    assert_close(third, first, rel=1e-7)


def _step_in_a_new_process(tmp_path):
    """``step(*COMPILED)`` in a new Python process on this test's cache: (loss, grads, what it recorded)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "step.pt"
    code = ("import sys, warnings, torch\n"
            "torch.set_num_threads(int(sys.argv[2]))  # this process's: the graph cache keys entries by it\n"
            "from tests.compile.test_graph_cache import COMPILED, step\n"
            "with warnings.catch_warnings(record=True) as said:\n"
            "    warnings.simplefilter('always')\n"
            "    loss, grads, record = step(*COMPILED)\n"
            "torch.save((loss, grads, {'graph_cache': record.graph_cache, 'cache_misses': record.cache_misses,\n"
            "            'warnings': ' '.join(str(w.message) for w in said)}), sys.argv[1])\n")
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code, str(out), str(torch.get_num_threads())], cwd=root, check=True,
                   timeout=600,
                   env={**os.environ, "ACCELRUN_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(root)})
    return torch.load(out, weights_only=False)


def test_a_cache_moved_elsewhere_loads_its_own_kernels(tmp_path, monkeypatch, fresh_process):
    """Entries name their kernels by the paths they were saved under: a moved cache (or a shared one
    mounted at another path) finds them in its own folder."""
    from tests.compile.test_graph_cache import COMPILED, assert_close, step

    first = step(*COMPILED)
    (tmp_path / "cache").rename(tmp_path / "moved")
    monkeypatch.setenv("ACCELRUN_CACHE_DIR", str(tmp_path / "moved"))
    cpp_build._loaded.clear()
    torch._dynamo.reset()
    again = step(*COMPILED)
    stats = again[2].graph_cache
    assert stats["loaded"] == 2 and stats["compiled"] == 0 and not stats["errors"], stats
    assert all(path.startswith(str(tmp_path / "moved")) for path in cpp_build._loaded), list(cpp_build._loaded)
    assert_close(again, first, rel=1e-7)


def test_a_cache_that_cannot_be_written_builds_in_a_folder_of_the_process(tmp_path, fresh_process, monkeypatch):
    """A read-only ACCELRUN_CACHE_DIR, or one naming a file: every region went to ATen, slower than eager
    (a new user's trial). Built in a folder of the process's own instead, said once."""
    monkeypatch.setattr(cpp_build, "_scratch", None)
    (tmp_path / "a-file").write_text("")
    with pytest.warns(UserWarning, match=r"cannot be written \(NotADirectoryError: Not a directory\): C\+\+ kernels are "
                                         "built in .* for this process"):
        lib = build_and_load(SOURCE, tmp_path / "a-file" / "cpp")
    assert lib.answer() == 42
    built = compiler_invocations()
    assert build_and_load(SOURCE, tmp_path / "a-file" / "cpp").answer() == 42
    assert compiler_invocations() == built  # once a process


def test_a_library_the_loader_refuses_for_its_own_reasons_is_not_built_again(tmp_path, fresh_process, monkeypatch):
    """A missing dependency or no memory is the loader's trouble, not the file's: the sound library stays
    (a review: it was deleted from a shared cache, and every process ran g++ to fail the same way)."""
    library = build_library(SOURCE, tmp_path)

    def refuse(path, *args, **kwargs):
        raise OSError("libc10.so: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(cpp_build.ctypes, "CDLL", refuse)
    built = compiler_invocations()
    with pytest.raises(OSError, match="libc10.so"):
        build_and_load(SOURCE, tmp_path)
    assert compiler_invocations() == built and library.is_file()


def test_no_entry_is_saved_whose_kernels_the_process_built_outside_the_cache(tmp_path, fresh_process, monkeypatch):
    """The kernel cache cannot be written but the graph cache can (a review): entries were saved naming
    kernels in the process's own folder, gone at its end, so every later process compiled again."""
    from tests.compile.test_graph_cache import COMPILED, assert_close, step

    monkeypatch.setattr(cpp_build, "_scratch", None)
    (tmp_path / "cache" / "compile").mkdir(parents=True)
    (tmp_path / "cache" / "compile" / "cpp").write_text("")  # a file where the kernels' folder should be
    with pytest.warns(UserWarning, match="cannot be written"):
        first = step(*COMPILED)
    stats = first[2].graph_cache
    assert stats["compiled"] == 2 and stats["saved"] == 0, stats
    assert any("not saved: its kernels could not be written into" in e for e in stats["errors"]), stats["errors"]
    assert first[2].cache_misses > 0 and cpp_build.scratch_folder() is not None  # built, in the scratch folder
    assert not list((tmp_path / "cache" / "compile" / "graphs").rglob("*.pt"))
    # Once the kernel cache can be written, entries are saved and load.
    (tmp_path / "cache" / "compile" / "cpp").unlink()
    monkeypatch.setattr(cpp_build, "_scratch", None)
    torch._dynamo.reset()
    cpp_build._loaded.clear()
    second = step(*COMPILED)
    assert second[2].graph_cache["saved"] == 2, second[2].graph_cache
    torch._dynamo.reset()
    cpp_build._loaded.clear()
    third = step(*COMPILED)
    assert third[2].graph_cache["loaded"] == 2, third[2].graph_cache
    assert_close(third, first, rel=1e-7)


def test_a_failed_build_says_the_compilers_error_and_a_graph_naming_its_library_says_so(tmp_path, fresh_process,
                                                                                       monkeypatch):
    """A compiler engineer's trial (a compiler that fails every build): the fallback's reason stopped at
    "g++ failed on generated code:", and the next process, missing the library a saved graph named, said it
    was "not in the kernel cache (removed, or still being built by another process ...)"."""
    from accelrun.compile.codegen.cached_files import found

    fake = tmp_path / "badcxx"
    fixed = tmp_path / "fixed"  # once it exists, the compiler is g++ again (the same version: the same key)
    fake.write_text(f'#!/bin/sh\nif [ "$1" = "--version" ] || [ -e {fixed} ]; then exec g++ "$@"; fi\n'
                    'echo "In file included from /src/error_handling/x.cpp:1:" >&2\n'  # "error" in a path: not it
                    'echo "x.cpp:3:1: error: expected declaration" >&2; exit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("ACCELRUN_CXX", str(fake))
    with pytest.raises(RuntimeError) as raised:
        build_library(SOURCE, tmp_path / "cpp")
    assert str(raised.value).splitlines()[0] == \
        "g++ failed on generated code: x.cpp:3:1: error: expected declaration"
    library = cpp_build.library_path(SOURCE, tmp_path / "cpp")
    with pytest.raises(FileNotFoundError, match=r"was never built: its build failed when the graph was saved "
                                                r"\(x.cpp:3:1: error: expected declaration\)"):
        found(str(library), "compiled region")
    assert cpp_build.failure_path(library).is_file()
    fixed.touch()
    assert build_library(SOURCE, tmp_path / "cpp") == library  # a build that succeeds clears its failure
    assert not cpp_build.failure_path(library).exists()
