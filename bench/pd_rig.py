"""The originating report's deployment in small: Motor's ``pd_dual_dispatch`` -> two SGLang PD
prefill instances (``--dp-size 2``, the plugin) and one decode, KV over Mooncake's transfer
engine on TCP, ``motor-kv-adapter serve`` as Motor's kv-conductor.

Shared by the PD test tier (``tests/pd/``) and ``bench/e2e.py --pd``; it imports nothing from
``tests/``.  Every part is the real one, each in its own process:

- two prefills, ``python -m sglang.launch_server --disaggregation-mode prefill
  --disaggregation-transfer-backend mooncake_tcp`` on 127.0.0.1 and 127.0.0.2 (Motor sends one
  ``DISAGGREGATION_BOOTSTRAP_PORT`` for every prefill and derives each stream URL from the
  endpoint's IP and one configured port, so two prefills on one host need two addresses);
  ``--load-balance-method`` left at SGLang's default (``auto``): the plugin makes it
  ``round_robin`` and dispatches by cache (``dispatch="default"``: SGLang's
  ``follow_bootstrap_room``, the baseline);
- one decode, ``--disaggregation-mode decode --disaggregation-decode-retraction-backup
  cpu_tensor`` (SGLang's default backup asserts CUDA);
- Motor 3.0.0b2's coordinator, unmodified, in ``pd_dual_dispatch`` with ``kv_cache_affinity``,
  configured from ``docs/examples/motor_user_config.json`` and ``motor_env_config.json`` with
  only what differs on this machine replaced; the three instances are added as Motor's
  controller adds them.

CPU-only settings (docs/testing.md "The PD tier"): the prefills run with
``SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=0`` (that early send makes a CUDA event) and
every server with ``KVPUB_CPU_PD_PATCHES=1`` (``bench/cpu_shims/pd_patches.py``: two upstream
bugs, each named there).  ``--sleep-on-idle`` keeps idle servers off the two cores.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import random
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import e2e_rig
import motor_rig
import sglang_server

from motor_adapter.tools.motor_coordinator import Coordinator, instance_event
from sglang_kvpub.config import COST_KEYS, env_name

__all__ = ["PD_EXAMPLE_CONFIG", "PdCompletion", "PdRig", "PdRigSpec", "motor_pd_config_from_example"]

PD_EXAMPLE_CONFIG = e2e_rig.EXAMPLE_CONFIG  # docs/examples/motor_user_config.json
PD_EXAMPLE_ENV = sglang_server.REPO / "docs" / "examples" / "motor_env_config.json"
PREFILL_HOSTS = ("127.0.0.1", "127.0.0.2")
DECODE_ID = len(PREFILL_HOSTS)  # Motor instance ids: prefills 0, 1; the decode 2
# Engine keys of the example that describe the production hardware (16 NPUs, DSV4's attention);
# the CPU servers here run without them.
_HARDWARE_KEYS = ("tp-size", "enable-dp-attention", "attention-backend")
# Keys the rig sets itself from the spec (ports are free ones here).
_RIG_KEYS = ("model", "dp-size", "page-size", "kv-events-config", "disaggregation_bootstrap_port")


@dataclasses.dataclass(frozen=True)
class PdScore:
    """One kv_cache_affinity decision in Motor's log: the prefill instance and the hit (tokens)."""

    instance: int
    matched: int
    answer: Mapping[str, Any]

    def engine_dp_rank(self, instance: int) -> int | None:
        entry = self.answer.get("default", {}).get(f"vllm-prefill-{instance}", {})
        rank = entry.get("dp_detail", {}).get("0", {}).get("engine_dp_rank")
        return None if rank is None else int(rank)


