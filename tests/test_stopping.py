"""Stopping rules: stop-string tables and matching, custom criteria and max_time in generate.

The stop-string cases run on a tiny byte-level BPE tokenizer built here with the `tokenizers`
library (no network). Their expected values are recorded below; the parity tests check them, and
random sequences, against transformers' ``StopStringCriteria`` on the same tokenizer.
"""

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

import genjax
import genjax.tokenizer
from genjax import GenerationConfig
from genjax.errors import GenerationConfigError, InputError
from genjax.stopping import stop_string_hits, stop_string_table
from genjax.stopping.stop_strings import _byte_alphabet

pytestmark = pytest.mark.usefixtures("fast_compiles")  # LLVM at -O0: see conftest.py

FIXTURES = Path(__file__).parent / "fixtures"
CHECKPOINT_TOKENIZER = FIXTURES / "stop_strings"  # made by make_stop_string_fixtures.py
SPECIALS = ["<pad>", "<s>", "</s>"]
MERGES = [
    ("s", "t"),
    ("o", "p"),
    ("st", "op"),
    ("Ġ", "st"),
    ("p", "p"),
    ("e", "d"),
    ("pp", "ed"),
    ("t", "o"),
    ("to", "pp"),
    ("l", "a"),
    ("la", "s"),
    ("Ã", "©"),  # "é" is the two bytes c3 a9
    ("Ċ", "Ċ"),  # "\n\n"
]
BYTE_OF = _byte_alphabet()  # GPT-2's byte-level alphabet, character -> byte
CHAR_OF = {byte: char for char, byte in BYTE_OF.items()}


@functools.cache
def _tokenizer() -> Tokenizer:
    """Ids: 0-2 specials, 3-15 the merged tokens, 16-271 the bytes 0-255, 272 "<|end|>"."""
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    for byte in range(256):
        vocab[CHAR_OF[byte]] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken("<|end|>", special=True)])
    return tokenizer


def _ids(tokens: list[str]) -> list[int]:
    vocab = _tokenizer().get_vocab()
    return [vocab[token] for token in tokens]


def _text(ids) -> list[bytes]:
    """Each token's bytes, read directly off the byte-level alphabet (the oracle's view)."""
    token = _tokenizer().id_to_token
    return [bytes(BYTE_OF[char] for char in token(int(i))) for i in ids]


def _oracle(ids, stop_strings) -> bool:
    """The stop-string rule on plain bytes: some stop string occurs in the text and ends inside
    the newest token."""
    pieces = _text(ids)
    text = b"".join(pieces)
    newest_starts = len(text) - len(pieces[-1])
    for stop in stop_strings:
        stop = stop.encode("utf-8")
        for end in range(max(newest_starts + 1, len(stop)), len(text) + 1):
            if text[end - len(stop) : end] == stop:
                return True
    return False


# (tokens, expected), per set of stop strings; checked against transformers by the parity tests.
CASES = {
    ("stop",): [
        (["st", "op"], True),  # two tokens
        (["s", "to", "pped"], True),  # three tokens, ending inside the newest
        (["las", "topp"], True),  # running off both ends of the stop string
        (["stop"], True),
        (["Ġ", "stop"], True),
        (["stop", "ed"], False),  # the newest token is past the stop string
        (["st", "op", "s"], False),
        (["s", "t", "o"], False),  # not complete yet
        (["st", "o", "Ġ", "p"], False),  # interrupted
        (["<|end|>", "x"], False),
    ],
    ("é", "\n\n", " st"): [
        (["c", "a", "f", "Ã©"], True),
        (["c", "a", "f", "Ã", "©"], True),  # é split over two byte tokens
        (["c", "a", "f", "Ã"], False),  # only the first byte of é
        (["Ċ", "Ċ"], True),
        (["a", "ĊĊ"], True),
        (["ĊĊ", "a"], False),
        (["Ġst"], True),
        (["Ġ", "stop"], True),  # " st" ends inside "stop"
        (["Ġ", "s", "a"], False),
        (["Ã©", "Ġ"], False),
    ],
}
_OUT_OF_VOCAB = 10_000  # fills slots before a case's first token: it matches nothing


