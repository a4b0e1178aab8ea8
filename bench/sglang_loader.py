"""The REAL SGLang 0.5.23 code for tests and benches on a CPU-only machine.

SGLang is installed ``--no-deps`` next to CPU torch and a short list of light packages
(``.ci/requirements-sglang.txt``); nothing of SGLang is re-declared here.  Two loading
strategies exist and a process uses exactly one of them, chosen by its first load:

``full``   a plain ``import sglang...``.  Needs CPU torch and the light packages.  The
           only stand-in is a ``torchvision`` import hook (every torchvision wheel is
           CUDA-linked, and SGLang imports it at module level); it installs only when no
           real torchvision is importable.  Everything imports: kv_events, plugins,
           mem_cache.radix_cache, managers.data_parallel_controller, ...
``light``  the two-stub trick: ``sglang`` and ``sglang.srt.utils`` become bare packages so
           their heavy ``__init__`` never runs; ``kv_events`` then imports with msgspec,
           pyzmq, pydantic and psutil alone, without torch, in ~0.3 s.  A light process
           cannot load anything else of SGLang (``SglangUnavailable`` says so): use a
           fresh process (:func:`sglang_bootstrap_code`) for full loads.

``KVPUB_SGLANG_MODE=full|light`` forces the strategy of ``load_kv_events``; by default
it is ``full`` when the full dependencies are installed, else ``light``.

A light process that loads SGLang's plugin system (``load_plugins``) can ask for a
placeholder ``sglang.srt.server_args`` (``prepare("light", server_args_placeholder=True)``):
the real one needs torch, and the plugin's CLI hooks only need a class to target.

This is the only loader of SGLang for tests and benches: the tree-cache fixtures
(``bench/rh_trees.py``), the plugin tests' child scripts and every other child process come
through here (``tests/sglang_real.py`` adds the pytest skip markers on top; a child process
gets both through :func:`sglang_bootstrap_code`).  It lives in bench/ because benches use
it too and a bench never imports the test suite.

RadixCache block hashes come from SGLang's C++ extension, JIT-compiled by torch on
first use (g++, ninja, OpenSSL headers; ~30 s once, then cached in
``$TORCH_EXTENSIONS_DIR``).  SGLang has no Python fallback, so where that toolchain is
missing (or ``KVPUB_SGLANG_HASH=hashlib``) :func:`use_hashlib_native_hash` installs a
``hashlib`` stand-in that gives the same values for plain token pages (checked against
the extension by tests/wire/test_sglang_env.py).

``KVPUB_REQUIRE_SGLANG=1`` (set by ``.ci/run``) turns the skip markers off, so a broken
CI environment fails instead of silently skipping.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import types
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

Mode = Literal["full", "light"]

BENCH_DIR = Path(__file__).resolve().parent
ROOT_DIR = BENCH_DIR.parent
TESTS_DIR = ROOT_DIR / "tests"
SGLANG_VERSION = "0.5.23"
KV_EVENTS = "sglang.srt.disaggregation.kv_events"
RADIX_CACHE = "sglang.srt.mem_cache.radix_cache"
PLUGINS = "sglang.srt.plugins"
DP_CONTROLLER = "sglang.srt.managers.data_parallel_controller"
KV_EVENTS_PUBLISHER = "sglang.srt.managers.scheduler_components.kv_events_publisher"

# Import names (not distribution names) each level needs; see .ci/requirements-sglang.txt.
LIGHT_DEPS = ("sglang", "msgspec", "zmq", "pydantic", "psutil")
FULL_DEPS = (
    *LIGHT_DEPS,
    "torch",
    "triton",
    "numpy",
    "orjson",
    "pybase64",
    "requests",
    "PIL",
    "starlette",
    "IPython",
    "aiohttp",
    "tqdm",
    "packaging",
)
RADIX_DEPS = (*FULL_DEPS, "transformers", "dill", "tvm_ffi", "sentencepiece", "compressed_tensors", "gguf")
MANAGER_DEPS = (*RADIX_DEPS, "openai", "setproctitle", "partial_json_parser", "einops", "uvicorn", "fastapi")

_STUB_FLAG = "__kvpub_light_stub__"
_ENV_MODE = "KVPUB_SGLANG_MODE"
_ENV_HASH = "KVPUB_SGLANG_HASH"
_ENV_REQUIRE = "KVPUB_REQUIRE_SGLANG"


class SglangUnavailable(RuntimeError):
    """The real SGLang code cannot load in this process; the message says exactly why."""


# --------------------------------------------------------------------------- checks


def missing_modules(names: Sequence[str]) -> list[str]:
    """Top-level import names from ``names`` that are not installed (nothing is imported)."""
    missing = []
    for name in names:
        if name in sys.modules:
            continue
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except (ImportError, ValueError):
            missing.append(name)
    return missing


def current_mode() -> Mode | None:
    """The strategy this process already committed to, or None before any load."""
    module = sys.modules.get("sglang")
    if module is None:
        return None
    return "light" if getattr(module, _STUB_FLAG, False) else "full"


def native_hash_toolchain_missing() -> list[str]:
    """What the JIT build of SGLang's hash extension needs and this machine lacks."""
    missing = []
    if not (shutil.which("g++") or shutil.which("c++")):
        missing.append("g++")
    if not shutil.which("ninja") and importlib.util.find_spec("ninja") is None:
        missing.append("ninja")
    include_dirs = [Path(sys.prefix) / "include", Path("/usr/include"), Path("/usr/local/include")]
    if not any((d / "openssl" / "sha.h").exists() for d in include_dirs):
        missing.append("OpenSSL headers (openssl/sha.h)")
    return missing


