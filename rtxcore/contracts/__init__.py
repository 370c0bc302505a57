"""The typed contract of each plugin kind. A plugin implements one of these and registers it through a hook."""

from rtxcore.contracts.backend import BackendCapabilities, BackendOptions, ExecutionBackend, ForwardBatch
from rtxcore.contracts.eviction import EvictionPolicy
from rtxcore.contracts.proposer import Proposer, ProposerContext
from rtxcore.contracts.quantizer import LayerStats, QuantizedTensor, Quantizer
from rtxcore.contracts.sampler import Sampler, SamplerOutput, SamplingBatch
from rtxcore.contracts.scheduler import KVCacheAllocator, Scheduler, SchedulerConfig, SchedulerOutput

__all__ = [
    "BackendCapabilities", "BackendOptions", "ExecutionBackend", "ForwardBatch",
    "EvictionPolicy",
    "Proposer", "ProposerContext",
    "LayerStats", "QuantizedTensor", "Quantizer",
    "Sampler", "SamplerOutput", "SamplingBatch",
    "KVCacheAllocator", "Scheduler", "SchedulerConfig", "SchedulerOutput",
]