def _batch(cases) -> np.ndarray:
    """int32[B, S]: each case's ids right-aligned after out-of-vocabulary fillers."""
    width = max(len(tokens) for tokens, _ in cases) + 1
    rows = [[_OUT_OF_VOCAB] * (width - len(tokens)) + _ids(tokens) for tokens, _ in cases]
    return np.asarray(rows, np.int32)


_hits = jax.jit(stop_string_hits)


@pytest.mark.parametrize("stop_strings", list(CASES))
def test_stop_strings_match_recorded_cases(stop_strings):
    cases = CASES[stop_strings]
    ids = _batch(cases)
    table = stop_string_table(_tokenizer(), stop_strings)
    got = _hits(table, jnp.asarray(ids), jnp.int32(ids.shape[1]))
    expected = [flag for _, flag in cases]
    assert np.asarray(got).tolist() == expected
    assert [_oracle(_ids(tokens), stop_strings) for tokens, _ in cases] == expected


def _random_sequences(count: int, length: int, seed: int = 0) -> np.ndarray:
    pool = _ids(["st", "op", "s", "t", "o", "p", "stop", "pped", "pp", "to", "topp", "las"])
    pool += _ids(["la", "c", "a", "f", "Ã", "©", "Ã©", "Ċ", "ĊĊ", "Ġ", "Ġst", "<|end|>", "<s>"])
    return np.random.default_rng(seed).choice(pool, size=(count, length)).astype(np.int32)


def test_stop_strings_agree_with_the_plain_bytes_rule_on_random_text():
    stop_strings = ("stop", "é", "\n\n", " st")
    ids = _random_sequences(1500, 6)
    table = stop_string_table(_tokenizer(), stop_strings)
    got = np.asarray(_hits(table, jnp.asarray(ids), jnp.int32(6)))
    expected = np.array([_oracle(row, stop_strings) for row in ids])
    assert 0.05 < expected.mean() < 0.5  # both outcomes are well represented
    np.testing.assert_array_equal(got, expected)


def test_text_before_the_first_slot_and_before_the_buffer_is_ignored():
    table = stop_string_table(_tokenizer(), "stop")
    ids = jnp.asarray([_ids(["st", "op", "x", "st", "op"])] * 2)
    # Row text starts at slot 1 ("op" ...) : "stop" needs slot 0, so no match at length 2.
    assert _hits(table, ids, jnp.int32(2), jnp.int32(1)).tolist() == [False, False]
    assert _hits(table, ids, jnp.int32(2), jnp.int32(0)).tolist() == [True, True]
    assert _hits(table, ids, jnp.int32(4), jnp.int32(0)).tolist() == [False, False]
    assert _hits(table, ids, jnp.int32(5), jnp.int32(3)).tolist() == [True, True]


def test_tables_are_cleaned_on_bytes_and_cached():
    tokenizer = _tokenizer()
    table = stop_string_table(tokenizer, ["stop", "é"])
    assert stop_string_table(tokenizer, ["stop", "é"]) is table
    assert table.window == 4  # len("stop"); "é" is 2 bytes
    assert table.target_lengths.tolist() == [4, 2]
    lengths = np.asarray(table.token_lengths)
    assert lengths[_ids(["Ġst", "Ã©", "<|end|>", "ĊĊ"])].tolist() == [3, 2, 7, 2]
    assert lengths.shape == (274,) and lengths[-1] == -1  # ids 0-272, then the spare row
    # "pped" begins with the last 1 character of "stop"; "to" fits 1 character from its end.
    (pped, to) = _ids(["pped", "to"])
    assert np.asarray(table.end_lengths)[pped, 0].tolist() == [1]
    assert 1 in np.asarray(table.positions)[to, 0].tolist()
    assert BYTE_OF["Ġ"] == 32 and BYTE_OF["Ċ"] == 10 and BYTE_OF["Ā"] == 0 and BYTE_OF["!"] == 33


