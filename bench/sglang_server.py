"""A real ``python -m sglang.launch_server`` on this machine, for the server test tier and benches.

Reusable by tests (``tests/server/``) and by ``bench/`` alike: standard library, pyzmq,
``tokenizers`` and :mod:`sglang_kvpub.tools.ports` only; it imports nothing from ``tests/``
(a development helper, not product: it launches dummy-weight models).  What it does:

- :func:`make_model_dir`: a tiny dummy-weight Llama (``config.json``) and an offline
  byte-level BPE tokenizer trained with ``tokenizers`` on a built-in text; no hub access.
- :class:`ServerSpec` / :class:`Server`: the real launcher in its own process group, with or
  without ``--plugin sglang_kvpub``, the radix tree core chosen by
  ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND`` (``rust`` or ``python``), free loopback ports,
  readiness by polling ``/health`` and ``/server_info`` (with a deadline, failing early when
  the process dies), the whole log in a file, teardown of the whole process group (SIGTERM,
  then SIGKILL), and the log tail in every failure message.
- ``shim_dir``: a directory put first on the server's PYTHONPATH.  On a CPU-only machine
  the tests' ``bench/cpu_shims`` (see its README: no CPU build of ``sgl_kernel`` and no
  CPU torchvision exist on the index) - :func:`cpu_shim_dir` finds it in a checkout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sglang_kvpub.tools.ports import free_port_block

__all__ = [
    "REPO",
    "SERVER_MODULES",
    "TOPIC",
    "ServerError",
    "ServerSpec",
    "Server",
    "cpu_shim_dir",
    "free_port_block",
    "make_model_dir",
    "prompt_ids",
]

REPO = Path(__file__).resolve().parents[1]
# What `python -m sglang.launch_server` imports beyond the real-SGLang test deps
# (.ci/requirements-server.txt); without them the server tiers are skipped, failed in CI.
SERVER_MODULES = ("sglang", "torch", "triton", "jsonschema", "xgrammar", "soundfile", "multipart", "tokenizers")
TOPIC = "kv"
VOCAB = 512


class ServerError(RuntimeError):
    """The server did not start or answer; the message ends with its log tail."""


def cpu_shim_dir() -> Path | None:
    """``bench/cpu_shims`` of this checkout (CPU stand-ins), or None outside a checkout."""
    path = REPO / "bench" / "cpu_shims"
    return path if path.is_dir() else None


# --------------------------------------------------------------------------- model


_CORPUS = (
    "the quick brown fox jumps over the lazy dog. a prefix cache keeps the keys and values of "
    "tokens it has seen, so a repeated prompt is served from memory. data parallel ranks each "
    "hold their own cache; a router that knows which rank holds a prefix sends it there. "
)


def make_model_dir(
    path: Path, *, layers: int = 2, hidden: int = 64, max_positions: int = 8192, kv_heads: int = 4
) -> Path:
    """A dummy-weight Llama with an offline byte-level BPE tokenizer (vocab ``VOCAB``); 4
    attention heads, ``kv_heads`` of them for keys and values (fewer: grouped-query attention,
    a smaller KV per token, as the report's models have)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // 4,
        "vocab_size": VOCAB,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 20, trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": max_positions,
            }
        )
    )
    return path


def prompt_ids(seed: int, length: int) -> list[int]:
    """Deterministic token ids in [3, VOCAB) (no special tokens), distinct per seed."""
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


# --------------------------------------------------------------------------- server


@dataclasses.dataclass
class ServerSpec:
    model_path: Path
    log_path: Path
    plugin: bool = True
    tree_core: str = "rust"  # SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND
    dp_size: int = 2
    page_size: int = 16
    max_total_tokens: int = 4096
    http_port: int = 0  # 0: free ports are taken at start
    kv_port: int = 0  # the instance PUB (plugin) or rank 0's PUB (SGLang: + rank)
    replay_port: int = 0
    kv_events_extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    extra_args: Sequence[str] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    shim_dir: Path | None = None
    extra_paths: Sequence[Path] = ()  # before shim_dir on PYTHONPATH (bench/server_probe)
    device: str = "cpu"
    host: str = "127.0.0.1"  # HTTP and the instance stream bind here (PD: 127.0.0.2 for a second prefill)
    kv_events: bool = True  # False: no --kv-events-config (a PD decode)

    def assign_ports(self) -> None:
        """Free ports for whatever is 0: kv and replay blocks of dp_size (SGLang offsets by rank)."""
        if not self.http_port:
            self.http_port = free_port_block(1)
        if not self.kv_port:
            self.kv_port = free_port_block(self.dp_size)
        if not self.replay_port:
            self.replay_port = free_port_block(self.dp_size)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def stream_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.kv_port}"

    def kv_events_config(self) -> str:
        config: dict[str, Any] = {
            "publisher": "zmq",
            "endpoint": f"tcp://{self.host}:{self.kv_port}",
            "bind": True,
            "replay_endpoint": f"tcp://{self.host}:{self.replay_port}",
            "topic": TOPIC,
        }
        config.update(self.kv_events_extra)
        return json.dumps(config)

    def command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(self.model_path),
            "--load-format",
            "dummy",
            "--device",
            self.device,
            "--host",
            self.host,
            "--port",
            str(self.http_port),
            "--dp-size",
            str(self.dp_size),
            "--page-size",
            str(self.page_size),
            "--max-total-tokens",
            str(self.max_total_tokens),
            "--skip-server-warmup",
        ]
        if self.kv_events:
            cmd += ["--kv-events-config", self.kv_events_config()]
        if self.device == "cpu":
            cmd += [
                # float32: "auto" runs this float32 config in float16, which this CPU class has
                # no fast matmul for (measured: ~0.1 GFLOPS vs ~20 per core in float32).
                "--dtype",
                "float32",
                "--attention-backend",
                "torch_native",
                "--sampling-backend",
                "pytorch",
                "--disable-cuda-graph",
                "--mem-fraction-static",
                "0.1",
            ]
        if self.plugin:
            cmd += ["--plugin", "sglang_kvpub"]
        return [*cmd, *self.extra_args]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": self.tree_core,
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            # One OpenMP core group per DP rank (SGLang asserts it); ranks share the cores here.
            cores = os.cpu_count() or 1
            env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cores) for r in range(self.dp_size))
        paths = [str(p) for p in self.extra_paths]
        if self.shim_dir is not None:
            paths.append(str(self.shim_dir))
        if paths:
            env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env.update(self.env)
        return env