@dataclasses.dataclass(frozen=True)
class PdCompletion:
    """One ``/v1/completions`` through Motor, and what each part logged while it ran."""

    status: int
    body: Any
    seconds: float
    scores: list[PdScore]
    prefills: dict[int, list[e2e_rig.Prefill]]  # per prefill instance
    dispatches: dict[int, list[dict[str, Any]]]
    decode_lines: list[str]
    motor_lines: list[str]
    prefill_lines: dict[int, list[str]]

    @property
    def served(self) -> tuple[int, int] | None:
        """(prefill instance, DP rank) that ran this request's prefill, if exactly one did."""
        seen = {(i, p.dp_rank) for i, ps in self.prefills.items() for p in ps}
        return seen.pop() if len(seen) == 1 else None

    @property
    def cached_tokens(self) -> int:
        return sum(p.cached_tokens for ps in self.prefills.values() for p in ps)

    @property
    def completion_tokens(self) -> int:
        usage = self.body.get("usage", {}) if isinstance(self.body, dict) else {}
        return int(usage.get("completion_tokens", 0) or 0)


@dataclasses.dataclass
class PdRigSpec:
    work_dir: Path
    model_dir: Path
    dispatch: str = "cache_aware"  # the plugin's dp_dispatch; "default": SGLang's follow_bootstrap_room
    tree_core: str = "rust"
    dp_size: int = 2
    page_size: int = 128  # Motor's default block size (the documented config sets no block-size)
    max_total_tokens: int = 4096  # per prefill rank: small, so that a few prompts evict
    decode_max_total_tokens: int = 16384
    motor_config: Path = PD_EXAMPLE_CONFIG
    start_timeout_s: float = 900.0
    prefill_env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # on top of Motor's env config
    adapter_registry: str = "memory"  # "file:PATH": the adapter keeps its registrations across a restart


def motor_pd_config_from_example(
    example: Mapping[str, Any],
    *,
    model_dir: Path,
    dp_size: int,
    events_port: int,
    replay_port: int,
    adapter_port: int,
    infer_port: int,
    mgmt_port: int,
    worker_base_port: int,
) -> dict[str, Any]:
    """The documented PD Motor config with only what differs on this machine replaced: the
    model path (Motor's tokenizer), ports, dp size; the hardware-only engine keys dropped."""
    config = copy.deepcopy(dict(example))
    coordinator = config["motor_coordinator_config"]
    api = {"coordinator_api_host": "127.0.0.1", "coordinator_api_infer_port": infer_port}
    api["coordinator_api_mgmt_port"] = mgmt_port
    coordinator["api_config"] = dict(api)  # the Ascend source's section
    coordinator["http_config"] = dict(api)  # 3.0.0b2's
    coordinator["inference_workers_config"] = {"num_workers": 1, "worker_metaserver_base_port": worker_base_port}
    for section in ("motor_engine_prefill_config", "motor_engine_decode_config"):
        engine_section = config[section]
        engine_section["model_config"]["model_path"] = str(model_dir)
        engine = engine_section["engine_config"]
        for key in _HARDWARE_KEYS:
            engine.pop(key, None)
        engine.update({"model": str(model_dir), "dp-size": dp_size if section.endswith("prefill_config") else 1})
    events = config["motor_engine_prefill_config"]["engine_config"]["kv-events-config"]
    events["endpoint"] = f"tcp://*:{events_port}"
    events["replay_endpoint"] = f"tcp://*:{replay_port}"
    config["kv_conductor_config"]["http_server_port"] = adapter_port
    return config