def test_a_table_first_built_inside_jit_is_reusable_outside():
    ids = jnp.asarray([_ids(["s", "to", "pped"])])
    traced = jax.jit(lambda ids: _hits(stop_string_table(_tokenizer(), "pped"), ids, 3))(ids)
    table = stop_string_table(_tokenizer(), "pped")  # from the cache, filled during tracing
    assert isinstance(table.positions, jax.Array) and not isinstance(
        table.positions, jax.core.Tracer
    )
    assert traced.tolist() == _hits(table, ids, jnp.int32(3)).tolist() == [True]


class _PlainVocab:
    """A minimal tokenizer: only get_vocab(); tokens are their own text."""

    def __init__(self, tokens):
        self.tokens = tokens

    def get_vocab(self):
        return {token: i for i, token in enumerate(self.tokens)}


def test_a_plain_vocabulary_matches_on_characters():
    table = stop_string_table(_PlainVocab(["a", "st", "o", "p", "sto", "é"]), ["stop", "é"])
    assert table.window == 4
    ids = jnp.asarray([[1, 2, 3], [0, 4, 3], [0, 0, 5], [1, 3, 2]], jnp.int32)
    assert _hits(table, ids, jnp.int32(3)).tolist() == [True, True, True, False]


@pytest.mark.parametrize(
    "tokenizer, stop_strings, error, words",
    [
        (None, [""], InputError, "non-empty"),
        (None, [], InputError, "non-empty"),
        (object(), ["stop"], TypeError, "get_vocab"),
        (_PlainVocab(["a", "b"]), ["xyz"], InputError, r"\['xyz'\] can never match"),
        # "b" ends "zab" and "a" continues it, but nothing spells the "z"; "ab" is fine.
        (_PlainVocab(["a", "b"]), ["ab", "zab"], InputError, r"\['zab'\] can never match"),
        (_PlainVocab(["a", "Ġthe", "."]), [". "], InputError, "only get_vocab"),
    ],
)
def test_stop_string_table_rejects_bad_input(tokenizer, stop_strings, error, words):
    with pytest.raises(error, match=words):
        stop_string_table(tokenizer or _tokenizer(), stop_strings)


# ------------------------------------------------- a checkpoint's byte-level tokenizer, recorded


def _checkpoint_tokenizer(kind: str):
    if kind == "genjax":
        return genjax.tokenizer.from_pretrained(CHECKPOINT_TOKENIZER)
    if kind == "tokenizers":
        return Tokenizer.from_file(str(CHECKPOINT_TOKENIZER / "tokenizer.json"))
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(CHECKPOINT_TOKENIZER)


_hits_per_length = jax.jit(jax.vmap(stop_string_hits, in_axes=(None, None, 0)))


def _stops_per_length(table, ids: np.ndarray) -> np.ndarray:
    """bool[B, L]: [r, k] the check on ids[r, : k + 1]."""
    lengths = jnp.arange(1, ids.shape[1] + 1, dtype=jnp.int32)
    return np.asarray(_hits_per_length(table, jnp.asarray(ids, jnp.int32), lengths)).T


def _check_recorded_stops(tokenizer) -> None:
    records = json.loads((CHECKPOINT_TOKENIZER / "cases.json").read_text(encoding="utf-8"))
    random_ids = np.asarray(records["random"]["ids"])
    for x, stop_strings in enumerate(records["meta"]["stop_sets"]):
        table = stop_string_table(tokenizer, stop_strings)
        for case in records["texts"]:
            got = _stops_per_length(table, np.asarray([case["ids"]]))[0]
            assert np.flatnonzero(got).tolist() == case["stops"][x], (stop_strings, case["text"])
        expected = np.array([[c == "1" for c in row] for row in records["random"]["stops"][x]])
        np.testing.assert_array_equal(_stops_per_length(table, random_ids), expected)


