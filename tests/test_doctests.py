"""Every ``>>>`` example in genjax's docstrings runs as a doctest (ELLIPSIS, NORMALIZE_WHITESPACE).

Examples may use these names without defining them, built once per session: ``jax``, ``jnp``,
``np``, ``genjax``; ``model, params`` (the bundled ``genjax-tiny``, a 4-layer Llama); ``tok``
(its tokenizer); ``ids, mask`` (int32[2, 3], ``tok(["def f():", "import os"])``, left-padded);
``config`` (greedy ``GenerationConfig(max_new_tokens=4)``); ``mesh``
(``genjax.sharding.make_mesh((2, 4))`` over the 8 virtual CPU devices of ``conftest.py``: the
model's 4 attention heads do not divide over 8).
Reuse ``ids``, ``mask`` and ``config`` where an example calls ``generate``, so that the examples
share a few compiled programs. Only an example that needs the network, files that do not exist or
several processes is marked ``# doctest: +SKIP``.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from matrix import by_default

import genjax

pytestmark = pytest.mark.usefixtures("fast_compiles")

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

# `genjax.cli.__main__` runs the command line when imported.
MODULES = ["genjax"] + sorted(
    info.name
    for info in pkgutil.walk_packages(genjax.__path__, "genjax.")
    if not info.name.endswith(".__main__")
)


@pytest.fixture(scope="session")
def doctest_globals() -> dict:
    path = genjax.io.bundled.path("genjax-tiny")
    model, params = genjax.models.from_pretrained(path)
    # Without the checkpoint's sampling file, so that `config` means what it says (greedy); the
    # merge with a checkpoint's generation config is tested in test_model_generation_config.py.
    model = model.with_generation_config(None)
    tok = genjax.tokenizer.from_pretrained(path)
    batch = tok(["def f():", "import os"])
    return {
        "jax": jax,
        "jnp": jnp,
        "np": np,
        "genjax": genjax,
        "model": model,
        "params": params,
        "tok": tok,
        "ids": batch["input_ids"],
        "mask": batch["attention_mask"],
        "config": genjax.GenerationConfig(max_new_tokens=4),
        "mesh": genjax.sharding.make_mesh((2, 4)),
    }


ENGINES = ("genjax.serving.batch", "genjax.serving.manager")  # engines end to end: -m slow


@pytest.mark.parametrize("name", by_default(MODULES, keep=[m for m in MODULES if m not in ENGINES]))
def test_docstring_examples_run(name, doctest_globals):
    module = importlib.import_module(name)
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    tests = doctest.DocTestFinder().find(module, name, extraglobs=doctest_globals)
    for test in sorted(tests, key=lambda t: t.name):
        runner.run(test, out=report.append)
    failed, attempted = runner.summarize(verbose=False)
    if failed:
        pytest.fail(f"{failed} of {attempted} examples in {name} failed:\n" + "".join(report))
