"""The recorded encoder-decoder checkpoints of ``tests/fixtures/encdec/<name>`` (T5, BART, mBART,
Marian), loaded once per test process and shared by the files that generate with them."""

from __future__ import annotations

import functools
import os

import numpy as np

from genjax.models import from_pretrained

FOLDER = os.path.join(os.path.dirname(__file__), "fixtures", "encdec")


@functools.cache
def recorded_model(name: str):
    """The genjax model, params and source batch (``src_ids``, ``src_mask``) of ``name``."""
    folder = os.path.join(FOLDER, name)
    model, params = from_pretrained(folder)
    with np.load(os.path.join(folder, "records.npz")) as records:
        return model, params, records["src_ids"], records["src_mask"]
