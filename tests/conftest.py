"""Shared fixtures: a tiny randomly initialised policy and a TextWorldExpress environment."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> None:
    import torch

    from agentevo.models import placement

    torch.set_num_threads(1)
    _PRISTINE.update(settings=dict(placement._settings), threads=1)  # before any module fixture runs a run


_PRISTINE: dict = {}


@pytest.fixture(autouse=True)
def _steady_idle_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run samples the idle cores at its start (automatic torch threads, the busy warning). Tests see the same
    answer whatever else the machine runs: 1.4 idle, so an automatic count takes the session's 1 thread and a
    configured 2 (the demo's) does not warn. tests/test_machine.py patches its own values."""
    monkeypatch.setattr("agentevo.run.idle_cores", lambda: 1.4)


@pytest.fixture(autouse=True)
def _process_settings_restored():  # noqa: ANN202
    """A run started in-process (in a test or a module fixture) sets process-wide state: placement (model.dtype,
    device) and torch's thread count (model.torch_threads). Each test starts and ends at the session's starting
    values, so no test computes its reference forwards under another run's bf16 autocast."""
    import torch

    from agentevo.models import placement

    def reset() -> None:
        placement._settings.clear()
        placement._settings.update(_PRISTINE["settings"])
        torch.set_num_threads(_PRISTINE["threads"])

    reset()
    yield
    reset()


CORPUS = [
    "You are in the kitchen. In one part of the room you see a fridge that is closed. take knife open fridge",
    "Thought: I need the knife.\nAction: take knife",
    "Observation: You take the knife. Unknown action: I'm not sure what you mean.",
    "Your task is to cook a meal. Check the cookbook in the kitchen for the recipe.",
] * 20


@pytest.fixture(scope="session")
def tiny_policy():  # noqa: ANN201
    """A 2-layer tiny Llama with a tokenizer trained on a few game sentences (untrained weights)."""
    from agentevo.config import TinyModelConfig
    from agentevo.models.backend import TransformersPolicy
    from agentevo.models.tiny import build_tiny_model, train_tokenizer

    tok = train_tokenizer(CORPUS, 400)
    model = build_tiny_model(
        TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, max_positions=4096), tok, 0
    )
    model.eval()
    return TransformersPolicy(model, tok, "tiny", batch_size=8)


@pytest.fixture()
def twx_env():  # noqa: ANN201
    from agentevo.envs import make_env

    env = make_env("twx-cookingworld", n_train=8, n_dev=4, n_test=4)
    yield env
    env.close()


_EXIT_STATUS = {"value": 0}


def pytest_sessionfinish(session, exitstatus) -> None:  # noqa: ANN001
    _EXIT_STATUS["value"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:  # noqa: ANN001
    """fast-downward (ALFWorld's planner library, loaded through ctypes) segfaults in native teardown at
    interpreter exit; once it is loaded, leave without that teardown, keeping pytest's exit status."""
    import sys

    if "fast_downward" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS["value"])
