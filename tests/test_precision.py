"""``dtype="auto"`` (:mod:`genjax.models.precision`) and ``--quantize`` / ``--dtype auto`` on the
command line: the choice per backend and batch size, what gets loaded, and named errors."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import genjax
import genjax.io.bundled
from genjax import cli
from genjax.errors import InputError
from genjax.kernels import native
from genjax.models import precision
from genjax.models import quantize as Q
from genjax.models.precision import CPU_FLOAT32_FROM_ROWS, CPU_INT8_KERNEL_ROWS, auto_precision

pytestmark = pytest.mark.usefixtures("fast_compiles")


@pytest.mark.parametrize("kernel", [False, True], ids=["no-kernel", "kernel"])
@pytest.mark.parametrize(
    ("bf16", "pairs"),  # the pair product is one of the bfloat16 dot products
    [(False, False), (True, False), (True, True)],
    ids=["no-bf16-products", "bf16-products", "bf16-pair-product"],
)
def test_the_choice_per_backend_and_batch_size(bf16, pairs, kernel, monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_bf16_products", lambda: bf16)
    monkeypatch.setattr(precision, "int8_kernel_takes", lambda rows: kernel and rows <= 32)
    monkeypatch.setattr(precision, "bf16_pair_kernel_runs", lambda: pairs)
    assert auto_precision(None, "cpu") == ("float32", "int8")
    assert auto_precision(CPU_FLOAT32_FROM_ROWS - 1, "cpu") == ("float32", "int8")
    many = ("bfloat16" if bf16 else "float32", None)
    assert auto_precision(CPU_INT8_KERNEL_ROWS + 1, "cpu") == auto_precision(64, "cpu") == many
    # int8 where the row kernel takes it, unless the pair product runs bfloat16 rows
    middle = ("float32", "int8") if kernel and not pairs else many
    assert auto_precision(CPU_FLOAT32_FROM_ROWS, "cpu") == middle
    assert auto_precision(CPU_INT8_KERNEL_ROWS, "cpu") == middle
    assert auto_precision(1, "gpu") == auto_precision(64, "tpu") == ("bfloat16", None)
    assert auto_precision() == ("float32", "int8")  # these tests run on the CPU backend


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ("fpu avx2 avx512f avx512_bf16 avx512_vnni", True),  # AMD EPYC Zen 4
        ("fpu avx2 avx512f amx_bf16 amx_tile amx_int8", True),  # Intel Xeon Sapphire Rapids
        ("fpu avx2 fma avx512f avx512_vnni", False),
    ],
)
def test_bf16_products_are_read_from_the_cpu_flags(flags, expected, monkeypatch):
    cpuinfo = f"processor\t: 0\nmodel name\t: x\nflags\t\t: {flags}\n"
    assert native.flags_in(cpuinfo) == frozenset(flags.split())
    monkeypatch.setattr(native, "cpu_flags", lambda: native.flags_in(cpuinfo))
    assert precision.cpu_has_bf16_products() is expected


def test_auto_loads_the_chosen_format(monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_bf16_products", lambda: False)
    monkeypatch.setattr(precision, "bf16_pair_kernel_runs", lambda: False)
    folder = genjax.io.bundled.path()
    _, few = genjax.models.from_pretrained(folder, dtype="auto")
    _, int8 = genjax.models.from_pretrained(folder, quantize="int8")
    _, many = genjax.models.from_pretrained(folder, dtype="auto", batch_size=64)
    _, floats = genjax.models.from_pretrained(folder)
    q = few["layers"]["0"]["self_attn"]["q_proj"]
    assert q["kernel"].dtype == jnp.int8 and "kernel_scale" in q
    for a, b in zip(*(jax_leaves(t) for t in (few, int8)), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not Q.is_quantized(many)
    for a, b in zip(*(jax_leaves(t) for t in (many, floats)), strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(a, b)
    monkeypatch.setattr(precision, "cpu_has_bf16_products", lambda: True)
    _, narrow = genjax.models.from_pretrained(folder, dtype="auto", batch_size=64)
    assert {a.dtype for a in jax_leaves(narrow)} == {jnp.dtype(jnp.bfloat16)}


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def test_errors_are_named():
    folder = genjax.io.bundled.path()
    with pytest.raises(InputError, match=r"dtype='auto' picks the quantization too"):
        genjax.models.from_pretrained(folder, dtype="auto", quantize="int4")
    with pytest.raises(InputError, match=r"batch_size=8 only informs dtype='auto'"):
        genjax.models.from_pretrained(folder, batch_size=8)
    with pytest.raises(InputError, match=r"batch_size must be a positive int"):
        genjax.models.from_pretrained(folder, dtype="auto", batch_size=0)
    with pytest.raises(TypeError, match=r"dtype must be None, 'auto'"):
        genjax.models.from_pretrained(folder, dtype="fp8")


@pytest.mark.parametrize(
    ("flags", "loaded"),
    [(["--quantize", "int4"], {"quantize": "int4"}), (["--dtype", "auto"], {"dtype": "auto"})],
)
def test_cli_flags_load_what_they_say(flags, loaded, capsys, monkeypatch):
    """``genjax generate`` prints what ``generate`` gives on the params the flags name, and
    ``--dtype auto`` tells the loader the rows of a decode step (prompts per batch times
    sequences per prompt)."""
    seen = []
    load = genjax.models.from_pretrained
    monkeypatch.setattr(
        genjax.models, "from_pretrained", lambda *a, **k: seen.append(k) or load(*a, **k)
    )
    code = cli.main(["generate", "def fib", "--max-new-tokens", "4", "--greedy", "--json", *flags])
    out, _ = capsys.readouterr()
    assert code == 0 and seen[0]["batch_size"] == (1 if "auto" in flags else None)
    model, params = load(genjax.io.bundled.path(), **loaded)
    tok = genjax.tokenizer.from_pretrained(genjax.io.bundled.path())
    config = genjax.GenerationConfig.from_pretrained(genjax.io.bundled.path())
    ids = jnp.asarray(tok("def fib")["input_ids"]).reshape(1, -1)
    config = config.replace(max_new_tokens=4, do_sample=False, temperature=None, top_p=None)
    seq = genjax.generate(model.with_generation_config(None), params, ids, config).sequences
    got = json.loads(out)["token_ids"]
    assert got == np.asarray(seq)[0, ids.shape[1] :].tolist()[: len(got)] and got
    cli.main(
        ["generate", "a", "b", "--max-new-tokens", "1", "--greedy", "--num-beams", "2", *flags]
    )
    capsys.readouterr()
    assert seen[-1]["batch_size"] == (4 if "auto" in flags else None)
