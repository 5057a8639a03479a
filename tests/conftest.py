"""Shared test set-up: one cache of built-in resources per session, and clean skips for hardware."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

# The tests mirror the source tree (tests/core, tests/plugins/<kind>, tests/cli, tests/e2e); some import
# helpers of a test module in another folder (`from test_backend_torch import make_batch`).
for _folder in sorted({str(p.parent) for p in Path(__file__).parent.rglob("test_*.py")}):
    if _folder not in sys.path:
        sys.path.append(_folder)


@pytest.fixture(scope="session", autouse=True)
def rlx_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Built-in resources (tiny model, synthetic data) are written once per session, here."""
    path = os.environ.get("RLX_TEST_CACHE") or str(tmp_path_factory.mktemp("rlx-cache"))
    os.environ["RLX_CACHE"] = path
    return path


@pytest.fixture(scope="session")
def tiny_model_path(rlx_cache: str) -> str:
    """The built-in tiny Qwen2 model folder (written once per session)."""
    from rlx.plugins.tasks import builtin

    return builtin.resolve("builtin:tiny-qwen2")


@pytest.fixture
def one_thread():
    """One torch thread: on the tiny model a second thread costs more than it gives."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skips = {
        "gpu": (_has_gpu, "needs a CUDA GPU"),
        "vllm": (lambda: _has("vllm"), "needs vllm (pip install 'rlx[vllm]')"),
        "sglang": (lambda: _has("sglang"), "needs sglang (pip install 'rlx[sglang]')"),
    }
    for item in items:
        for mark, (available, reason) in skips.items():
            if mark in item.keywords and not available():
                item.add_marker(pytest.mark.skip(reason=reason))
