"""Serving many users at once: the continuous-batching engine.

``engine`` is the device side's state (paged KV cache :class:`genjax.cache.PagedKVCache`, token
history, per-row sampling values) and sizes, ``step`` its two pure jitted programs per step (a
prompt chunk, then the decode loop) over that donated state; ``choosing`` the
per-row token choice inside it; ``constraint_pool`` the structured-output automata the engine
shares among requests; ``scheduler`` the host side (block allocator, FIFO admission, chunked
prefill, preemption); ``options`` checks a request's generation options; ``config`` holds the
engine's static sizes; ``output`` is what a request gives back; ``manager`` runs the loop in a
background thread behind transformers v5's continuous-batching API (``init_continuous_batching``;
``batch`` holds ``generate_batch``). ``protocol``, ``guided``, ``server`` and ``runner`` make the
OpenAI-compatible server.

Layer:
    Floor 5. May import every floor below, ``generation`` included.
"""

from genjax.serving.batch import generate_batch
from genjax.serving.choosing import RowSettings, Scored
from genjax.serving.engine import EngineShape, EngineState, StepInput, StepOutput, init_state
from genjax.serving.manager import (
    ContinuousBatchingConfig,
    ContinuousBatchingManager,
    init_continuous_batching,
)
from genjax.serving.output import GenerationOutput
from genjax.serving.scheduler import BlockAllocator, RequestStatus, Scheduler
from genjax.serving.step import compile_step, engine_step

__all__ = [
    "BlockAllocator",
    "ContinuousBatchingConfig",
    "ContinuousBatchingManager",
    "EngineShape",
    "EngineState",
    "GenerationOutput",
    "RequestStatus",
    "RowSettings",
    "Scheduler",
    "Scored",
    "StepInput",
    "StepOutput",
    "compile_step",
    "engine_step",
    "generate_batch",
    "init_continuous_batching",
    "init_state",
]
