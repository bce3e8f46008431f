"""What compiles when: one program for many calls (``max_cache_len``), prompt buckets,
ahead-of-time warm-up, the loop updating its cache in place, and the persistent compile cache.

Compilations are counted with JAX's monitoring events (one backend compile event per XLA
program, named ``jit(<function>)``), so "compiles nothing" means no XLA program at all was built,
not only that the generate program was reused. The model is a one-layer random Llama; the file
builds four generate programs, all for batch 2: greedy with prompt buckets of multiples of 24,
greedy with ``max_cache_len`` (with and without a user processor), and sampling with
``max_cache_len``; and a subprocess builds one.

Every test starts with JAX's in-memory caches cleared (``fresh_programs``), so what a test counts
does not depend on which tests ran before it: each builds the programs it needs itself.
"""

import functools
import json
import re
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import genjax
from genjax import GenerationConfig, buckets
from genjax.errors import InputError, UnsupportedError
from genjax.testing import count_compiles as compiles
from genjax.testing import write_random_checkpoint

pytestmark = pytest.mark.usefixtures("fast_compiles")  # LLVM at -O0: see conftest.py


@pytest.fixture(autouse=True)
def fresh_programs():
    """Drops every compiled program of this process, so a test's compile counts are its own."""
    jax.clear_caches()


GREEDY = GenerationConfig(max_new_tokens=12, pad_token_id=0, output_scores=True)
MAX_CACHE_LEN = 48  # one chunk of 16 more: 63 slots
BUCKETS = 24  # prompt_buckets: multiples of 24
SAMPLING = GenerationConfig(
    max_new_tokens=6, pad_token_id=0, do_sample=True, temperature=0.7, top_k=20, top_p=0.9
)


