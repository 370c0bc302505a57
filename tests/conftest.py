"""Shared fixtures: engines on the real default model and on a tiny random-weight model."""

from __future__ import annotations

import os

import torch

# Without a GPU, Triton kernels can only run in its interpreter; the variable must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Tests must never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from rtxcore.hf_transformers import unshadow_hub_kernels  # noqa: E402

# pytest puts the checkout's root on sys.path, where kernels/ would shadow the `kernels` that transformers imports.
unshadow_hub_kernels()

from rtxcore.engine.config import EngineConfig  # noqa: E402
from rtxcore.engine.llm import LLM  # noqa: E402
from rtxcore.models.resolve import default_model_path, resolve_model  # noqa: E402
from rtxcore.registry import load_plugins  # noqa: E402
from tests.helpers.engines import make_engine  # noqa: E402


@pytest.fixture(scope="session")
def registry():
    return load_plugins()


@pytest.fixture(scope="session")
def default_source():
    return resolve_model(None)


@pytest.fixture(scope="session")
def default_model_file():
    return default_model_path()


@pytest.fixture(scope="session")
def default_engine(registry, default_source):
    """One engine on the real model for the whole session; tests must leave it idle."""
    engine = LLM(EngineConfig(), registry=registry, source=default_source)
    yield engine
    assert not engine.has_unfinished_requests()


@pytest.fixture
def tiny_engine(registry):
    return make_engine(registry=registry)
