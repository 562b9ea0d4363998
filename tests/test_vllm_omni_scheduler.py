"""tests/test_vllm_scheduler.py's tests again, the runner calling the cache where vLLM-Omni's
``GPUARModelRunner`` does: through the hooks `VllmOmniPrefixCacheMixin` serves
(``_prefix_cache_step_begin``, ``_prefix_cache_save_step`` with the row order in
``input_batch.req_ids``, ``_prefix_cache_materialize`` → ``(hidden, mm)``; tests/vllm_sched_driver.py's
`OmniHooksRunner`), the cache gated where vLLM-Omni stages its config. vLLM 0.33's real scheduler
makes every decision, and every request's rows are checked bit for bit against its full
sequence, as there. Skipped where vLLM cannot be imported (run with `just test-vllm`'s environment).
"""

from __future__ import annotations

import logging
import random
import warnings

import pytest

from vllm_replay import import_vllm_or_skip

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import_vllm_or_skip()
    import vllm_sched_driver as d
    from test_vllm_scheduler import *  # noqa: F403 (each of its tests, collected here again)
    from vllm_sched_driver import Req, check_full_sequences, make_stage, run


@pytest.fixture(autouse=True)
def omni_hooks_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    """`run` builds `OmniHooksRunner`s in this module's tests."""
    monkeypatch.setattr(d, "RUNNER_CLS", d.OmniHooksRunner)


def test_runs_here_go_through_vllm_omnis_hooks() -> None:
    rng = random.Random(3)
    prefix = [rng.randrange(3, d.VOCAB) for _ in range(24)]
    reqs = [Req("a", [*prefix, 5], max_tokens=4), Req("b", [*prefix, 6, 7], max_tokens=4, arrival=8)]
    result = run(make_stage(), reqs)
    check_full_sequences(result)
    assert type(result.runner) is d.OmniHooksRunner
    assert result.counters.first_computed == {"a": 0, "b": 24} and result.stats.hits == 1


def test_vllms_plugin_loader_finds_the_plugin_and_off_it_does_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # (as vLLM loads general plugins in every process it starts, before it builds the worker)
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    from omni_pcache.vllm.omni_runner import ENABLE_ENV, vllm_plugin

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)  # (when set, only the plugins it names load)
    monkeypatch.delenv(ENABLE_ENV, raising=False)
    plugins = load_plugins_by_group(group=DEFAULT_PLUGINS_GROUP)
    assert plugins["omni_pcache_vllm_omni"] is vllm_plugin
    with caplog.at_level(logging.INFO, logger="vllm.omni_pcache"):
        plugins["omni_pcache_vllm_omni"]()
    assert caplog.text == ""  # (off: nothing imported, nothing logged)
    monkeypatch.setenv(ENABLE_ENV, "1")  # (on, in a process without vLLM-Omni: a warning, never a raise)
    with caplog.at_level(logging.INFO, logger="vllm.omni_pcache"):
        plugins["omni_pcache_vllm_omni"]()
    assert "not installed in vLLM-Omni's AR worker" in caplog.text
