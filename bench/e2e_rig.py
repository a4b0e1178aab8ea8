"""The originating report's whole path on one machine: Motor's real coordinator -> one real
SGLang server (``--dp-size 2``, ``--plugin sglang_kvpub``) -> the DP rank that holds the prefix.

Shared by the end-to-end test tier (``tests/e2e/``) and ``bench/e2e.py``; it imports nothing
from ``tests/``.  Every part is the real one, each in its own process:

- SGLang 0.5.23's ``python -m sglang.launch_server`` on CPU (``bench/sglang_server.py``: a
  dummy-weight Llama made on the spot, its byte-level BPE tokenizer, ``bench/cpu_shims``);
- ``motor-kv-adapter serve`` (``python -m motor_adapter.cli serve``) as Motor's kv-conductor;
- Motor's coordinator, ``python -m motor.coordinator.main`` from the installed
  ``mindie-motor``, unmodified (``motor_adapter.tools.motor_coordinator``), configured from
  ``docs/examples/motor_user_config.json`` with only what differs on this machine replaced
  (:func:`motor_config_from_example`), the instance registered the way Motor's controller does.

Requests go to Motor's ``/v1/completions``; what each part decided is read back from the
three logs (:meth:`Rig.complete`: :func:`parse_scores`, :func:`parse_prefills`,
:func:`parse_dispatches`), the same lines an operator reads (README "End to end").  The
lifecycle, the adapter's API and the waiting are the rigs' shared base (``bench/motor_rig.py``).
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import importlib.util
import json
import random
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import motor_rig
import sglang_server

from motor_adapter.tools.motor_coordinator import Coordinator, instance_event, topology

__all__ = [
    "EXAMPLE_CONFIG",
    "Completion",
    "MotorScore",
    "Prefill",
    "Rig",
    "RigSpec",
    "motor_config_from_example",
]

EXAMPLE_CONFIG = sglang_server.REPO / "docs" / "examples" / "motor_user_config.json"
INSTANCE = "vllm-prefill-0"  # the instance id Motor registers its first prefill instance under
# Engine keys of the example that describe the production hardware (16 NPUs, DSV4's attention,
# P/D disaggregation); the CPU server here runs without them.
_HARDWARE_KEYS = ("tp-size", "enable-dp-attention", "attention-backend", "disaggregation-mode")

# 3.0.0b2: "select_endpoint: 0-0  max_kv_gpu:560"; the Ascend source:
# "select_endpoint(load-aware): 0-0 matched:560 ..."
_SELECT = re.compile(r"select_endpoint(?:\(load-aware\))?: (\d+)-(\d+)\s+(?:max_kv_gpu|matched):(\d+)")
_QUERY = re.compile(r"query success! (\{.*\})\s*$")
_PREFILL = re.compile(
    r"\[[^\]]* DP(\d+)[^\]]*\] Prefill batch[,.] #new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+)"
)
_DISPATCH = re.compile(r"dp_dispatch policy=(\w+)(?: dp_rank=(\d+))? reason=(\w+) isl=(\d+) matched=(\w+)")


@dataclasses.dataclass(frozen=True)
class MotorScore:
    """One kv_cache_affinity decision in Motor's log: the endpoint it chose and the hit it
    scored (tokens), with the adapter's answer Motor logged just before it."""

    instance: int
    endpoint: int
    matched: int
    answer: Mapping[str, Any]

    @property
    def engine_dp_rank(self) -> int | None:
        entry = self.answer.get("default", {}).get(INSTANCE, {})
        rank = entry.get("dp_detail", {}).get("0", {}).get("engine_dp_rank")
        return None if rank is None else int(rank)


@dataclasses.dataclass(frozen=True)
class Prefill:
    """One ``Prefill batch`` line of SGLang's scheduler log."""

    dp_rank: int
    new_tokens: int
    cached_tokens: int


@dataclasses.dataclass(frozen=True)
class Completion:
    """One ``/v1/completions`` through Motor, and what each part logged while it ran."""

    status: int
    body: Any
    seconds: float
    scores: list[MotorScore]
    prefills: list[Prefill]
    dispatches: list[dict[str, Any]]

    @property
    def cached_tokens(self) -> int:
        """SGLang's cached tokens for this request (its prefill lines; one request at a time)."""
        return sum(p.cached_tokens for p in self.prefills)

    @property
    def served_rank(self) -> int | None:
        ranks = {p.dp_rank for p in self.prefills}
        return ranks.pop() if len(ranks) == 1 else None