def scheduler_pid(server_pid: int, dp_rank: int) -> int:
    """The pid of DP rank ``dp_rank``'s scheduler under the server ``server_pid`` (found by the
    title SGLang gives it), to kill one rank."""
    found = [p for p, title, _ in process_memory(server_pid) if title.startswith(f"sglang::scheduler_DP{dp_rank}")]
    if len(found) != 1:
        raise LookupError(f"{len(found)} schedulers of DP rank {dp_rank}: {process_memory(server_pid)}")
    return found[0]


def process_memory(pid: int) -> list[tuple[int, str, int]]:
    """``(pid, title, RSS bytes)`` of ``pid`` and every descendant (SGLang titles its
    processes ``sglang::scheduler_DP<r>...``, ``sglang::data_parallel_controller``...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    out: list[tuple[int, str, int]] = []
    todo = [pid]
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        with contextlib.suppress(OSError):
            title = (Path("/proc") / str(current) / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            rss = 0
            for line in (Path("/proc") / str(current) / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
            out.append((current, title, rss))
    return out


def memory_report(server: Server) -> str:
    """Summed RSS of the server's processes and the median per scheduler (one per DP rank)."""
    if server.proc is None:
        return "not started"
    procs = process_memory(server.proc.pid)
    ranks = sorted(rss for _, title, rss in procs if title.startswith("sglang::scheduler"))
    total = sum(rss for _, _, rss in procs)
    median = ranks[len(ranks) // 2] if ranks else 0
    return (
        f"RSS {total / 2**30:.1f} GiB summed over {len(procs)} processes; "
        f"{len(ranks)} schedulers, median {median / 2**20:.0f} MiB each"
    )


class Server:
    """One launched server; use as a context manager or call :meth:`stop`."""

    def __init__(self, spec: ServerSpec) -> None:
        spec.assign_ports()
        self.spec = spec
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_s = 0.0

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout_s: float = 240.0) -> Server:
        spec = self.spec
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(spec.log_path, "ab") as log:
            log.write(("$ " + " ".join(spec.command()) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(
                spec.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=spec.environment(),
                start_new_session=True,  # its own process group: teardown kills every child
                cwd=str(spec.log_path.parent),
            )
        begin = time.monotonic()
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - begin
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServerError(f"server exited with {self.returncode()} before it was ready\n{self.log_tail()}")
            # HTTPException: a starting server (or a stray listener) may answer with no valid status line
            with contextlib.suppress(OSError, ValueError, ServerError, http.client.HTTPException):
                self.get("/health", timeout=5)
                self.server_info()
                return
            time.sleep(0.5)  # polling readiness with a deadline
        raise ServerError(f"server not ready within {timeout_s:.0f} s\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the whole process group, SIGKILL after ``grace_s``."""
        proc = self.proc
        if proc is None:
            return
        self._signal_group(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10.0)
        self._reap_group()

    def kill9(self) -> None:
        """``kill -9`` of every process of the server, as a crash would."""
        self._signal_group(signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10.0)
        self._reap_group()

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def _reap_group(self) -> None:
        """Waits (bounded) until no process of the group is left."""
        if self.proc is None:
            return
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def __enter__(self) -> Server:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ logs

    def log_text(self) -> str:
        try:
            return self.spec.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        tail = self.log_text().splitlines()[-lines:]
        return f"--- last {len(tail)} lines of {self.spec.log_path} ---\n" + "\n".join(tail)

    # ------------------------------------------------------------------ HTTP

    def request(self, method: str, path: str, body: Any = None, timeout: float = 120.0) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.spec.base_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise ServerError(f"{method} {path}: HTTP {exc.code} {detail}\n{self.log_tail(30)}") from exc
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode(errors="replace")

    def get(self, path: str, timeout: float = 30.0) -> Any:
        return self.request("GET", path, timeout=timeout)

    def post(self, path: str, body: Any = None, timeout: float = 120.0) -> Any:
        return self.request("POST", path, body if body is not None else {}, timeout=timeout)

    def server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = self.get("/server_info", timeout=10)
        return info

    def generate(
        self, input_ids: Sequence[int], *, max_new_tokens: int = 1, dp_rank: int | None = None, timeout: float = 300.0
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
        }
        if dp_rank is not None:
            body["routed_dp_rank"] = dp_rank
        result: dict[str, Any] = self.post("/generate", body, timeout=timeout)
        return result

    def flush_cache(self) -> Any:
        return self.post("/flush_cache", None)
