"""Compiling generated C++ into a shared library once, and finding it again in the on-disk cache.

The cache key is a sha256 of exactly what changes the binary: the source, the compiler's version
line, the flags, and the CPU's feature flags (``-march=native`` makes code for this CPU only).
Writes go to a temporary file renamed into place (``os.replace`` is atomic), so processes sharing a
cache directory never load a half-written library. Beside each library is its sha256 (``<key>.so.sha256``),
checked before it is first loaded in a process: a library damaged on disk is built again rather than
loaded (a new user's trial: a garbled one crashed every run, or trained to wrong losses from the graph
cache without a word; an emptied one was never rebuilt). ``compiler_invocations()`` counts g++ runs in
this process, so a test can check that a warm cache builds nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

# -fno-math-errno and -fno-trapping-math let g++ vectorize sqrt and floor (used by acc_exp); nothing
# here reads errno or floating-point exception flags. g++ keeps to 256-bit vectors on AVX-512 CPUs
# unless told otherwise; 512-bit ones made exp-heavy rows (softmax, cross-entropy) 15-25% faster
# (no effect on CPUs without AVX-512). -O2 compiled no faster for regions this size and ran slower.
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
         "-fno-math-errno", "-fno-trapping-math")
LATER_NICENESS = 10  # build_library(needed_later=True): about a tenth of a core's share beside busy ones
_invocations = 0
_loaded: dict[str, ctypes.CDLL] = {}
ELF_MAGIC = b"\x7fELF"


def compiler_invocations() -> int:
    return _invocations


def find_compiler() -> str | None:
    """``$ACCELRUN_CXX`` if set (an empty value means none), else ``g++`` on the PATH."""
    if "ACCELRUN_CXX" in os.environ:
        return shutil.which(os.environ["ACCELRUN_CXX"]) if os.environ["ACCELRUN_CXX"] else None
    return shutil.which("g++")


@functools.lru_cache(maxsize=8)
def compiler_version(cxx: str) -> str:
    """Its ``--version``'s first line (part of each library's key). A compiler that cannot say (a wrapper,
    ``ACCELRUN_CXX=false``) is named by its path: its builds then fail, or not, as builds; a traceback
    from here stopped the run before any executor could fall back."""
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        return f"{cxx} (--version failed: {type(e).__name__})"
    return out.stdout.splitlines()[0] if out.stdout else cxx


@functools.lru_cache(maxsize=1)
def cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    wanted = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return hashlib.sha256("\n".join(wanted).encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    root = os.environ.get("ACCELRUN_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "accelrun"
    return base / "compile" / "cpp"


def library_path(source: str, cache_dir: str | os.PathLike | None = None, link: tuple[str, ...] = ()) -> Path:
    """Where the library built from ``source`` (and linked with ``link``'s flags) lives, or will, in the cache."""
    cxx = find_compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler: g++ is not on the PATH (or ACCELRUN_CXX names none)")
    key_text = "\n".join([source, compiler_version(cxx), " ".join(FLAGS + link), cpu_signature()])
    key = hashlib.sha256(key_text.encode()).hexdigest()
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return directory / f"{key}.so"


def is_cached(source: str, cache_dir: str | os.PathLike | None = None) -> bool:
    """Whether the library of ``source`` is in the cache and sound (``build_library`` will not run g++)."""
    path = library_path(source, cache_dir)
    return path.exists() and damage(path) is None


def build_library(source: str, cache_dir: str | os.PathLike | None = None, link: tuple[str, ...] = (),
                  needed_later: bool = False, again: bool = False) -> Path:  # fmt: skip
    """Path of the shared library built from ``source``, compiling only on a cache miss. ``link``: flags
    after the source (include and library paths, ``-l...``), part of the cache key. ``needed_later``: g++
    runs at a lower CPU priority (``nice``), yielding the cores to the step and to the builds whose
    code runs first (a backward graph's regions run after the whole forward: the debug Llama's cold
    first step: a median of 1.94 s against 2.04, 4 runs each on 2 cores). ``again``: built even if cached
    (one the loader found damaged), replacing it."""
    global _invocations
    target = library_path(source, cache_dir, link)
    directory, key, cxx = target.parent, target.stem, find_compiler()
    assert cxx is not None
    if target.exists() and not again:
        if (why := damage(target)) is None:
            return target
        warnings.warn(f"accelrun: the kernel library {target} {why}; building it again", stacklevel=2)
    if (unwritable := _unwritable(directory)) is not None:
        directory = _scratch_directory(directory, unwritable)
        target = directory / target.name
        if target.exists() and not again:  # built earlier in this process
            return target
    with tempfile.TemporaryDirectory(dir=directory, prefix=".build-") as tmp:
        src = Path(tmp) / f"{key}.cpp"
        src.write_text(source)
        built = Path(tmp) / f"{key}.so"
        _invocations += 1
        command = [cxx, *FLAGS, str(src), "-o", str(built), *link]
        if needed_later and (nice := shutil.which("nice")):
            command = [nice, "-n", str(LATER_NICENESS), *command]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            said = compiler_error_line(proc.stderr, proc.returncode)
            # Beside where the library would be: a graph saved before its build ended names that library,
            # and a later process that misses it says why (not "removed from the cache").
            with contextlib.suppress(OSError):
                failure_path(target).write_text(said + "\n")
            # The first line is what fallbacks and reports show (one line); the rest for --debug readers.
            raise RuntimeError(f"g++ failed on generated code: {said}\n{proc.stderr[-4000:]}")
        failure_path(target).unlink(missing_ok=True)
        os.replace(src, directory / f"{key}.cpp")  # kept for reading; harmless if another process won
        # The checksum first: a process that finds the library finds its checksum. (Two processes building
        # at once may leave one's checksum beside the other's library: the next finds it "damaged" and
        # builds it again, once.)
        checksum = Path(tmp) / "sha256"
        checksum.write_text(_sha256(built))
        os.replace(checksum, checksum_path(target))
        os.replace(built, target)
    return target


def _unwritable(directory: Path) -> str | None:
    """Why libraries cannot be written into ``directory`` (a read-only file system, a file where the folder
    should be, no permission), or None."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    return None if os.access(directory, os.W_OK | os.X_OK) else "no permission to write into it"


_scratch: Path | None = None
_scratch_lock = threading.Lock()  # (kernels are built from background threads too)


def _scratch_directory(cache: Path, why: str) -> Path:
    """A folder of this process's own for the libraries a cache that cannot be written would have held:
    built and loaded as they would be, then removed at exit. An unwritable cache turned every region over
    to ATen, slower than eager (a new user's trial, a read-only ``ACCELRUN_CACHE_DIR``)."""
    global _scratch
    with _scratch_lock:
        if _scratch is None:
            import atexit

            _scratch = Path(tempfile.mkdtemp(prefix="accelrun-kernels-"))
            atexit.register(shutil.rmtree, _scratch, ignore_errors=True)
            warnings.warn(f"accelrun: the kernel cache {cache} cannot be written ({why}): C++ kernels are built in "
                          f"{_scratch} for this process, and built again by the next (ACCELRUN_CACHE_DIR or "
                          "compile.cache_dir names another cache)", stacklevel=3)
        return _scratch


def compiler_error_line(stderr: str, returncode: int) -> str:
    """The line of a compiler's output that says what failed: its first error, else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    first_error = next((line for line in lines if _ERROR_LINE.search(line)), None)
    return first_error or (lines[-1] if lines else f"exit status {returncode}, nothing printed")


_ERROR_LINE = re.compile(r"\b(fatal )?error\b:", re.IGNORECASE)  # (not a path or a name holding "error")


def failure_path(library: Path) -> Path:
    """Where a failed build of ``library`` leaves its compiler's error line."""
    return library.with_name(library.name + ".failed")


def scratch_folder() -> Path | None:
    """Where this process builds its kernels when the cache cannot be written (None until it has to)."""
    return _scratch


def checksum_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


_sound: set[tuple[str, int, int, int]] = set()  # (path, inode, size, mtime) of libraries found sound


def damage(library: Path) -> str | None:
    """Why the cached ``library`` must not be loaded, in words, or None: its contents differ from the
    checksum written beside it, or (a library cached before there were checksums: only this is checked)
    it is no shared library. Each version of a file is read once a process."""
    try:
        st = library.stat()
        if (version := (str(library), st.st_ino, st.st_size, st.st_mtime_ns)) in _sound:
            return None
        with open(library, "rb") as f:
            head = f.read(4)
        side = checksum_path(library)
        recorded = side.read_text().strip() if side.exists() else None
        if recorded is not None and _sha256(library) != recorded:
            return "differs from the checksum written beside it when it was built"
    except OSError as e:
        return f"cannot be read ({type(e).__name__}: {e.strerror or e})"
    if recorded is None and head != ELF_MAGIC:
        return f"is no shared library ({st.st_size} bytes, not an ELF file)"
    _sound.add(version)
    return None


def load_library(path: Path) -> ctypes.CDLL:
    """The library at ``path``, loaded once per process and checked (``damage``) before: OSError if damaged."""
    key = str(path)
    if key not in _loaded:
        if (why := damage(path)) is not None:
            raise OSError(f"the kernel library {path} {why}")
        _loaded[key] = ctypes.CDLL(key)
    return _loaded[key]


def build_and_load(source: str, cache_dir: str | os.PathLike | None = None, link: tuple[str, ...] = (),
                   needed_later: bool = False) -> ctypes.CDLL:  # fmt: skip
    """``load_library(build_library(...))``, building once more a cached library the loader refuses (one
    cached before there were checksums, cut short or garbled after its header)."""
    path = build_library(source, cache_dir, link, needed_later)
    try:
        return load_library(path)
    except OSError as e:
        if not _BAD_FILE.search(str(e)):  # the loader's own trouble (a missing library, memory): not the file's
            raise
        warnings.warn(f"accelrun: the kernel library {path} could not be loaded ({e}); building it again",
                      stacklevel=2)
        return load_library(build_library(source, cache_dir, link, needed_later, again=True))


# The loader's words for a file that is not a whole shared library (cut short, garbled after its header).
_BAD_FILE = re.compile(r"file too short|invalid ELF header|ELF load command|ELF file|cannot read file data|"
                       r"differs from the checksum|is no shared library")
