"""The ``sglang`` rollout engine: the engine contract (``rlx.plugins.testing``) wherever sglang imports (engine mode)
or a
server is given (``RLX_SGLANG_SERVER_URL``: a server started on a model of the built-in tiny Qwen2's
architecture, e.g. ``python -m sglang.launch_server --model-path MODEL --enable-deterministic-inference``), and
the messages a user sees without sglang or without a reachable server."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from typing import Any

import pytest

from rlx.plugins.testing import RolloutEngineContract

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
SERVER_URL = os.environ.get("RLX_SGLANG_SERVER_URL")


@pytest.mark.sglang
class TestSGLangEngineContract(RolloutEngineContract):
    log_probs_after_filters = False  # SGLang reports log_softmax(logits / temperature) before top-k / top-p

    def make_engine(self, model_path: str, tokenizer: Any) -> Any:
        from rlx.plugins.rollout.sglang import SGLangRollout, SGLangRolloutOptions

        options = SGLangRolloutOptions(dtype="float32", enable_deterministic_inference=True, weight_bucket_mb=0.01)
        return SGLangRollout(model_path, options, eos_token_ids=[tokenizer.eos_token_id],
                             pad_token_id=tokenizer.pad_token_id, seed=0, context_length=256)


@pytest.mark.skipif(SERVER_URL is None, reason="needs a running SGLang server (RLX_SGLANG_SERVER_URL)")
class TestSGLangServerContract(RolloutEngineContract):
    log_probs_after_filters = False

    @pytest.fixture(scope="class")
    def weights_dir(self, tmp_path_factory: pytest.TempPathFactory) -> str:
        return str(tmp_path_factory.mktemp("sglang_weights"))

    @pytest.fixture(scope="class")
    def engine(self, contract_policies: dict[str, Any], weights_dir: str) -> Any:
        from rlx.plugins.rollout.sglang import SGLangRollout, SGLangRolloutOptions

        tok = contract_policies["tokenizer"]
        options = SGLangRolloutOptions(server_url=SERVER_URL, weights_dir=weights_dir, weight_bucket_mb=0.01)
        engine = SGLangRollout(contract_policies["a_path"], options, eos_token_ids=[tok.eos_token_id],
                               pad_token_id=tok.pad_token_id, seed=0, context_length=256)
        # The server was started on some model of this architecture: the contract's first policy goes in first.
        engine.update_weights(contract_policies["a"].state_dict().items())
        yield engine
        engine.close()


def rlx_train(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "rlx", "train", "--rollout", "sglang",
                           f"trainer.output_dir={tmp_path / 'run'}", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(HAS_SGLANG, reason="checks the message shown when sglang is not installed")
def test_without_sglang_one_message_with_the_install_command(tmp_path):
    res = rlx_train(tmp_path)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    assert "needs the Python package `sglang`" in res.stderr and "pip install 'rlx[sglang]'" in res.stderr
    assert not (tmp_path / "run").exists()


def test_server_mode_needs_a_weights_folder_and_an_http_address(tmp_path):
    res = rlx_train(tmp_path, "rollout.server_url=localhost:30000")
    assert res.returncode == 2, res.stderr
    assert "rollout.server_url: 'localhost:30000' is not an http:// or https:// address" in res.stderr
    assert "rollout.weights_dir: server mode needs a folder the server can read" in res.stderr


def test_an_unreachable_server_is_a_user_error(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = rlx_train(tmp_path, f"rollout.server_url=http://127.0.0.1:{port}", f"rollout.weights_dir={tmp_path / 'w'}",
                    "trainer.total_steps=1")
    assert res.returncode == 2, res.stderr
    assert f"Cannot reach the SGLang server at http://127.0.0.1:{port}" in res.stderr
    assert "Traceback" not in res.stderr