def _skip_reason(deps: Sequence[str], what: str) -> str:
    missing = missing_modules(deps)
    if not missing:
        return ""
    names = ", ".join(missing)
    return f"real SGLang {what} cannot load: missing Python modules {names} (see .ci/requirements-sglang.txt)"


# --------------------------------------------------------------------------- torchvision


# The stub lives beside the CPU stand-ins: the real-server tier's sitecustomize loads the same
# module in server processes.
from bench.cpu_shims.torchvision_stub import install_torchvision_stub  # noqa: E402

# --------------------------------------------------------------------------- strategies


def _sglang_dir() -> Path:
    spec = importlib.util.find_spec("sglang")  # locates the package without running __init__
    if spec is None or spec.origin is None:
        raise SglangUnavailable(f"sglang is not installed (pip install --no-deps sglang=={SGLANG_VERSION})")
    return Path(spec.origin).parent


def _install_light_stubs() -> None:
    root = _sglang_dir()
    for name, sub in (("sglang", root), ("sglang.srt.utils", root / "srt" / "utils")):
        module = types.ModuleType(name)
        module.__path__ = [str(sub)]
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__spec__.submodule_search_locations = [str(sub)]
        setattr(module, _STUB_FLAG, True)
        sys.modules[name] = module


class _PlaceholderServerArgs:
    """Stands for ``ServerArgs`` in light processes that never parse arguments."""

    @staticmethod
    def add_cli_args(parser: Any) -> None:
        raise AssertionError("placeholder: argument parsing is not part of this test")

    @classmethod
    def from_cli_args(cls, args: Any) -> Any:
        raise AssertionError("placeholder: argument parsing is not part of this test")

    def check_server_args(self) -> None:
        raise AssertionError("placeholder: argument checking is not part of this test")


def _install_server_args_placeholder() -> None:
    module = types.ModuleType("sglang.srt.server_args")
    module.ServerArgs = _PlaceholderServerArgs  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module


def prepare(mode: Mode, server_args_placeholder: bool = False) -> None:
    """Sets this process up for ``mode`` without importing SGLang itself (cheap).
    ``server_args_placeholder`` (light only) stands in for ``sglang.srt.server_args``."""
    if server_args_placeholder and mode != "light":
        raise ValueError("the server_args placeholder exists for light mode only")
    committed = current_mode()
    if committed is not None and committed != mode:
        raise SglangUnavailable(
            f"this process already loaded SGLang in {committed!r} mode; {mode!r} needs a fresh process "
            "(use sglang_bootstrap_code() in a subprocess)"
        )
    if mode == "light":
        missing = missing_modules(LIGHT_DEPS)
        if missing:
            raise SglangUnavailable(f"light mode needs {', '.join(missing)}")
        if committed is None:
            _install_light_stubs()
        if server_args_placeholder:
            _install_server_args_placeholder()
        return
    missing = missing_modules(FULL_DEPS)
    if missing:
        raise SglangUnavailable(f"full SGLang import needs {', '.join(missing)} (see .ci/requirements-sglang.txt)")
    install_torchvision_stub()