@dataclasses.dataclass
class RigSpec:
    work_dir: Path
    model_dir: Path
    dispatch: str = "cache_aware"  # the plugin's dp_dispatch; "default": SGLang's round robin
    tree_core: str = "rust"
    dp_size: int = 2
    page_size: int = 128
    max_total_tokens: int = 32768
    motor_config: Path = EXAMPLE_CONFIG
    start_timeout_s: float = 900.0


def motor_config_from_example(
    example: Mapping[str, Any],
    *,
    model_dir: Path,
    dp_size: int,
    page_size: int,
    events_port: int,
    replay_port: int,
    adapter_port: int,
    infer_port: int,
    mgmt_port: int,
    worker_base_port: int,
) -> dict[str, Any]:
    """The documented Motor config with only what differs on this machine replaced: the model
    path (Motor's tokenizer reads it), ports, dp/page size, and the deploy mode the installed
    Motor scores with (``topology()``); the hardware-only engine keys are dropped."""
    config = copy.deepcopy(dict(example))
    config["motor_deploy_config"]["p_instances_num"] = 1  # this rig runs one instance (the example: 2P1D)
    mode, _role = topology()
    coordinator = config["motor_coordinator_config"]
    coordinator["scheduler_config"]["deploy_mode"] = mode
    api = {"coordinator_api_host": "127.0.0.1", "coordinator_api_infer_port": infer_port}
    api["coordinator_api_mgmt_port"] = mgmt_port
    coordinator["api_config"] = dict(api)  # the Ascend source's section
    coordinator["http_config"] = dict(api)  # 3.0.0b2's
    coordinator["inference_workers_config"] = {"num_workers": 1, "worker_metaserver_base_port": worker_base_port}
    prefill = config["motor_engine_prefill_config"]
    prefill["model_config"]["model_path"] = str(model_dir)
    engine = prefill["engine_config"]
    for key in _HARDWARE_KEYS:
        engine.pop(key, None)
    engine.update({"model": str(model_dir), "dp-size": dp_size, "page-size": page_size, "block-size": page_size})
    events = engine["kv-events-config"]
    events["endpoint"] = f"tcp://*:{events_port}"
    events["replay_endpoint"] = f"tcp://*:{replay_port}"
    config["kv_conductor_config"]["http_server_port"] = adapter_port
    return config