@pytest.mark.parametrize("kind", ["genjax", "tokenizers"])
def test_a_byte_level_checkpoint_tokenizer_stops_where_transformers_stops(kind):
    """ ". " ends inside "ĠThe", "\n\n" is two "Ċ" tokens: both need the tokens read as bytes,
    from genjax's own tokenizer as from the tokenizers library's."""
    tokenizer = _checkpoint_tokenizer(kind)
    records = json.loads((CHECKPOINT_TOKENIZER / "cases.json").read_text(encoding="utf-8"))
    if kind == "genjax":
        for case in records["texts"]:
            assert tokenizer.encode(case["text"], add_special_tokens=False) == case["ids"]
    assert records["texts"][0]["stops"][:3] == [[7], [16], [5, 16, 17]]
    _check_recorded_stops(tokenizer)


def test_a_byte_level_pre_tokenizer_alone_means_bytes():
    tokenizer = Tokenizer.from_file(str(CHECKPOINT_TOKENIZER / "tokenizer.json"))
    tokenizer.decoder = None  # the ByteLevel pre-tokenizer still says "Ġ" is a space
    with_decoder = stop_string_table(_checkpoint_tokenizer("tokenizers"), [". ", "\n\n"])
    table = stop_string_table(tokenizer, [". ", "\n\n"])
    for name in ("positions", "end_lengths", "token_lengths", "target_lengths"):
        np.testing.assert_array_equal(getattr(table, name), getattr(with_decoder, name))


# ----------------------------------------------------------------------------- in generate


@functools.cache
def _llama():
    model, params = genjax.models.from_pretrained(FIXTURES / "llama")
    records = dict(np.load(FIXTURES / "llama" / "records.npz"))
    return model, params, records


# Chosen from the recorded greedy continuations (tokens "Ġst", "7", "8" in row 0 and "ed", "ed"
# in row 2): "t78" spans three tokens; "de" ends inside the second "ed".
STOP_STRINGS = ("t78", "de")
STOP_TOKEN = 25  # the custom criterion: a row is done once it emits token 25


def _stops_at_25(tokens, length):
    return tokens[:, length - 1] == STOP_TOKEN


def _counting(scores, context):
    _counting.traces += 1
    return scores


_counting.traces = 0


def _generate(stop_strings=STOP_STRINGS, tokenizer=None, **config):
    model, params, records = _llama()
    config = GenerationConfig(max_new_tokens=10, pad_token_id=0, eos_token_id=126, **config)
    return genjax.generate(
        model,
        params,
        records["greedy/input_ids"],
        config.replace(stop_strings=stop_strings),
        attention_mask=records["greedy/attention_mask"],
        tokenizer=_tokenizer() if tokenizer is None else tokenizer,
        stopping_criteria=[_stops_at_25],
        logits_processor=[_counting],
    )


def _expected_with_stops(
    sequences: np.ndarray, prompt: int, stop_strings=STOP_STRINGS
) -> tuple[np.ndarray, list[int]]:
    """The recorded sequences cut where transformers' rules would stop each row, then padded."""
    out, steps = sequences.copy(), []
    for row in out:
        step = next(
            i
            for i in range(prompt, row.shape[0])
            if _oracle(row[: i + 1], stop_strings) or row[i] == STOP_TOKEN
        )
        row[step + 1 :] = 0
        steps.append(step - prompt)
    return out, steps


def test_generate_stops_each_row_at_its_stop_string_or_criterion():
    _, _, records = _llama()
    prompt = records["greedy/input_ids"].shape[1]
    expected, steps = _expected_with_stops(records["greedy/sequences"], prompt)
    assert steps == [2, 4, 3]  # row 0 "t78", row 1 token 25, row 2 "de"
    out = _generate(max_time=1e6)  # a budget that changes nothing
    np.testing.assert_array_equal(out.sequences, expected)


def test_generate_reads_genjax_tokenizer_on_bytes():
    """genjax's own Tokenizer over the same byte-level vocabulary: " st7" needs "Ġst" read as
    " st", so row 0 now stops one token earlier, at "7"."""
    _, _, records = _llama()
    prompt = records["greedy/input_ids"].shape[1]
    stop_strings = (" st7", "de")
    expected, steps = _expected_with_stops(records["greedy/sequences"], prompt, stop_strings)
    assert steps == [1, 4, 3]
    tokenizer = genjax.tokenizer.Tokenizer(backend=_tokenizer(), special_tokens={})
    out = _generate(stop_strings, tokenizer, max_time=1e6)
    np.testing.assert_array_equal(out.sequences, expected)