def default_mode() -> Mode:
    forced = os.environ.get(_ENV_MODE, "")
    if forced in ("full", "light"):
        return forced  # type: ignore[return-value]
    committed = current_mode()
    if committed is not None:
        return committed
    return "full" if not missing_modules(FULL_DEPS) else "light"


def load_module(name: str, deps: Sequence[str] = MANAGER_DEPS) -> types.ModuleType:
    """Any SGLang module through the full strategy; raises SglangUnavailable with the blocker."""
    if current_mode() == "light":
        raise SglangUnavailable(
            f"{name} needs the full SGLang import, but this process used the light two-stub trick "
            "(kv_events only); load it in a fresh process"
        )
    missing = missing_modules(deps)
    if missing:
        raise SglangUnavailable(f"{name} needs {', '.join(missing)} (see .ci/requirements-sglang.txt)")
    prepare("full")
    return importlib.import_module(name)


def load_kv_events(mode: Mode | None = None) -> types.ModuleType:
    """``sglang.srt.disaggregation.kv_events``: ZmqEventPublisher, EventPublisherFactory, ..."""
    chosen = mode or default_mode()
    if chosen == "full":
        return load_module(KV_EVENTS, FULL_DEPS)
    prepare("light")
    return importlib.import_module(KV_EVENTS)


# --------------------------------------------------------------------------- radix cache


class _CpuAllocator:
    """The allocator surface RadixCache touches when it owns no real KV pool."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed_tokens = 0

    def free_segment(self, indices: Any, start_pos: int = 0) -> None:
        self.freed_tokens += len(indices)

    def free(self, indices: Any) -> None:
        self.freed_tokens += len(indices)


@dataclasses.dataclass(frozen=True)
class RadixApi:
    """The real classes, plus small conveniences for driving a simulated cache."""

    RadixCache: Any
    RadixKey: Any
    InsertParams: Any
    EvictParams: Any
    MatchPrefixParams: Any
    hash_impl: str  # "native" (SGLang's JIT extension) or "hashlib" (the stand-in)

    def simulated(self, page_size: int, enable_kv_cache_events: bool = True) -> Any:
        return self.RadixCache.create_simulated(
            page_size=page_size, enable_kv_cache_events=enable_kv_cache_events, mock_allocator=_CpuAllocator()
        )

    def insert(self, cache: Any, token_ids: Sequence[int]) -> int:
        """Inserts a page-aligned prefix of ``token_ids``; returns the length already cached."""
        result = cache.insert(self.InsertParams(key=self.RadixKey(array("q", token_ids))))
        return int(result.prefix_len)

    def match(self, cache: Any, token_ids: Sequence[int]) -> int:
        result = cache.match_prefix(self.MatchPrefixParams(key=self.RadixKey(array("q", token_ids))))
        return int(result.device_prefix_len)

    def evict(self, cache: Any, num_tokens: int) -> int:
        return int(cache.evict(self.EvictParams(num_tokens=num_tokens)).num_tokens_evicted)


def hashlib_page_hashes(token_ids: Sequence[int], prior_digest: bytes | None, page_size: int | None) -> str | list[str]:
    """SGLang's page hash from its documented definition: per page, SHA-256 over the previous
    page's digest (if any) then the page's token ids as little-endian u32; hex digests.
    ``page_size=None`` hashes all tokens as one page and returns one hex string."""
    tokens = list(token_ids)
    if any(t < 0 or t > 0xFFFFFFFF for t in tokens):
        raise NotImplementedError("hashlib stand-in covers u32 token ids only")
    size = page_size or max(len(tokens), 1)
    digests: list[str] = []
    prior = prior_digest
    for start in range(0, len(tokens), size):
        sha = hashlib.sha256()
        if prior is not None:
            sha.update(prior)
        sha.update(array("I", tokens[start : start + size]).tobytes())
        prior = sha.digest()
        digests.append(sha.hexdigest())
    if page_size is None:
        return digests[0] if digests else hashlib.sha256(prior_digest or b"").hexdigest()
    return digests


class _HashlibNativeModule:
    """Duck-types the compiled ``hicache_hash_cpp`` module (only ``get_hash``)."""

    def get_hash(
        self,
        raw: Any,
        logical_len: int,
        unit_width: int,
        is_bigram: bool,
        prior_digest: bytes | None,
        page_size: int | None = None,
    ) -> str | list[str]:
        if is_bigram or unit_width != 1:
            raise NotImplementedError("hashlib stand-in covers plain (non-EAGLE) token pages only")
        return hashlib_page_hashes(list(raw[:logical_len]), prior_digest, page_size)


def use_hashlib_native_hash() -> None:
    """Replaces SGLang's JIT hash loader with the hashlib stand-in in this process."""
    native = load_module("sglang.srt.mem_cache.cpp_utils.native_hash", FULL_DEPS)
    native._load_native_hash_module = lambda: _HashlibNativeModule()  # type: ignore[attr-defined]


