"""The typed contract of each plugin kind. A plugin implements one of these and registers it through a hook.

The names are imported on first use (PEP 562): the contracts of kinds that run tensors import torch, which a command
such as ``rtx --help`` should not wait for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rtxcore.contracts.authenticator import (
        AuthenticationFailed,
        Authenticator,
        AuthenticatorContext,
        AuthenticatorExample,
        Credentials,
    )
    from rtxcore.contracts.backend import BackendCapabilities, BackendOptions, ExecutionBackend, ForwardBatch
    from rtxcore.contracts.eviction import EvictionPolicy
    from rtxcore.contracts.logits_processor import LogitsProcessor, LogitsProcessorContext, RowContext
    from rtxcore.contracts.proposer import Proposer, ProposerContext
    from rtxcore.contracts.quantizer import LayerStats, QuantizedTensor, Quantizer
    from rtxcore.contracts.sampler import Sampler, SamplerOutput, SamplingBatch
    from rtxcore.contracts.scheduler import KVCacheAllocator, Scheduler, SchedulerConfig, SchedulerOutput

_MODULES = {
    "authenticator": ("AuthenticationFailed", "Authenticator", "AuthenticatorContext", "AuthenticatorExample",
                      "Credentials"),
    "backend": ("BackendCapabilities", "BackendOptions", "ExecutionBackend", "ForwardBatch"),
    "eviction": ("EvictionPolicy",),
    "logits_processor": ("LogitsProcessor", "LogitsProcessorContext", "RowContext"),
    "proposer": ("Proposer", "ProposerContext"),
    "quantizer": ("LayerStats", "QuantizedTensor", "Quantizer"),
    "sampler": ("Sampler", "SamplerOutput", "SamplingBatch"),
    "scheduler": ("KVCacheAllocator", "Scheduler", "SchedulerConfig", "SchedulerOutput"),
}
_WHERE = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    "AuthenticationFailed", "Authenticator", "AuthenticatorContext", "AuthenticatorExample", "Credentials",
    "BackendCapabilities", "BackendOptions", "ExecutionBackend", "ForwardBatch",
    "EvictionPolicy",
    "LogitsProcessor", "LogitsProcessorContext", "RowContext",
    "Proposer", "ProposerContext",
    "LayerStats", "QuantizedTensor", "Quantizer",
    "Sampler", "SamplerOutput", "SamplingBatch",
    "KVCacheAllocator", "Scheduler", "SchedulerConfig", "SchedulerOutput",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"rtxcore.contracts.{module}"), name)