def test_max_time_stops_after_the_first_token_and_its_value_compiles_nothing():
    _, _, records = _llama()
    prompt = records["greedy/input_ids"].shape[1]
    first = _generate(max_time=1e6)
    traces = _counting.traces
    out = _generate(max_time=1e-9)
    assert _counting.traces == traces
    np.testing.assert_array_equal(out.sequences[:, : prompt + 1], first.sequences[:, : prompt + 1])
    np.testing.assert_array_equal(out.sequences[:, prompt + 1 :], 0)


def _beams(stopping_criteria=(), **config):
    model, params, records = _llama()
    config = GenerationConfig(max_new_tokens=8, pad_token_id=0, num_beams=3, **config)
    return genjax.generate(
        model,
        params,
        records["greedy/input_ids"],
        config,
        attention_mask=records["greedy/attention_mask"],
        tokenizer=_tokenizer(),
        stopping_criteria=stopping_criteria,
    )


BEAM_STOP_TOKEN = 56  # repeated in row 1 of the beam search below without it


def _stops_at_56(tokens, length):
    return tokens[:, length - 1] == BEAM_STOP_TOKEN


def test_beam_search_criterion_acts_like_an_extra_eos():
    """A criterion that fires on token X ends a beam exactly as an EOS id X does."""
    plain = _beams(eos_token_id=126)
    with_criterion = _beams([_stops_at_56], eos_token_id=126)
    with_eos = _beams(eos_token_id=[126, BEAM_STOP_TOKEN])
    prompt = _llama()[2]["greedy/input_ids"].shape[1]
    assert (np.asarray(plain.sequences[:, prompt:]) == BEAM_STOP_TOKEN).any()
    assert not np.array_equal(plain.sequences, with_eos.sequences)  # the stop changes beams
    for name in ("sequences", "sequences_scores", "beam_indices"):
        np.testing.assert_array_equal(getattr(with_criterion, name), getattr(with_eos, name))


def test_beam_search_max_time_ends_after_the_first_token():
    _, _, records = _llama()
    prompt = records["greedy/input_ids"].shape[1]
    out = _beams(eos_token_id=126, max_time=1e-9)
    first = records["greedy/sequences"][:, prompt]  # the best beam's first token is greedy's
    np.testing.assert_array_equal(out.sequences[:, prompt], first)
    # After a hypothesis ends, transformers v5 writes `pad_token_id or eos_token_id[0]`: pad is 0
    np.testing.assert_array_equal(out.sequences[:, prompt + 1 :], 126)
    np.testing.assert_array_equal(out.beam_indices[:, 1:], -1)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(stop_strings=["stop"]), InputError, "tokenizer"),
        (dict(stop_strings=["stop"], tokenizer=object()), TypeError, "get_vocab"),
        (dict(stop_strings=["", "stop"]), GenerationConfigError, "non-empty"),
        (dict(max_time=0.0), GenerationConfigError, "max_time"),
        (dict(stopping_criteria=[3]), TypeError, "must hold functions"),
        (dict(stopping_criteria=3), TypeError, "list of functions"),
        (dict(stopping_criteria=[{}.get]), TypeError, "hashable"),
        (dict(stopping_criteria=[type("StoppingCriteria", (), {})()]), TypeError, "torch"),
    ],
)
def test_generate_rejects_bad_stopping_input_before_tracing(kwargs, error, words):
    model, params, _ = _llama()
    with pytest.raises(error, match=words):
        genjax.generate(model, params, np.ones((1, 3), np.int32), max_new_tokens=2, **kwargs)


def test_a_criterion_returning_the_wrong_shape_is_named():
    model, params, _ = _llama()

    def per_slot(tokens, length):
        return tokens == 3

    with pytest.raises(TypeError, match="bool\\[2\\]"):
        genjax.generate(
            model, params, np.ones((2, 3), np.int32), max_new_tokens=2, stopping_criteria=[per_slot]
        )