def _hash_impl() -> str:
    forced = os.environ.get(_ENV_HASH, "")
    if forced in ("native", "hashlib"):
        return forced
    return "native" if not native_hash_toolchain_missing() else "hashlib"


def load_radix_cache() -> RadixApi:
    """The real ``RadixCache`` (CPU torch), with its base-prefix-cache parameter classes."""
    radix = load_module(RADIX_CACHE, RADIX_DEPS)
    base = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
    impl = _hash_impl()
    if impl == "hashlib":
        use_hashlib_native_hash()
    return RadixApi(
        RadixCache=radix.RadixCache,
        RadixKey=radix.RadixKey,
        InsertParams=base.InsertParams,
        EvictParams=base.EvictParams,
        MatchPrefixParams=base.MatchPrefixParams,
        hash_impl=impl,
    )


# --------------------------------------------------------------------------- plugins and managers


def load_plugins_module() -> types.ModuleType:
    """``sglang.srt.plugins`` (load_plugins, HookRegistry, HookType, plugin_hook), after
    importing the modules other helpers hook: the DP controller and the scheduler's
    KV-events publisher component."""
    plugins = load_module(PLUGINS, FULL_DEPS)
    load_module(KV_EVENTS_PUBLISHER)
    load_module(DP_CONTROLLER)
    return plugins


def probe_modules(names: Sequence[str]) -> dict[str, str]:
    """``{module: "ok" | "ExcType: message [file:line]"}`` (for reports, in a fresh process)."""
    import traceback

    results: dict[str, str] = {}
    for name in names:
        try:
            load_module(name)
            results[name] = "ok"
        except BaseException as exc:  # a probe reports every failure
            frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
            where = f" [{frame.filename.split('site-packages/')[-1]}:{frame.lineno}]" if frame else ""
            results[name] = f"{type(exc).__name__}: {exc}{where}"
    return results


# --------------------------------------------------------------------------- child processes


def sglang_bootstrap_code(
    mode: Mode = "light", hash_impl: str | None = None, server_args_placeholder: bool = False
) -> str:
    """Python source a child process runs first to get this module's environment, e.g.
    ``subprocess.run([sys.executable, "-c", sglang_bootstrap_code("light") + body])``.
    Afterwards ``sglang_real`` is importable and ``load_kv_events()`` uses ``mode``."""
    lines = [
        "import os as _os, sys as _sys",
        f"_sys.path[:0] = [{str(TESTS_DIR)!r}, {str(ROOT_DIR)!r}]",
        f"_os.environ[{_ENV_MODE!r}] = {mode!r}",
    ]
    if hash_impl:
        lines.append(f"_os.environ[{_ENV_HASH!r}] = {hash_impl!r}")
    lines += ["import sglang_real", f"sglang_real.prepare({mode!r}, {server_args_placeholder!r})", ""]
    return "\n".join(lines)


def child_env(mode: Mode = "light", base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a child that does ``import sglang_real`` itself (PYTHONPATH + mode)."""
    env = dict(os.environ if base is None else base)
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS_DIR), str(ROOT_DIR), path) if p)
    env[_ENV_MODE] = mode
    return env


if __name__ == "__main__":  # python bench/sglang_loader.py: which SGLang modules import here
    import json

    names = sys.argv[1:] or [KV_EVENTS, PLUGINS, RADIX_CACHE, KV_EVENTS_PUBLISHER, DP_CONTROLLER]
    print(json.dumps(probe_modules(names), indent=1))
