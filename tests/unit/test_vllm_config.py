"""rollout.engine: the settings the vLLM engine cannot honour are refused in one line, naming the
keys (these need no vLLM installed)."""

from __future__ import annotations

import pytest

from relayrl.config.extras import needed
from relayrl.config.schema import ConfigError, load_config


def test_vllm_with_top_p_below_1_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["run.backend=local", "rollout.engine=vllm", "rollout.top_p=0.9"])
    message = str(info.value)
    assert "\n" not in message and "rollout.top_p" in message and "rollout.engine" in message


def test_vllm_needs_the_local_backend_and_hf_stays_the_default() -> None:
    assert load_config(None, ["run.backend=local"]).rollout.engine == "hf"
    load_config(None, ["run.backend=local", "rollout.engine=hf", "rollout.top_p=0.9"])
    with pytest.raises(ConfigError, match=r"rollout.engine = 'vllm' needs run.backend = 'local'"):
        load_config(None, ["run.backend=sim", "rollout.engine=vllm"])


def test_the_vllm_engine_needs_the_vllm_extra() -> None:
    assert ("vllm", "vllm") not in [(m, e) for m, e, _ in needed(load_config(None, ["run.backend=local"]))]
    found = needed(load_config(None, ["run.backend=local", "rollout.engine=vllm"]))
    assert [(m, e) for m, e, _ in found][-1] == ("vllm", "vllm")
    assert "bash scripts/setup.sh --vllm" in found[-1][2]