# ----------------------------------------------------------------------------- parity


def _hf_tokenizer(tokenizer):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


@pytest.mark.parity
def test_byte_alphabet_and_tables_equal_transformers():
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.generation.stopping_criteria import StopStringCriteria

    assert {char: byte for byte, char in bytes_to_unicode().items()} == BYTE_OF
    stop_strings = ["stop", "é", "\n\n", " st"]
    ours = stop_string_table(_tokenizer(), stop_strings)
    wrapped = stop_string_table(_hf_tokenizer(_tokenizer()), stop_strings)
    for name in ("positions", "end_lengths", "token_lengths", "target_lengths"):
        np.testing.assert_array_equal(getattr(ours, name), getattr(wrapped, name))
    theirs = StopStringCriteria(_hf_tokenizer(_tokenizer()), stop_strings)
    vec = theirs.embedding_vec.numpy()
    x, q, o = len(stop_strings), theirs.max_valid_positions, theirs.max_valid_end_lens
    np.testing.assert_array_equal(vec[:, -1], ours.token_lengths)
    as_sets = lambda a: [[set(v) - {-1} for v in row] for row in a]
    assert as_sets(vec[:, : x * q].reshape(-1, x, q)) == as_sets(np.asarray(ours.positions))
    ends = vec[:, x * q : -1].reshape(-1, x, o)
    assert as_sets(ends) == as_sets(np.asarray(ours.end_lengths))
    assert theirs.maximum_token_len == ours.window


@pytest.mark.parity
def test_stop_strings_match_transformers_on_cases_and_random_text():
    import torch
    from transformers.generation.stopping_criteria import StopStringCriteria

    for stop_strings, cases in CASES.items():
        theirs = StopStringCriteria(_hf_tokenizer(_tokenizer()), list(stop_strings))
        for tokens, expected in cases:
            assert bool(theirs(torch.tensor([_ids(tokens)]), None)[0]) == expected, tokens
    stop_strings = ["stop", "é", "\n\n", " st"]
    theirs = StopStringCriteria(_hf_tokenizer(_tokenizer()), stop_strings)
    table = stop_string_table(_tokenizer(), stop_strings)
    ids = _random_sequences(3000, 8, seed=1)
    for start in (0, 3):  # whole rows, and rows whose text begins at slot 3
        expected = theirs(torch.from_numpy(ids[:, start:]).long(), None).numpy()
        got = _hits(table, jnp.asarray(ids), jnp.int32(8), jnp.int32(start))
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parity
def test_byte_fallback_tokenizer_matches_transformers():
    """A Llama-style vocabulary: "▁" for spaces, <0xNN> byte tokens, matched on bytes."""
    import torch
    from transformers.generation.stopping_criteria import StopStringCriteria

    pieces = ["▁", "s", "t", "o", "p", "e", "d", "a", "c", "f", "é", "st", "op", "▁s", "stop"]
    pieces += ["▁st", "▁stop", "ed", "pp", "ca", "caf", "▁caf"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({piece: 259 + i for i, piece in enumerate(pieces)})
    merges = [("s", "t"), ("o", "p"), ("▁", "s"), ("st", "op"), ("▁s", "t"), ("▁st", "op")]
    merges += [("e", "d"), ("p", "p"), ("c", "a"), ("ca", "f"), ("▁", "caf")]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + [decoders.Strip(" ", 1, 0)]
    )
    stop_strings = [" stop", "é", "p\n"]
    table = stop_string_table(tokenizer, stop_strings)
    theirs = StopStringCriteria(_hf_tokenizer(tokenizer), stop_strings)
    pool = [vocab[p] for p in pieces] + [vocab["<0x0A>"], vocab["<0xC3>"], vocab["<0xA9>"], 1]
    ids = np.random.default_rng(2).choice(pool, size=(3000, 7)).astype(np.int32)
    expected = theirs(torch.from_numpy(ids).long(), None).numpy()
    assert expected.mean() > 0.03
    np.testing.assert_array_equal(_hits(table, jnp.asarray(ids), jnp.int32(7)), expected)