@functools.cache
def _setup():
    """A two-layer random Llama and a left-padded batch of two 9-token prompts.

    Two layers, not one: with one layer the attention reads the layer's block straight out of
    the loop carry (the block is the whole cache), and XLA copies the cache to allow the in-place
    write; with more layers each step reads a slice of the carry and writes in place."""
    import tempfile

    path = tempfile.mkdtemp(prefix="genjax-compile-")
    # No EOS in config.json (the model's generation config would stop rows early, as in
    # transformers): the resumed call below continues the reference's rows.
    write_random_checkpoint(path, "llama", num_hidden_layers=2, eos_token_id=None)
    model, params = genjax.models.from_pretrained(path)
    ids = np.random.default_rng(0).integers(1, model.vocab_size, (2, 9)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[0, :3] = 0
    ids[0, :3] = 0
    return path, model, params, ids, mask


def _generate(ids, mask, config=GREEDY, **kwargs):
    _, model, params, _, _ = _setup()
    return genjax.generate(model, params, ids, config, attention_mask=mask, **kwargs)


@functools.cache
def _reference():
    """Greedy with prompt buckets of multiples of 24 slots: 9 prompt + 12 new tokens, and the
    scores (the default policy is exercised by every other test file)."""
    _, _, _, ids, mask = _setup()
    out = _generate(ids, mask, prompt_buckets=BUCKETS)
    return np.asarray(out.sequences), np.asarray(out.scores)


def test_warmup_compiles_ahead_so_the_first_calls_compile_nothing():
    path, model, params, ids, mask = _setup()
    bucketed = genjax.warmup(model, params, GREEDY, 2, (16,), prompt_buckets=BUCKETS)
    with compiles() as during:
        fixed = genjax.warmup(model, params, GREEDY, (2,), (9, 40), max_cache_len=MAX_CACHE_LEN)
    assert [(e.batch, e.prompt_length, e.padded_length) for e in bucketed + fixed] == [
        (2, 16, 24),
        (2, 9, 63),
        (2, 40, 63),
    ]
    # The two prompt lengths share one max_cache_len program.
    assert during == ["jit(_generate)"]
    assert fixed[1].compiled.as_text() == fixed[0].compiled.as_text()
    args, _ = bucketed[0].compiled.args_info
    assert args[2].shape == (2, 24) and fixed[0].compiled.args_info[0][2].shape == (2, 63)
    with compiles() as first_calls:
        bucketed_out = _generate(ids, mask, prompt_buckets=BUCKETS)  # 9 tokens: bucket 24
        out = _generate(ids, mask, max_cache_len=MAX_CACHE_LEN)
    # The bucketed call trims its padding from the output, a small slice program; nothing else.
    assert first_calls == ["jit(dynamic_slice)"]
    sequences, scores = _reference()
    np.testing.assert_array_equal(bucketed_out.sequences, sequences)
    np.testing.assert_array_equal(out.sequences[:, :21], sequences)
    np.testing.assert_array_equal(out.sequences[:, 21:], 0)  # pad up to max_cache_len
    assert out.sequences.shape == (2, MAX_CACHE_LEN) and out.scores.shape[1] == MAX_CACHE_LEN - 1
    np.testing.assert_allclose(out.scores[:, :12], scores, atol=1e-5)
    np.testing.assert_array_equal(out.scores[:, 12:], 0.0)


def test_warmup_run_once_runs_each_program_it_compiled_and_compiles_no_other():
    _, model, params, _, _ = _setup()
    settings = [dict(prompt_buckets=BUCKETS), dict(max_cache_len=MAX_CACHE_LEN)]
    compiled_only = [genjax.warmup(model, params, GREEDY, 2, (9,), **kw)[0] for kw in settings]
    assert [entry.run_seconds for entry in compiled_only] == [None, None]
    with compiles() as during:
        ran = [
            genjax.warmup(model, params, GREEDY, 2, (9,), run_once=True, **kw)[0] for kw in settings
        ]
    # The runs call the compiled programs (the max_cache_len one with 2 new tokens, its length
    # being traced) and compile nothing.
    assert during == []
    assert all(entry.run_seconds > 0 for entry in ran)
    assert [e.compiled.as_text() for e in ran] == [e.compiled.as_text() for e in compiled_only]
    with pytest.raises(InputError, match="run_once"):
        genjax.warmup(model, params, GREEDY, run_once="yes")


def test_max_cache_len_serves_new_lengths_and_buckets_with_one_program():
    _, _, _, ids, mask = _setup()
    sequences, _ = _reference()
    with compiles() as first:
        _generate(ids, mask, max_cache_len=MAX_CACHE_LEN)
    assert first.count("jit(_generate)") == 1  # built here (and small input conversions)
    longer = sequences[:, :18]  # 18 tokens: bucket 32 without max_cache_len
    longer_mask = np.concatenate([mask, np.ones((2, 9), np.int32)], axis=1)
    with compiles() as compiled:
        fewer = _generate(ids, mask, max_new_tokens=3, max_cache_len=MAX_CACHE_LEN)
        by_max_length = _generate(
            ids, mask, GREEDY.replace(max_new_tokens=None, max_length=12), max_cache_len=48
        )
        resumed = _generate(longer, longer_mask, max_new_tokens=3, max_cache_len=MAX_CACHE_LEN)
    assert compiled == []
    np.testing.assert_array_equal(fewer.sequences[:, :12], sequences[:, :12])
    np.testing.assert_array_equal(fewer.sequences[:, 12:], 0)
    np.testing.assert_array_equal(by_max_length.sequences, fewer.sequences)
    np.testing.assert_array_equal(resumed.sequences[:, :21], sequences)  # prefilled in 2 chunks


def test_max_cache_len_sampling_values_keys_and_lengths_compile_nothing():
    _, _, _, ids, mask = _setup()
    sequences, _ = _reference()

    def sample(ids=ids, mask=mask, seed=0, **kw):
        config = SAMPLING.replace(**kw)
        key = jax.random.key(seed)
        out = _generate(ids, mask, config, key=key, max_cache_len=MAX_CACHE_LEN)
        return np.asarray(out.sequences)

    first = sample()
    with compiles() as compiled:
        again = sample()
        other_key = sample(seed=1)
        other_values = sample(temperature=1.3, top_k=5, top_p=0.5)
        argmax = sample(top_k=1, max_new_tokens=12)  # top-1 sampling is greedy
        short = sample(ids[:, 5:], mask[:, 5:], max_new_tokens=30)
    assert compiled == []
    np.testing.assert_array_equal(again, first)
    assert not np.array_equal(other_key, first) and not np.array_equal(other_values, first)
    np.testing.assert_array_equal(argmax[:, :21], sequences)
    assert short.shape == (2, MAX_CACHE_LEN) and np.all(short[:, 34:] == 0)
    np.testing.assert_array_equal(short[:, :4], ids[:, 5:])


def test_a_fresh_user_processor_with_new_values_compiles_nothing():
    """User processors are pytrees: their values are traced, so ``temperature(0.7)`` reuses the
    program compiled for ``temperature(0.5)`` (only the kind of processor is static)."""
    _, _, _, ids, mask = _setup()
    sequences, scores = _reference()

    def run(processor):
        out = _generate(ids, mask, max_cache_len=MAX_CACHE_LEN, logits_processor=[processor])
        return np.asarray(out.sequences[:, :21]), np.asarray(out.scores[:, :12])

    hot = run(genjax.processors.temperature(0.5))
    with compiles() as compiled:
        warm = run(genjax.processors.temperature(0.7))
        cool = run(genjax.processors.temperature(2))  # a Python int: the same float32 leaf
    assert compiled == []
    for (got_sequences, got_scores), value in ((hot, 0.5), (warm, 0.7), (cool, 2.0)):
        np.testing.assert_array_equal(got_sequences, sequences)  # greedy: argmax unchanged
        np.testing.assert_allclose(got_scores, scores / value, rtol=1e-5, atol=1e-5)


def _computations(hlo: str) -> dict[str, list[str]]:
    """The instruction lines of each computation of an HLO module's text, by name."""
    found, name = {}, None
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            name = line.removeprefix("ENTRY ").split()[0].lstrip("%")
            found[name] = []
        elif name is not None and line.startswith("  "):
            found[name].append(line)
    return found


def _loop_lines(hlo: str) -> list[str]:
    """Every instruction run inside a while loop: its bodies and what they call."""
    computations = _computations(hlo)
    called = r"(?:body|condition|calls|to_apply)=%([\w.\-]+)"
    todo = [
        n
        for lines in computations.values()
        for n in re.findall(r"body=%([\w.\-]+)", "".join(lines))
    ]
    seen = set()
    while todo:
        name = todo.pop()
        if name not in seen and name in computations:
            seen.add(name)
            todo.extend(re.findall(called, "\n".join(computations[name])))
    return [line for name in seen for line in computations[name]]


@pytest.mark.parametrize("batch", [1, 2])
def test_decoding_loops_update_the_cache_in_place_without_copies(batch):
    """The cache is created inside the program and carried by the while loops, so it needs no
    donation: each step writes its slot with a dynamic-update-slice and never copies it.

    Batch 1 too: with keys stored [B, K, S, H] and the scores as a matrix product, XLA:CPU
    transposed every layer's keys and copied them four times per step there (not at batch 2)."""
    _, model, params, _, _ = _setup()
    programs = genjax.warmup(model, params, GREEDY, batch, (9,), prompt_buckets=BUCKETS)
    programs += genjax.warmup(model, params, GREEDY, batch, (9,), max_cache_len=MAX_CACHE_LEN)
    for program, slots in zip(programs, (BUCKETS + 12, MAX_CACHE_LEN + 15), strict=True):
        cache = jax.eval_shape(lambda s=slots: model.init_cache(batch, s))
        block = sorted(d for d in cache.values[0].shape if d > 1)  # one layer's dims, any order
        text = program.compiled.as_text()
        # Arrays with a layer block's dims (in any order) that the loops make: only the fusions
        # that write a block in place, one per layer and keys or values in each loop; never a
        # copy, a transposed or reshaped duplicate, or a second write of the same block.
        made = [
            (found.group(2), line)
            for line in _loop_lines(text)
            if (found := re.search(r"= \w+\[([\d,]+)\]\{[\d,]*\} ([\w-]+)\(", line))
            and sorted(int(d) for d in found.group(1).split(",") if int(d) > 1) == block
            and found.group(2) not in ("parameter", "get-tuple-element", "bitcast", "tuple")
            and found.group(2) != "dynamic-update-slice"  # the roots inside the write fusions
        ]
        loops = len(re.findall(r" while\(", text))
        assert all(op == "fusion" and "dynamic-update-slice" in line for op, line in made), made
        assert len(made) == loops * 2 * 2, made  # 2 layers x keys and values per loop


_CACHE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np, genjax

    jax.config.update("jax_disable_most_optimizations", True)
    events = []
    jax.monitoring.register_event_listener(lambda event, **kw: events.append(event))
    genjax.enable_compile_cache(sys.argv[1], min_compile_time_secs=0)
    model, params = genjax.models.from_pretrained(sys.argv[2])
    ids = np.arange(1, 6, dtype=np.int32)[None]
    config = genjax.GenerationConfig(max_new_tokens=3, pad_token_id=0)
    out = genjax.generate(model, params, ids, config, attention_mask=np.ones_like(ids))
    print(json.dumps({
        "tokens": np.asarray(out.sequences).tolist(),
        "hits": events.count("/jax/compilation_cache/cache_hits"),
        "misses": events.count("/jax/compilation_cache/cache_misses"),
    }))
    """
)


def test_a_second_process_loads_the_programs_from_the_compile_cache(tmp_path):
    model_path = _setup()[0]
    script = tmp_path / "run.py"
    script.write_text(_CACHE_SCRIPT)
    cache = tmp_path / "xla-cache"

    def run():
        done = subprocess.run(
            [sys.executable, str(script), str(cache), model_path],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = run()
    assert first["misses"] > 0 and first["hits"] == 0 and any(cache.iterdir())
    second = run()
    assert second["misses"] == 0 and second["hits"] > 0
    assert second["tokens"] == first["tokens"]


def test_bucket_policies():
    assert [buckets.DEFAULT.length(p) for p in (1, 16, 17, 100)] == [16, 16, 32, 128]
    assert buckets.resolve(None) is buckets.DEFAULT
    assert buckets.resolve(64).length(70) == 128 and buckets.resolve(64).granularity == 64
    policy = buckets.resolve([128, 32])
    assert [policy.length(p) for p in (1, 32, 33)] == [32, 32, 128] and policy.granularity == 32
    assert buckets.powers_of_two(8).buckets_up_to(40) == (8, 16, 32, 64)
    assert buckets.multiples_of(24).buckets_up_to(50) == (24, 48, 72)
    with pytest.raises(InputError, match="longer than the largest prompt bucket 128"):
        policy.length(129)
    for bad in (0, "pow2", [16, -1], 2.5, True):
        with pytest.raises(InputError, match="prompt_buckets|needs"):
            buckets.resolve(bad)
    with pytest.raises(InputError, match="power of two"):
        buckets.powers_of_two(12)


def test_clear_errors_before_anything_compiles(tmp_path):
    _, model, params, ids, mask = _setup()
    with compiles() as compiled:
        with pytest.raises(InputError, match="9 \\+ 40 new tokens = 49 exceeds max_cache_len=48"):
            _generate(ids, mask, max_new_tokens=40, max_cache_len=MAX_CACHE_LEN)
        with pytest.raises(InputError, match="9 \\+ 40 new tokens = 49 exceeds"):  # beams too
            _generate(ids, mask, num_beams=2, max_new_tokens=40, max_cache_len=MAX_CACHE_LEN)
        with pytest.raises(InputError, match="9 \\+ 40 new tokens = 49 exceeds"):  # assisted
            _generate(ids, mask, prompt_lookup_num_tokens=2, max_new_tokens=40, max_cache_len=48)
        with pytest.raises(InputError, match="prompt_buckets"):
            _generate(ids, mask, prompt_buckets="sixteen")
        with pytest.raises(InputError, match="batch_sizes"):
            genjax.warmup(model, params, GREEDY, batch_sizes=(0,))
        with pytest.raises(UnsupportedError, match="streamer"):
            genjax.warmup(model, params, GREEDY, streamer=object())
        with pytest.raises(InputError, match="min_compile_time_secs"):
            genjax.enable_compile_cache(tmp_path, min_compile_time_secs=-1)
    assert compiled == []
