"""``generate_batch``: a whole list of prompts through a fresh continuous-batching engine, as
transformers v5's ``generate_batch``."""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
from tqdm.auto import tqdm

from genjax.config import GenerationConfig
from genjax.serving.config import ContinuousBatchingConfig
from genjax.serving.manager import init_continuous_batching
from genjax.serving.output import GenerationOutput

__all__ = ["generate_batch"]


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

    Request ids are ``req_0, req_1, ...`` in the order of ``inputs``, and the results come in
    that order. ``progress_bar`` draws a tqdm bar of the finished requests on a terminal (on
    ``sys.stderr``, as transformers does; nothing when it is not a terminal). ``timeout``
    bounds the whole call (None: no bound).
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
        finished = {}
        # disable=None: tqdm draws only when its stream is a terminal.
        with tqdm(total=len(ids), desc="generate_batch", unit="request",
                  disable=None if progress_bar else True) as bar:  # fmt: skip
            for _ in ids:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                output = manager.get_result(timeout=left)  # the next to finish
                if output is None:
                    break
                finished[output.request_id] = output
                bar.update(1)
        return {i: finished[i] for i in ids if i in finished}
    finally:
        manager.stop(block=True, timeout=30)
