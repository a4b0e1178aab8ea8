"""Drives the installed mindie-motor's REAL conductor client and kv_cache_affinity policy.

Run as a child process (Motor reads its config when ``ConductorApiClient`` is defined and keeps
process-wide singletons - its logger, ``TokenizerManager`` - so each test gets a fresh
process; nothing of Motor is stubbed). The parent sets ``USER_CONFIG_PATH`` and
``KV_CONDUCTOR_SERVICE``. Commands: one JSON object per stdin line; answers: ``@@ <json>``
lines on stdout (Motor's own log lines go to stdout too, unprefixed).

Commands: ``{"op": "register", "instances": [{"id", "ip"}], "role"}``, ``{"op": "select",
"prompt"}`` -> ``{"instance", "endpoint"}`` (nulls: Motor fell back), ``{"op": "query",
"prompt"}`` -> the conductor answer Motor received, ``{"op": "unregister"}``, ``{"op": "stop"}``.
"""

from __future__ import annotations

import json
import sys
import uuid
from typing import Any


def _instances(specs: list[dict[str, Any]], model: str, role: str) -> list[Any]:
    from motor.common.resources.endpoint import Endpoint, EndpointStatus
    from motor.common.resources.instance import InsStatus, Instance, ParallelConfig

    out = []
    for spec in specs:
        inst = Instance(
            job_name=f"sglang-{spec['id']}",
            model_name=model,
            id=spec["id"],
            role=role,
            status=InsStatus.ACTIVE,
            parallel_config=ParallelConfig(dp_size=spec.get("dp_size", 1)),
        )
        endpoint = Endpoint(id=0, ip=spec["ip"], business_port="8000", mgmt_port="8000", status=EndpointStatus.NORMAL)
        inst.add_endpoints(spec["ip"], {0: endpoint})
        out.append(inst)
    return out


def main() -> None:
    from motor.coordinator.api_client.conductor_api_client import ConductorApiClient
    from motor.coordinator.models.request import RequestInfo
    from motor.coordinator.scheduler.policy.kv_cache_affinity import KvCacheAffinityPolicy, TokenizerManager

    model = sys.argv[1]
    # As Motor's inference worker starts: the tokenizer singleton from the loaded user config
    # (constructed without one it would read no model path and encode every prompt to []).
    TokenizerManager(ConductorApiClient.coordinator_config)
    instances: list[Any] = []
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        answer: Any = None
        if op == "register":
            instances = _instances(command["instances"], model, command.get("role", "prefill"))
            ConductorApiClient.register_kv_instance(instances)
        elif op == "unregister":
            ConductorApiClient.unregister_kv_instance(instances)
        elif op == "query":
            answer = ConductorApiClient.query_conductor(instances, TokenizerManager().encode(command["prompt"]))
        elif op == "select":
            body = {"model": model, "prompt": command["prompt"], "max_tokens": 1}
            req = RequestInfo(
                req_id=uuid.uuid4().hex, req_data=body, req_len=len(json.dumps(body)), api="v1/completions"
            )
            picked = KvCacheAffinityPolicy.select_endpoint_from_list(instances, req)
            answer = {"instance": picked[0].id, "endpoint": picked[1].id} if picked else {"instance": None}
        elif op == "stop":
            return
        print("@@ " + json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
