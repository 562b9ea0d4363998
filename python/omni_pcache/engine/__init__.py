"""The embedded engine: a small, faithful stand-in for a vLLM v1 engine (block pool with
prefix caching, scheduler, paged-KV model, async output path) for the demo and the tests."""

from omni_pcache.engine.engine import Engine, EngineConfig, EngineResult, RequestOutput
from omni_pcache.engine.workloads import WORKLOADS, make_workload

__all__ = ["WORKLOADS", "Engine", "EngineConfig", "EngineResult", "RequestOutput", "make_workload"]
