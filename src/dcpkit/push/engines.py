"""The engines a push reaches, each behind the same few calls: a vLLM server's weight-update
endpoints (``http://HOST:PORT``, started with ``VLLM_SERVER_DEV_MODE=1``) or an ``LLM`` object
in the trainer's own process. Every failure is an ``EngineError`` that names the engine."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


class EngineError(RuntimeError):
    """An inference engine refused a push, or could not be reached; the message names it."""


class HttpEngine:
    """A vLLM OpenAI-compatible server, through its weight-update endpoints."""

    def __init__(self, url: str, timeout_s: float = 300.0) -> None:
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.name = self.url

    def _call(self, path: str, body: dict | None = None, method: str = "POST") -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                return json.loads(answer.read() or b"null")
        except urllib.error.HTTPError as e:
            said = e.read()[:400].decode(errors="replace")
            hint = " (was it started with VLLM_SERVER_DEV_MODE=1?)" if e.code == 404 else ""
            raise EngineError(f"the engine at {self.url}: {path} answered {e.code}{hint}: "
                              f"{said}") from None  # fmt: skip
        except OSError as e:
            raise EngineError(f"the engine at {self.url} cannot be reached ({path}): {e}") from e

    def world_size(self) -> int:
        return int(self._call("/get_world_size?include_dp=true", method="GET")["world_size"])

    def init(self, info: dict) -> None:
        self._call("/init_weight_transfer_engine", {"init_info": info})

    def start(self) -> None:
        self._call("/start_weight_update", {})

    def update(self, info: dict) -> None:
        self._call("/update_weights", {"update_info": info})

    def finish(self, version: str | None) -> None:
        self._call("/finish_weight_update", {"weight_version": version})

    def pause(self) -> None:
        self._call("/pause?mode=keep", {})

    def resume(self) -> None:
        self._call("/resume", {})

    def version(self) -> str | None:
        return self._call("/weight_info", method="GET").get("weight_version")


class LocalEngine:
    """A ``vllm.LLM`` in this process (its generation runs between the calls a push makes, so
    there is nothing to pause)."""

    def __init__(self, llm: Any) -> None:
        self.llm, self.name = llm, f"the in-process engine {type(llm).__name__}"

    def _call(self, what: str, *args: Any) -> Any:
        try:
            return getattr(self.llm, what)(*args)
        except Exception as e:
            raise EngineError(f"{self.name}: {what} failed: {e}") from e

    def world_size(self) -> int:
        pc = self.llm.llm_engine.vllm_config.parallel_config
        return int(pc.world_size * pc.data_parallel_size)

    def init(self, info: dict) -> None:
        self._call("init_weight_transfer_engine", {"init_info": info})

    def start(self) -> None:
        self._call("start_weight_update")

    def update(self, info: dict) -> None:
        self._call("update_weights", {"update_info": info})

    def finish(self, version: str | None) -> None:
        self._call("finish_weight_update", version)

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def version(self) -> str | None:
        return self._call("get_weight_version")


def engine_for(target: Any, timeout_s: float = 300.0) -> HttpEngine | LocalEngine:
    """The engine ``target`` names: a URL, an ``LLM`` object, or an engine already."""
    if isinstance(target, HttpEngine | LocalEngine):
        return target
    if isinstance(target, str):
        if not target.startswith(("http://", "https://")):
            raise EngineError(f"{target!r}: an engine is the URL of a vLLM server "
                              "(http://HOST:PORT) or an LLM object")  # fmt: skip
        return HttpEngine(target, timeout_s)
    if callable(getattr(target, "update_weights", None)):
        return LocalEngine(target)
    raise EngineError(f"{type(target).__name__} is no engine: give the URL of a vLLM server "
                      "(http://HOST:PORT) or a vllm.LLM")  # fmt: skip
