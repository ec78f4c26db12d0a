"""Optional dependencies: a config names what it needs, and a missing package is one clear error."""

from __future__ import annotations

import pytest

from relayrl.config.extras import MissingExtra, check_extras, is_installed, needed, require
from relayrl.config.schema import OPTIONAL_SINKS, SINK_EXTRAS, SINK_MODULES, Config, TelemetryConfig, load_config
from relayrl.recipes import default_recipe


def test_require_names_the_extra() -> None:
    require("json", "local")  # installed: nothing happens
    with pytest.raises(MissingExtra) as info:
        require("relayrl_no_such_module", "tensorboard", "the tensorboard metric sink")
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert "'relayrl_no_such_module'" in message and "pip install 'relayrl[tensorboard]'" in message
    assert "the tensorboard metric sink" in message
    assert not is_installed("relayrl_no_such_module.sub")


def test_needed_follows_the_config() -> None:
    assert needed(Config()) == []  # sim backend, no sinks
    local = load_config(default_recipe())
    assert [(m, e) for m, e, _ in needed(local)] == [("torch", "local"), ("transformers", "local")]
    cfg = Config(telemetry=TelemetryConfig(sinks=list(OPTIONAL_SINKS)))
    assert [(m, e) for m, e, _ in needed(cfg)] == [(SINK_MODULES[s], SINK_EXTRAS[s]) for s in OPTIONAL_SINKS]
    check_extras(cfg)  # the dev extra installs every sink


def test_sink_names_have_one_source() -> None:
    assert OPTIONAL_SINKS == ("tensorboard", "wandb", "mlflow")
    with pytest.raises(ValueError, match="telemetry.sinks"):
        load_config(default_recipe(), ['telemetry.sinks=["nope"]'])