@pytest.mark.parity
def test_byte_level_checkpoint_records_match_live_transformers(tmp_path):
    """The recording rerun live equals the stored one, and transformers' own tokenizer object,
    loaded from the same folder, gives genjax the same tables as genjax's tokenizer."""
    import sys

    sys.path.insert(0, str(FIXTURES))
    from make_stop_string_fixtures import build_records

    stored = json.loads((CHECKPOINT_TOKENIZER / "cases.json").read_text(encoding="utf-8"))
    live = build_records(tmp_path)
    assert live["texts"] == stored["texts"] and live["random"] == stored["random"]
    assert (tmp_path / "tokenizer.json").read_text() == (
        CHECKPOINT_TOKENIZER / "tokenizer.json"
    ).read_text()
    _check_recorded_stops(_checkpoint_tokenizer("transformers"))
    for stop_strings in stored["meta"]["stop_sets"]:
        ours = stop_string_table(_checkpoint_tokenizer("genjax"), stop_strings)
        theirs = stop_string_table(_checkpoint_tokenizer("transformers"), stop_strings)
        for name in ("positions", "end_lengths", "token_lengths", "target_lengths"):
            np.testing.assert_array_equal(getattr(ours, name), getattr(theirs, name))


@pytest.mark.parity
def test_generate_with_stops_matches_live_transformers():
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    class StopsAt25(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == STOP_TOKEN

    _, _, records = _llama()
    hf = AutoModelForCausalLM.from_pretrained(FIXTURES / "llama").eval()
    meta = json.loads((FIXTURES / "llama" / "cases.json").read_text())["meta"]
    assert meta["pad_token_id"] == 0
    with torch.inference_mode():
        theirs = hf.generate(
            torch.from_numpy(records["greedy/input_ids"]).long(),
            attention_mask=torch.from_numpy(records["greedy/attention_mask"]).long(),
            do_sample=False,
            max_new_tokens=10,
            pad_token_id=0,
            eos_token_id=126,
            stop_strings=list(STOP_STRINGS),
            tokenizer=_hf_tokenizer(_tokenizer()),
            stopping_criteria=StoppingCriteriaList([StopsAt25()]),
        ).numpy()
    ours = np.asarray(_generate(max_time=1e6).sequences)
    np.testing.assert_array_equal(ours[:, : theirs.shape[1]], theirs)
    np.testing.assert_array_equal(ours[:, theirs.shape[1] :], 0)


@pytest.mark.parity
def test_beam_search_with_stops_matches_live_transformers():
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    class StopsAt25(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == STOP_TOKEN

    _, _, records = _llama()
    hf = AutoModelForCausalLM.from_pretrained(FIXTURES / "llama").eval()
    with torch.inference_mode():
        theirs = hf.generate(
            torch.from_numpy(records["greedy/input_ids"]).long(),
            attention_mask=torch.from_numpy(records["greedy/attention_mask"]).long(),
            do_sample=False,
            num_beams=3,
            max_new_tokens=8,
            pad_token_id=0,
            eos_token_id=126,
            stop_strings=list(STOP_STRINGS),
            tokenizer=_hf_tokenizer(_tokenizer()),
            stopping_criteria=StoppingCriteriaList([StopsAt25()]),
            output_scores=True,
            return_dict_in_generate=True,
        )
    ours = _beams([_stops_at_25], eos_token_id=126, stop_strings=list(STOP_STRINGS))
    indices = theirs.beam_indices.numpy()
    ended = indices < 0
    prompt = records["greedy/input_ids"].shape[1]
    expected = theirs.sequences.numpy()
    length = expected.shape[1] - prompt
    new = np.asarray(ours.sequences[:, prompt : prompt + length])
    np.testing.assert_array_equal(ours.sequences[:, :prompt], expected[:, :prompt])
    np.testing.assert_array_equal(
        np.where(ended, -1, new), np.where(ended, -1, expected[:, prompt:])
    )
    np.testing.assert_array_equal(ours.beam_indices[:, :length], indices)
    np.testing.assert_allclose(ours.sequences_scores, theirs.sequences_scores.numpy(), atol=1e-4)
