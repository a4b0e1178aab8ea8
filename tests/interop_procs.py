"""NVIDIA Dynamo's standalone KV indexer (``python -m dynamo.indexer``) as a test subprocess.

Findings for ai-dynamo-runtime 1.6.1 (checked by tests/fanin/test_interop_dynamo.py):
- One registration per instance suffices: ``--workers "ID=tcp://host:port"`` or
  ``POST /register {"instance_id", "endpoint", "model_name", "block_size"[, "replay_endpoint"]}``.
  The indexer takes each batch's dp_rank from the batch's third field, so our one stream
  is scored per (worker, dp_rank).  ``ID:RANK=addr`` per rank would open N subscriptions
  to the same stream and apply every batch N times.
- It expects the publisher's seq to start at 0: our epoch-tagged seq is a "gap" to it.
  With a ``replay_endpoint`` it then asks our replay ROUTER for ``[0, first seq)``; seq 0
  is another epoch, so the fan-in answers with a snapshot, which the indexer applies.
- Its HTTP server listens on 0.0.0.0 (no host option in 1.6.1); tests talk to it on
  127.0.0.1 only, and every ZMQ address it gets is loopback.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

MODEL = "default"


class IndexerError(RuntimeError):
    pass


class DynamoIndexer:
    """The indexer process on a loopback HTTP port; ``close()`` always kills it."""

    def __init__(self, port: int, block_size: int, log_path: Path, workers: str | None = None) -> None:
        self.port = port
        self.block_size = block_size
        self.log_path = log_path
        cmd = [sys.executable, "-m", "dynamo.indexer", "--block-size", str(block_size), "--port", str(port)]
        cmd += ["--threads", "1", "--model-name", MODEL]
        if workers:
            cmd += ["--workers", workers]
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def request(self, method: str, path: str, body: Any = None, timeout_s: float = 5.0) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as reply:
                status, text = reply.status, reply.read().decode()
        except urllib.error.HTTPError as exc:
            status, text = exc.code, exc.read().decode()
        try:
            return status, json.loads(text) if text else None
        except json.JSONDecodeError:
            return status, text

    def wait_healthy(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise IndexerError(f"dynamo.indexer exited {self.proc.returncode}: {self.log()[-2000:]}")
            try:
                if self.request("GET", "/health", timeout_s=1.0)[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise IndexerError(f"dynamo.indexer not healthy in {timeout_s}s: {self.log()[-2000:]}")
            time.sleep(0.05)  # polling a starting HTTP server

    def register(self, instance_id: int, endpoint: str, replay_endpoint: str | None = None) -> None:
        body: dict[str, Any] = {
            "instance_id": instance_id,
            "endpoint": endpoint,
            "model_name": MODEL,
            "block_size": self.block_size,
        }
        if replay_endpoint:
            body["replay_endpoint"] = replay_endpoint
        status, reply = self.request("POST", "/register", body)
        if status >= 300:
            raise IndexerError(f"/register -> {status} {reply}")

    def scores(self, token_ids: list[int]) -> dict[str, dict[str, int]]:
        """``{worker: {dp_rank: matched tokens}}`` for a prompt."""
        status, reply = self.request("POST", "/query", {"model_name": MODEL, "token_ids": token_ids})
        if status != 200:
            raise IndexerError(f"/query -> {status} {reply}")
        scores: dict[str, dict[str, int]] = reply["scores"]
        return scores

    def workers(self) -> list[dict[str, Any]]:
        status, reply = self.request("GET", "/workers")
        if status != 200:
            raise IndexerError(f"/workers -> {status} {reply}")
        listed: list[dict[str, Any]] = reply
        return listed

    def dump_events(self) -> list[dict[str, Any]]:
        """The events of every indexed tree (``/dump`` groups them by model and routing group)."""
        status, reply = self.request("GET", "/dump")
        if status != 200:
            raise IndexerError(f"/dump -> {status} {reply}")
        return [event for tree in reply.values() for event in tree["events"]]

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
