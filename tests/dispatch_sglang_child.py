"""Child process of tests/engine/test_dispatch.py: the REAL SGLang 0.5.23 DP-controller dispatch path
with the cache-aware hook.  Prints one JSON object (what each scenario's requests reached).

The controller is the real class, built with ``__new__`` (its ``__init__`` launches
scheduler processes) and given what its dispatch methods read: inproc PUSH sockets as
``workers``, a real ``DPBudget`` and a load-snapshot reader returning real ``LoadSnapshot``s.
Requests are real ``TokenizedGenerateReqInput`` structs, entered through the controller's
own ``TypeBasedDispatcher`` (``init_dispatcher``) and received with SGLang's ``sock_recv``.
"""

from __future__ import annotations

import json
import time
import uuid
from array import array

import sglang_real  # this script's directory (tests/) is sys.path[0]

RANKS = 16
BLOCK = 128


def main() -> None:
    dpc = sglang_real.load_module(sglang_real.DP_CONTROLLER)
    io = sglang_real.load_module("sglang.srt.managers.io_struct")
    snap = sglang_real.load_module("sglang.srt.managers.load_snapshot")
    sampling = sglang_real.load_module("sglang.srt.sampling.sampling_params")
    hooks = sglang_real.load_module("sglang.srt.plugins.hook_registry")
    import zmq

    from sglang_kvpub.engine import dispatch_hook as dispatch
    from sglang_kvpub.wire import BlockStored, EventBatch

    original_rr = dpc.DataParallelController.round_robin_scheduler
    dispatch.install_dispatch_hook(hooks.HookRegistry, hooks.HookType, apply=True)
    patched = dpc.DataParallelController.round_robin_scheduler is not original_rr

    ctx = zmq.Context()
    pushes, pulls = [], []
    for r in range(RANKS):
        name = f"inproc://dpc-{uuid.uuid4().hex}-{r}"
        pull = ctx.socket(zmq.PULL)
        pull.bind(name)
        push = ctx.socket(zmq.PUSH)
        push.connect(name)
        pushes.append(push)
        pulls.append(pull)

    loads = {"tokens": [0] * RANKS}

    class Reader:
        def read_all(self) -> list:
            now = time.time()
            return [
                snap.LoadSnapshot(timestamp=now, dp_rank=r, num_total_tokens=t) for r, t in enumerate(loads["tokens"])
            ]

    def controller(method: str):
        c = dpc.DataParallelController.__new__(dpc.DataParallelController)
        c.load_balance_method = dpc.LoadBalanceMethod.from_str(method)
        c.workers = list(pushes)
        c.status = [True] * RANKS
        c._active_workers = list(range(RANKS))
        c.round_robin_counter = 0
        c.health_round_robin_counter = 0
        c.dp_budget = dpc.DPBudget(RANKS)
        c.load_snapshot_reader = Reader()
        c._last_refresh_time = 0.0
        c.refresh_load_budget_on_dispatch = method in ("total_requests", "total_tokens")
        # What __init__ does with its lookup table, AFTER the hooks were applied.
        lookup = {
            "round_robin": c.round_robin_scheduler,
            "total_requests": c.total_requests_scheduler,
            "total_tokens": c.total_tokens_scheduler,
        }
        c.dispatching = lookup[method]
        c.init_dispatcher()
        return c

    def req(tokens, routed=None):
        return io.TokenizedGenerateReqInput(
            rid=uuid.uuid4().hex,
            input_text=None,
            input_ids=array("q", tokens),
            input_embeds=None,
            mm_inputs=None,
            token_type_ids=None,
            sampling_params=sampling.SamplingParams(),
            return_logprob=False,
            logprob_start_len=-1,
            top_logprobs_num=0,
            token_ids_logprob=None,
            stream=False,
            routed_dp_rank=routed,
        )

    def landed(c, items, fresh_loads: bool = True) -> list[int]:
        out = []
        for item in items:
            if fresh_loads:
                c._last_refresh_time = 0.0  # each request sees a new load snapshot (not throttled)
            c._request_dispatcher(item)
            got = []
            for _ in range(len(item) if isinstance(item, io.BatchTokenizedGenerateReqInput) else 1):
                ranks = [r for r, pull in enumerate(pulls) if pull.poll(0)]
                deadline = time.monotonic() + 5
                while not ranks and time.monotonic() < deadline:
                    ranks = [r for r, pull in enumerate(pulls) if pull.poll(10)]
                for r in ranks:
                    received = io.sock_recv(pulls[r])
                    assert isinstance(received, io.TokenizedGenerateReqInput), type(received)
                    got.append(r)
            out.extend(got)
        return out

    prefix = [(i * 7919) % 150_000 for i in range(20 * BLOCK)]  # 20 blocks = 2560 tokens on rank 7
    result: dict = {"patched": patched}

    for method in ("round_robin", "total_requests", "total_tokens"):
        c = controller(method)
        d = dispatch.attach_dispatcher(c, block_size=BLOCK)
        d.observe(EventBatch(time.time(), [BlockStored(list(range(1, 21)), None, prefix, BLOCK, medium="GPU")], 7), 7)
        prompts = [prefix + [(n * 31 + k) % 150_000 for k in range(2500)] for n in range(32)]
        loads["tokens"] = [1000] * RANKS
        scenario = {
            "hot": landed(c, [req(p) for p in prompts]),
            "explicit": landed(c, [req(prompts[0], routed=r) for r in (3, 7, 12)]),
            "short": landed(c, [req(list(range(BLOCK - 1))) for _ in range(4)]),
            "batch": landed(c, [io.BatchTokenizedGenerateReqInput(batch=[req(p) for p in prompts[:2]])]),
        }
        scenario["stats"] = d.stats()["decisions"]
        # Skew: a hot prefix (2560 of 2660 tokens cached on rank 7) while rank 7's load climbs;
        # a small load weight keeps the cost on rank 7, so only the guard can spill (to rank 2).
        c = controller(method)
        d = dispatch.attach_dispatcher(
            c, block_size=BLOCK, load_weight=0.05, hotspot_spread=16384, hotspot_relative=1.0
        )
        d.observe(EventBatch(time.time(), [BlockStored(list(range(1, 21)), None, prefix, BLOCK, medium="GPU")], 7), 7)
        loads["tokens"] = [2000] * RANKS
        loads["tokens"][2] = 0
        skew = []
        for step in range(8):
            loads["tokens"][7] = step * 6000
            tokens = prefix + [(step * 13 + k) % 150_000 for k in range(100)]
            skew.append({"load7": loads["tokens"][7], "rank": landed(c, [req(tokens)])[0]})
        scenario["skew"] = skew
        scenario["skew_stats"] = d.stats()["decisions"]
        result[method] = scenario

    # Without a dispatcher attached the hooks are inert: SGLang's round robin.
    plain = controller("round_robin")
    result["inert"] = landed(plain, [req(prefix + [1] * 200) for _ in range(4)])
    for s in pushes + pulls:
        s.close(linger=0)
    ctx.term()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
