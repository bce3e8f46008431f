"""``generate_batch``: a whole list of prompts through a fresh continuous-batching engine, as
transformers v5's ``generate_batch``."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import jax

from genjax.config import GenerationConfig
from genjax.serving.config import ContinuousBatchingConfig
from genjax.serving.manager import init_continuous_batching
from genjax.serving.output import GenerationOutput

__all__ = ["generate_batch"]

_log = logging.getLogger(__name__)


def generate_batch(
    model,
    params,
    inputs: Sequence[Sequence[int]],
    generation_config: GenerationConfig | None = None,
    progress_bar: bool = False,
    *,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    tokenizer=None,
    timeout: float | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> dict[str, GenerationOutput]:
    """Runs every prompt of ``inputs`` through a fresh engine; returns ``{request_id: output}``.

    Request ids are ``req_0, req_1, ...`` in the order of ``inputs``. ``progress_bar`` logs the
    number of finished requests. ``timeout`` bounds the whole call (None: no bound).
    ``continuous_batching_config``, ``tokenizer`` and ``mesh`` are
    :func:`~genjax.serving.init_continuous_batching`'s.

    Example:
        >>> sizes = ContinuousBatchingConfig(max_batch_size=2, max_length=64)
        >>> prompts = [[483, 288, 860], [794, 664]]
        >>> batched = dict(continuous_batching_config=sizes)
        >>> results = generate_batch(model, params, prompts, config, **batched)
        >>> results["req_0"].generated_tokens
        [267, 342, 783, 328]
    """
    manager = init_continuous_batching(
        model, params, generation_config, continuous_batching_config, tokenizer, mesh
    )
    manager.start()
    try:
        ids = manager.add_requests(inputs)
        deadline = None if timeout is None else time.monotonic() + timeout
        results = {}
        for i, request_id in enumerate(ids):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            output = manager.get_result(request_id, timeout=left)
            if output is not None:
                results[request_id] = output
            if progress_bar:
                _log.info("generate_batch: %d / %d requests finished", i + 1, len(ids))
        return results
    finally:
        manager.stop(block=True, timeout=30)