class PdRig(motor_rig.MotorRig):
    """Two prefills, a decode, the adapter and Motor; :meth:`start` and :meth:`stop`."""

    def __init__(self, spec: PdRigSpec) -> None:
        super().__init__(spec.work_dir, spec.start_timeout_s)
        self.spec = spec
        self.adapter_registry = spec.adapter_registry
        example = json.loads(spec.motor_config.read_text(encoding="utf-8"))
        prefill_section = example["motor_engine_prefill_config"]
        self.model_name = str(prefill_section["model_config"]["model_name"])
        self.prefill_engine = dict(prefill_section["engine_config"])
        self.engine_env = json.loads(PD_EXAMPLE_ENV.read_text(encoding="utf-8"))
        prefill_env = self.engine_env.get("motor_engine_prefill_env", {})
        self.adapter_kv_affinity = {  # the example's engine cost keys, given to the adapter as well
            key: float(prefill_env[env_name(key)]) for key in COST_KEYS if prefill_env.get(env_name(key)) is not None
        }
        events = dict(self.prefill_engine["kv-events-config"])
        self.bootstrap_port = sglang_server.free_port_block(1)  # the documented 8998 may be taken here
        kv_port, replay_port = sglang_server.free_port_block(1), sglang_server.free_port_block(1)
        self.prefills = [
            sglang_server.Server(self._prefill_spec(n, host, events, kv_port, replay_port))
            for n, host in enumerate(PREFILL_HOSTS)
        ]
        self.decode = sglang_server.Server(self._decode_spec())
        self.servers = [*self.prefills, self.decode]
        self.motor_config = motor_pd_config_from_example(
            example,
            model_dir=spec.model_dir,
            dp_size=spec.dp_size,
            events_port=kv_port,
            replay_port=replay_port,
            adapter_port=self.adapter_port,
            infer_port=sglang_server.free_port_block(1),
            mgmt_port=sglang_server.free_port_block(1),
            worker_base_port=sglang_server.free_port_block(8),
        )
        motor_env = {k: str(v) for k, v in self.engine_env["motor_coordinator_env"].items()}
        motor_env["DISAGGREGATION_BOOTSTRAP_PORT"] = str(self.bootstrap_port)
        self.coordinator = Coordinator(self.motor_config, spec.work_dir / "motor.log", env=motor_env)

    # ------------------------------------------------------------------ specs

    def _engine_args(self, engine: Mapping[str, Any], skip: tuple[str, ...]) -> list[str]:
        """engine_config keys as SGLang flags (what Motor's engine server does), minus those the
        rig sets itself and the hardware-only ones."""
        args: list[str] = []
        for key, value in engine.items():
            if key in skip or key in _HARDWARE_KEYS or key in _RIG_KEYS:
                continue
            if value is True:
                args.append(f"--{key}")
            elif value is not False and value is not None:
                args += [f"--{key}", str(value)]
        return args

    # The three servers start side by side: on CPU SGLang sizes its KV budget from the memory
    # it sees free before and after loading the weights, and the others' loads in between
    # count against it ("Loaded weights leave no GPU memory for the KV cache under
    # --mem-fraction-static=0.1" with a 2x2048 model).  --max-total-tokens still sets the pool.
    _MEM_FRACTION = ("--mem-fraction-static", "0.3")

    def _common_env(self, section: str) -> dict[str, str]:
        env = {k: str(v) for k, v in self.engine_env.get(section, {}).items()}
        env["KVPUB_CPU_PD_PATCHES"] = "1"  # bench/cpu_shims/pd_patches.py (CPU only)
        return env

    def _prefill_spec(
        self, n: int, host: str, events: Mapping[str, Any], kv_port: int, replay_port: int
    ) -> sglang_server.ServerSpec:
        spec = self.spec
        extra = {k: v for k, v in events.items() if k not in ("endpoint", "replay_endpoint", "publisher")}
        extra["dp_dispatch"] = spec.dispatch
        extra["dispatch_log"] = "info"  # the rig reads every decision's line (parse_dispatches)
        args = self._engine_args(self.prefill_engine, ("served-model-name",))
        args += ["--served-model-name", self.model_name, "--enable-cache-report", "--sleep-on-idle"]
        args += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        args += ["--disaggregation-transfer-backend", "mooncake_tcp"]  # Mooncake's engine over TCP (CPU here)
        args += self._MEM_FRACTION
        env = self._common_env("motor_engine_prefill_env")
        # CPU only: the cached-prefix early send records a CUDA event (docs/testing.md).
        env["SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX"] = "0"
        env.update(spec.prefill_env)
        return sglang_server.ServerSpec(
            model_path=spec.model_dir,
            log_path=spec.work_dir / f"prefill{n}.log",
            shim_dir=sglang_server.cpu_shim_dir(),
            plugin=False,  # enabled by SGLANG_KVPUB_ENABLED=1 from Motor's env config, as Motor launches it
            tree_core=spec.tree_core,
            dp_size=spec.dp_size,
            page_size=spec.page_size,
            max_total_tokens=spec.max_total_tokens,
            kv_port=kv_port,
            replay_port=replay_port,
            kv_events_extra=extra,
            extra_args=args,
            env=env,
            host=host,
        )

    def _decode_spec(self) -> sglang_server.ServerSpec:
        spec = self.spec
        decode_engine = json.loads(spec.motor_config.read_text(encoding="utf-8"))["motor_engine_decode_config"]
        args = self._engine_args(decode_engine["engine_config"], ("served-model-name",))
        args += ["--served-model-name", self.model_name, "--sleep-on-idle", "--decode-log-interval", "1"]
        args += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]  # CPU only: the default asserts CUDA
        args += ["--disaggregation-transfer-backend", "mooncake_tcp", *self._MEM_FRACTION]
        return sglang_server.ServerSpec(
            model_path=spec.model_dir,
            log_path=spec.work_dir / "decode.log",
            shim_dir=sglang_server.cpu_shim_dir(),
            plugin=False,
            kv_events=False,
            tree_core=spec.tree_core,
            dp_size=1,
            page_size=spec.page_size,
            max_total_tokens=spec.decode_max_total_tokens,
            extra_args=args,
            env=self._common_env("motor_engine_decode_env"),
        )

    # ------------------------------------------------------------------ lifecycle

    def _register(self) -> None:
        """Motor's controller-style registration of all three instances; the adapter on both streams."""
        self.coordinator.add_instance(self._instances_event())
        for n in range(len(self.prefills)):
            self.wait_for(
                lambda n=n: f"registered vllm-prefill-{n} dp 0" in self.adapter_text(),
                f"Motor's registration of prefill {n}",
            )
        found = f"instance stream with dp_size {self.spec.dp_size}"
        self.wait_for(
            lambda: self.adapter_text().count(found) >= len(self.prefills), "the adapter on both instance streams"
        )

    def _instances_event(self) -> Any:
        """One ``InsEventMsg(add)`` with the two prefills and the decode (Motor's own classes)."""
        events = [
            instance_event(
                instance_id=n,
                model_name=self.model_name,
                http_host=server.spec.host,
                http_port=server.spec.http_port,
                dp_size=self.spec.dp_size,
                role="prefill",
                job_name=f"sglang-prefill-{n}",
            )
            for n, server in enumerate(self.prefills)
        ]
        decode = instance_event(
            instance_id=DECODE_ID,
            model_name=self.model_name,
            http_host=self.decode.spec.host,
            http_port=self.decode.spec.http_port,
            dp_size=1,
            role="decode",
            job_name="sglang-decode-0",
        )
        event = events[0]
        for other in [*events[1:], decode]:
            event.instances.extend(other.instances)
        return event

    # ------------------------------------------------------------------ requests

    def complete(self, prompt: str, *, max_tokens: int = 4, timeout_s: float = 600.0) -> PdCompletion:
        """One ``/v1/completions`` through Motor (one at a time: log lines after its start are its own)."""
        marks = self.log_marks()
        body = {"model": self.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        status, answer, seconds = self.post_completion({**body, "ignore_eos": True}, timeout_s)
        prefills = range(len(self.prefills))
        if status == 200:  # a prefill writes its batch line around the time the decode answers
            with contextlib.suppress(AssertionError):
                self.wait_for(
                    lambda: any(e2e_rig.parse_prefills(self.log_since(marks)[1][n]) for n in prefills),
                    "prefill line",
                    10.0,
                )
        motor_text, logs = self.log_since(marks)
        return PdCompletion(
            status=status,
            body=answer,
            seconds=seconds,
            scores=parse_scores(motor_text),
            prefills={n: e2e_rig.parse_prefills(logs[n]) for n in prefills},
            dispatches={n: e2e_rig.parse_dispatches(logs[n]) for n in prefills},
            decode_lines=logs[-1].splitlines(),
            motor_lines=motor_text.splitlines(),
            prefill_lines={n: logs[n].splitlines() for n in prefills},
        )

    def seed(self, prompt: str, prefill: int, *, timeout_s: float = 600.0, room: int | None = None) -> list[int]:
        """Serves ``prompt`` on prefill ``prefill`` (and the decode) without Motor, exactly as
        Motor's ``pd_dual_dispatch`` sends a request: the same body with ``bootstrap_host``,
        ``bootstrap_port`` and a random ``bootstrap_room`` to both, ``max_tokens`` 1 to the
        prefill.  Puts a prompt on the instance Motor's tie-break would not pick.  Returns
        the HTTP statuses (prefill, decode)."""
        server = self.prefills[prefill]
        body = {"model": self.model_name, "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        body |= {"bootstrap_host": server.spec.host, "bootstrap_port": self.bootstrap_port}
        body["bootstrap_room"] = random.randint(0, 2**63 - 1) if room is None else room
        statuses: list[int] = [0, 0]

        def post(index: int, base_url: str, payload: dict[str, Any]) -> None:
            request = urllib.request.Request(
                base_url + "/v1/completions",
                data=json.dumps(payload).encode(),
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as response:
                    response.read()
                    statuses[index] = int(response.status)
            except urllib.error.HTTPError as exc:
                statuses[index] = int(exc.code)

        to_prefill = threading.Thread(target=post, args=(0, server.spec.base_url, {**body, "max_tokens": 1}))
        to_prefill.start()
        post(1, self.decode.spec.base_url, body)
        to_prefill.join()
        return statuses

    def prefill_hits(self, token_ids: list[int]) -> dict[str, Any]:
        """The adapter's /query answer per prefill instance id (what Motor will read)."""
        return self.adapter_query(token_ids, self.spec.page_size)

    def held_on(self, token_ids: list[int], instance: int, rank: int | None) -> dict[str, Any] | None:
        """The instance's answer if it covers every full page of ``token_ids`` and names the
        holding rank (``rank`` None: any rank), else None.  Each ``/query`` counts the prompt
        on the rank it scores until the instance's next load report (docs/dispatch.md), so a
        poll made before the hit arrived can make another rank look cheaper for a moment:
        waiting until the answer names the holder keeps that load out of the next request's."""
        full = len(token_ids) // self.spec.page_size * self.spec.page_size
        entry = self.prefill_hits(token_ids).get(f"vllm-prefill-{instance}")
        if not entry or int(entry.get("longest_matched", 0)) < full:
            return None
        named = entry["dp_detail"]["0"]["engine_dp_rank"]
        if named is None or (rank is not None and named != rank):
            return None
        return dict(entry)


def parse_scores(text: str) -> list[PdScore]:
    """Motor's kv_cache_affinity decisions, each with the adapter answer logged before it.

    ``matched`` is the hit the adapter reported for the instance Motor picked (its
    ``dp_detail`` matched tokens).  The number on Motor's ``select_endpoint`` line is the value
    Motor ranked by: the adapter gives a cold best instance 1 there so that Motor still picks
    it over the others (scoring.motor_values), so it is not read as the hit.
    """
    scores = []
    for s in e2e_rig.parse_scores(text):
        entry = s.answer.get("default", {}).get(f"vllm-prefill-{s.instance}", {})
        detail = entry.get("dp_detail", {}).get("0", {})
        matched = detail.get("matched_tokens")
        scores.append(PdScore(s.instance, s.matched if matched is None else int(matched), s.answer))
    return scores


if __name__ == "__main__":  # a manual run: python bench/pd_rig.py WORK_DIR
    work = Path(sys.argv[1] if len(sys.argv) > 1 else "pd-run").resolve()
    rig = PdRig(PdRigSpec(work_dir=work, model_dir=sglang_server.make_model_dir(work / "model")))
    with rig:
        print("ready", rig.timings, flush=True)
        long_prompt = e2e_rig.prompt_text(1, 300)
        for label, text in (("cold", long_prompt), ("hot", long_prompt), ("new", e2e_rig.prompt_text(2, 300))):
            done = rig.complete(text)
            print(label, done.status, f"{done.seconds:.2f}s", done.scores, done.prefills, done.dispatches, flush=True)
            print("  body", str(done.body)[:300], flush=True)
