"""``BlockRemoved.reason``: given at the source, carried by the wire, skipped by older readers.

Real parts: SGLang 0.5.23's RadixCache / UnifiedRadixCache (Python core) on CPU with the
release hooks, SGLang's own ``KVEventBatch`` encoder and decoder, the project's decoder as of
the commit before the field existed (run from a ``git archive`` of it in a subprocess).
Dynamo's indexer reading removals with a reason: tests/fanin/test_folded_view.py (map encoding).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from sglang_kvpub import wire
from sglang_kvpub.engine.removal_reasons import give_reasons, reasoned_removal

pytest.importorskip("torch")
pytest.importorskip("sglang")

from bench import rh_trees as rt

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
BEFORE_THE_FIELD = "5508b78"  # the last commit whose wire.BlockRemoved had no reason


def _kv_events() -> Any:
    from sglang.srt.disaggregation import kv_events

    return kv_events


@pytest.mark.parametrize("make", [rt.legacy_tree, rt.unified_tree], ids=["legacy", "unified"])
def test_a_capacity_eviction_is_published_with_its_reason(make: Any) -> None:
    n = rt.setup()
    tree = make(n, 4)
    rt.insert(n, tree, list(range(1, 17)))
    rt.insert(n, tree, list(range(1, 9)) + [7] * 8)
    tree.take_events()
    tree.evict(n.base.EvictParams(num_tokens=8))
    removed = [e for e in tree.take_events() if type(e).__name__ == "BlockRemoved"]
    assert removed and {e.reason for e in removed} == {wire.REASON_CAPACITY}
    # the adopter (the rank publisher's per-step path) keeps it
    batch = _kv_events().KVEventBatch(ts=1.0, events=removed)
    adopted = wire.adopt_batch(batch, dp_rank=0, block_size=4)
    assert adopted is not None and {e.reason for e in adopted.events} == {wire.REASON_CAPACITY}


def test_reasons_follow_the_medium_and_the_host_copy() -> None:
    module = _kv_events()
    gpu, cpu = module.StorageMedium.GPU, module.StorageMedium.CPU
    events: list[Any] = [
        module.BlockRemoved(block_hashes=[1], medium=gpu),  # no host copy: capacity
        module.BlockRemoved(block_hashes=[2], medium=gpu),  # host copy announced: demoted
        module.BlockRemoved(block_hashes=[3], medium=cpu),  # host copy gone
        reasoned_removal(module.BlockRemoved(block_hashes=[4], medium=gpu), wire.REASON_OTHER),  # kept
        module.AllBlocksCleared(),
    ]
    assert give_reasons(events, {wire.MEDIUM_CPU: {2: 0}}) == 3
    assert [getattr(e, "reason", None) for e in events] == [
        wire.REASON_CAPACITY,
        wire.REASON_DEMOTED,
        wire.REASON_HOST_EVICTED,
        wire.REASON_OTHER,
        None,
    ]
    assert all(isinstance(e, module.BlockRemoved) for e in events[:4])


def _encoded_with_reasons() -> bytes:
    """A batch as SGLang's own encoder writes the reasoned events (the rank's general path)."""
    module = _kv_events()
    removed = reasoned_removal(
        module.BlockRemoved(block_hashes=[11, 12], medium=module.StorageMedium.GPU), wire.REASON_CAPACITY
    )
    stored = module.BlockStored(
        block_hashes=[13], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4, lora_id=None, medium="GPU"
    )
    return msgspec.msgpack.encode(module.KVEventBatch(ts=1.0, events=[stored, removed], attn_dp_rank=1))


def test_readers_that_do_not_know_the_reason_skip_it() -> None:
    module = _kv_events()
    payload = _encoded_with_reasons()
    assert b"reason" in payload
    # SGLang 0.5.23's own decoder: the same events, the key ignored
    theirs = msgspec.msgpack.Decoder(module.KVEventBatch).decode(payload)
    assert [type(e).__name__ for e in theirs.events] == ["BlockStored", "BlockRemoved"]
    assert theirs.events[1].block_hashes == [11, 12]
    # ours, now: the reason read
    ours = wire.BatchDecoder().decode(payload)
    assert isinstance(ours.events[1], wire.BlockRemoved) and ours.events[1].reason == wire.REASON_CAPACITY
    # the instance stream in both encodings: map keeps the reason, array leaves it off (a
    # positional reader would take a trailing string for another field)
    assert wire.BatchDecoder().decode(wire.BatchEncoder("map").encode(ours)).events[1].reason == wire.REASON_CAPACITY
    array = msgspec.msgpack.decode(wire.BatchEncoder("array").encode(ours))
    assert array[1][1] == ["BlockRemoved", [11, 12], "GPU"]


def test_the_project_decoder_before_the_field_reads_reasoned_batches(tmp_path: Path) -> None:
    """The decoder of the commit before the field, from git, decodes both encodings."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", BEFORE_THE_FIELD, "sglang_kvpub/__init__.py", "sglang_kvpub/wire"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive, check=True)
    ours = wire.BatchDecoder().decode(_encoded_with_reasons())
    payloads = [wire.BatchEncoder(encoding).encode(ours).hex() for encoding in ("map", "array")]
    payloads.append(_encoded_with_reasons().hex())
    code = (
        "import json, sys\n"
        "from sglang_kvpub import wire\n"
        "assert not hasattr(wire, 'REMOVAL_REASONS'), wire.__file__\n"
        "out = []\n"
        "for p in json.loads(sys.argv[1]):\n"
        "    b = wire.BatchDecoder().decode(bytes.fromhex(p))\n"
        "    out.append([[type(e).__name__, list(getattr(e, 'block_hashes', []))] for e in b.events])\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(payloads)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    expected = [["BlockStored", [13]], ["BlockRemoved", [11, 12]]]
    assert json.loads(done.stdout) == [expected, expected, expected]


def test_the_adapter_counts_removed_blocks_by_rank_and_reason() -> None:
    """A real fan-in (sidecar path) on loopback, the adapter's stream subscriber, its metrics."""
    import time

    import zmq
    from conftest import free_tcp_port

    from motor_adapter.adapter_metrics import AdapterMetrics
    from motor_adapter.http_contract import as_dict
    from motor_adapter.stream import StreamSubscriber
    from sglang_kvpub.config import PluginConfig
    from sglang_kvpub.core.index import PrefixIndex
    from sglang_kvpub.publish.fanin import FanIn

    config = PluginConfig(
        endpoint=f"tcp://127.0.0.1:{free_tcp_port()}",
        bind=True,
        replay_endpoint=f"tcp://127.0.0.1:{free_tcp_port()}",
        heartbeat_s=0.1,
        load_report_s=0,
    )
    fanin = FanIn(config, 2, listen_channel=False)
    fanin.start()
    ctx: zmq.Context[Any] = zmq.Context()
    index = PrefixIndex(4)
    sub = StreamSubscriber("inst", config.endpoint, index, replay_endpoint=config.replay_endpoint, context=ctx)
    sub.start()
    seqs = {0: 0, 1: 0}

    def send(rank: int, *events: wire.Event) -> None:
        fanin.ingest(rank, 5, seqs[rank], wire.EventBatch(ts=time.time(), events=list(events)))
        seqs[rank] += 1

    def stored(hashes: list[int]) -> wire.BlockStored:
        return wire.BlockStored(hashes, None, list(range(4 * len(hashes))), 4, None, wire.MEDIUM_GPU)

    try:
        assert sub.wait_for(lambda h: h.snapshots >= 1 or h.batches > 0, 20)
        send(0, stored([1, 2, 3]))
        send(1, stored([11, 12]))
        send(0, wire.BlockRemoved([3, 2], wire.MEDIUM_GPU, wire.REASON_CAPACITY))
        send(1, wire.BlockRemoved([12], wire.MEDIUM_GPU, wire.REASON_DEMOTED))
        send(1, wire.BlockRemoved([11], wire.MEDIUM_GPU))  # no reason given
        want = {(0, wire.REASON_CAPACITY): 2, (1, wire.REASON_DEMOTED): 1, (1, wire.REASON_UNKNOWN): 1}
        assert sub.wait_for(lambda h: h.removed == want, 20), sub.health()
        text = AdapterMetrics().render({("m", "default", 4, config.endpoint): [sub.health()]}, [])
        labels = 'engine_dp_rank="0",instance="inst",model="m",reason="capacity_eviction"'
        line = "motor_kv_adapter_removed_blocks_total{" + labels + "} 2"
        assert line in text, text
        # /workers and /explain answer the same health in JSON, the removals nested by rank
        shown = json.loads(json.dumps(as_dict(sub.health())))
        assert shown["removed"] == {"0": {"capacity_eviction": 2}, "1": {"demoted_to_host": 1, "unknown": 1}}
    finally:
        sub.stop()
        fanin.stop()
        ctx.term()


def test_the_rust_cores_recorder_gets_reasons_from_its_own_events() -> None:
    """The Rust core's recorder never passes through ``KVCacheEventRecorder.take``: its own
    hook follows the host copies in the events it hands out (the recorder stands in for
    ``_RustKVCacheEventRecorder``, whose module needs the server's shims to import)."""
    from sglang_kvpub.engine.removal_reasons import rust_take_hook

    module = _kv_events()
    gpu, cpu = module.StorageMedium.GPU, module.StorageMedium.CPU

    class Recorder:
        def __init__(self) -> None:
            self.queue: list[Any] = []

        def take(self) -> list[Any]:
            taken, self.queue = self.queue, []
            return taken

    recorder = Recorder()
    recorder.queue = [
        module.BlockStored(
            block_hashes=[5], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4, lora_id=None, medium=cpu
        ),
        module.BlockRemoved(block_hashes=[5], medium=gpu),
        module.BlockRemoved(block_hashes=[6], medium=gpu),
    ]
    first = rust_take_hook(Recorder.take, recorder)
    recorder.queue = [
        module.BlockRemoved(block_hashes=[5], medium=cpu),
        module.BlockRemoved(block_hashes=[5], medium=gpu),
    ]
    second = rust_take_hook(Recorder.take, recorder)
    reasons = [getattr(e, "reason", None) for e in first + second]
    assert reasons == [None, wire.REASON_DEMOTED, wire.REASON_CAPACITY, wire.REASON_HOST_EVICTED, wire.REASON_CAPACITY]