class Rig(motor_rig.MotorRig):
    """The three processes, started by :meth:`start` and ended by :meth:`stop`."""

    def __init__(self, spec: RigSpec) -> None:
        super().__init__(spec.work_dir, spec.start_timeout_s)
        self.spec = spec
        example = json.loads(spec.motor_config.read_text(encoding="utf-8"))
        prefill = example["motor_engine_prefill_config"]
        self.model_name = str(prefill["model_config"]["model_name"])
        events = dict(prefill["engine_config"]["kv-events-config"])
        self.server = sglang_server.Server(self._server_spec(events))
        self.servers = [self.server]
        self.motor_config = motor_config_from_example(
            example,
            model_dir=spec.model_dir,
            dp_size=spec.dp_size,
            page_size=spec.page_size,
            events_port=self.server.spec.kv_port,
            replay_port=self.server.spec.replay_port,
            adapter_port=self.adapter_port,
            infer_port=sglang_server.free_port_block(1),
            mgmt_port=sglang_server.free_port_block(1),
            worker_base_port=sglang_server.free_port_block(8),
        )
        self.coordinator = Coordinator(self.motor_config, spec.work_dir / "motor.log")

    def _server_spec(self, events: Mapping[str, Any]) -> sglang_server.ServerSpec:
        """SGLang as the example configures it (topic, buffer), on loopback ports."""
        spec = self.spec
        extra = {k: v for k, v in events.items() if k not in ("endpoint", "replay_endpoint", "publisher")}
        extra["dp_dispatch"] = spec.dispatch
        extra["dispatch_log"] = "info"  # the rig reads every decision's line (parse_dispatches)
        return sglang_server.ServerSpec(
            model_path=spec.model_dir,
            log_path=spec.work_dir / "sglang.log",
            shim_dir=sglang_server.cpu_shim_dir(),
            tree_core=spec.tree_core,
            dp_size=spec.dp_size,
            page_size=spec.page_size,
            max_total_tokens=spec.max_total_tokens,
            kv_events_extra=extra,
            extra_args=["--served-model-name", self.model_name, "--enable-cache-report"],
        )

    def _register(self) -> None:
        """Motor's controller-style registration, and the adapter subscribed to the instance."""
        _mode, role = topology()
        self.coordinator.add_instance(
            instance_event(
                instance_id=0,
                model_name=self.model_name,
                http_host="127.0.0.1",
                http_port=self.server.spec.http_port,
                dp_size=self.spec.dp_size,
                role=role,
            )
        )
        self.wait_for(lambda: f"registered {INSTANCE} dp 0" in self.adapter_text(), "Motor's registration")
        found = f"instance stream with dp_size {self.spec.dp_size}"
        self.wait_for(lambda: found in self.adapter_text(), "the adapter subscribed to the instance stream")

    # ------------------------------------------------------------------ requests

    def complete(self, prompt: str, *, max_tokens: int = 1, timeout_s: float = 600.0) -> Completion:
        """One ``/v1/completions`` through Motor (one at a time: log lines after its start are its own)."""
        marks = self.log_marks()
        body = {"model": self.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        status, answer, seconds = self.post_completion(body, timeout_s)
        if status == 200:  # SGLang writes its prefill line just before it answers; wait for it
            with contextlib.suppress(AssertionError):
                self.wait_for(lambda: parse_prefills(self.log_since(marks)[1][0]), "the prefill line", 10.0)
        motor_text, (sglang_text,) = self.log_since(marks)
        return Completion(
            status=status,
            body=answer,
            seconds=seconds,
            scores=parse_scores(motor_text),
            prefills=parse_prefills(sglang_text),
            dispatches=parse_dispatches(sglang_text),
        )

    def adapter_hit(self, token_ids: list[int]) -> dict[str, Any] | None:
        """The adapter's /query answer for the instance (what Motor will read), or None."""
        entry = self.adapter_query(token_ids, self.spec.page_size).get(INSTANCE)
        return entry if isinstance(entry, dict) else None

    def wait_for_hit(self, token_ids: list[int], timeout_s: float = 60.0) -> dict[str, Any]:
        """Polls the adapter until the instance's hit covers every full block of ``token_ids``."""
        full = len(token_ids) // self.spec.page_size * self.spec.page_size

        def covered() -> dict[str, Any] | None:
            entry = self.adapter_hit(token_ids)
            return entry if entry and int(entry.get("longest_matched", 0)) >= full else None

        entry: dict[str, Any] = self.wait_for(covered, "the adapter's hit on the whole prompt", timeout_s)
        return entry


# --------------------------------------------------------------------------- log lines


def parse_scores(text: str) -> list[MotorScore]:
    """Motor's kv_cache_affinity decisions, each with the adapter answer logged before it."""
    scores: list[MotorScore] = []
    answer: Mapping[str, Any] = {}
    for line in text.splitlines():
        query = _QUERY.search(line)
        if query:
            with contextlib.suppress(ValueError, SyntaxError):
                answer = ast.literal_eval(query.group(1))  # Motor logs the dict's repr
            continue
        select = _SELECT.search(line)
        if select:
            instance, endpoint, matched = (int(g) for g in select.groups())
            scores.append(MotorScore(instance, endpoint, matched, answer))
            answer = {}
    return scores


def parse_prefills(text: str) -> list[Prefill]:
    return [Prefill(int(m[0]), int(m[2]), int(m[3])) for m in _PREFILL.findall(text)]


def parse_dispatches(text: str) -> list[dict[str, Any]]:
    """The plugin's per-request dispatch lines (``dp_dispatch policy=... reason=... matched=...``)."""
    lines = []
    for policy, rank, reason, isl, matched in _DISPATCH.findall(text):
        lines.append(
            {
                "policy": policy,
                "dp_rank": int(rank) if rank else None,
                "reason": reason,
                "isl": int(isl),
                "matched": int(matched) if matched.isdigit() else None,
            }
        )
    return lines


def prompt_text(seed: int, words: int) -> str:
    """A deterministic prompt of ``words`` short pseudo-words (distinct per seed)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return " ".join("".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(words))


def environment_ready() -> list[str]:
    """What the rig needs that is not installed (empty: everything is)."""
    needed = ("motor", "transformers", *sglang_server.SERVER_MODULES)
    return [name for name in needed if importlib.util.find_spec(name) is None]


if __name__ == "__main__":  # a manual run: python bench/e2e_rig.py WORK_DIR
    work = Path(sys.argv[1] if len(sys.argv) > 1 else "e2e-run").resolve()
    rig = Rig(RigSpec(work_dir=work, model_dir=sglang_server.make_model_dir(work / "model")))
    with rig:
        long_prompt = prompt_text(1, 1200)
        for label, text in (("cold", long_prompt), ("hot", long_prompt), ("new", prompt_text(2, 1200))):
            done = rig.complete(text)
            print(label, done.status, f"{done.seconds:.2f}s", done.scores, done.prefills, done.dispatches, flush=True)
            if label == "cold":
                from transformers import AutoTokenizer

                ids = AutoTokenizer.from_pretrained(str(rig.spec.model_dir))(long_prompt)["input_ids"]
                print("adapter", rig.wait_for_hit(ids))
