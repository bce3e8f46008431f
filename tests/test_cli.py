"""The ``genjax`` command, run in-process on a tiny random model with a tiny BPE tokenizer."""

import io
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import genjax
from genjax import cli
from genjax.cli import options as cli_options
from genjax.io import tokenizer as T
from genjax.testing import tiny_bpe_tokenizer, write_random_checkpoint

TEMPLATE = (  # short, so that a chat prompt shares the 16-token bucket (and program) of others
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
CORPUS = ["def fibonacci(n):\n    return n", "hello world, hello tokens"] * 20
GENERATION = {"max_new_tokens": 6, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def _write_tokenizer(path, chat_template=TEMPLATE) -> int:
    backend = tiny_bpe_tokenizer(CORPUS)
    backend.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return backend.get_vocab_size()


@pytest.fixture(autouse=True)
def no_compile_cache(monkeypatch):
    """In-process runs would turn JAX's persistent cache on for the whole test session."""
    monkeypatch.setenv("GENJAX_COMPILE_CACHE", "0")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    vocab = _write_tokenizer(path)
    write_random_checkpoint(path, "llama", vocab_size=vocab, num_hidden_layers=1, seed=0)
    (path / "generation_config.json").write_text(json.dumps(GENERATION))
    return path


@pytest.fixture(scope="module")
def loaded(folder):
    model, params = genjax.models.from_pretrained(folder)
    return model, params, T.from_pretrained(folder)


def _expected(loaded, prompts, config, key=0, chat=False):
    """(new ids, text) per prompt, from genjax.generate on one batch (``key``: a seed or key)."""
    model, params, tok = loaded
    if chat:
        rows = [
            tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
            for p in prompts
        ]
        batch = tok.pad(rows)
    else:
        batch = tok(prompts)
    out = genjax.generate(
        model,
        params,
        batch["input_ids"],
        config,
        attention_mask=batch["attention_mask"],
        key=jax.random.key(key) if isinstance(key, int) else key,
        tokenizer=tok.backend if config.stop_strings else None,
    )
    results = []
    for row in np.asarray(out.sequences)[:, batch["input_ids"].shape[1] :].tolist():
        if 2 in row:
            row = row[: row.index(2) + 1]
        while row and row[-1] == 0:
            row.pop()
        results.append((row, tok.decode(row, skip_special_tokens=True)))
    return results


def _run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal, so the progress bar is drawn."""

    def isatty(self):
        return True


def _json_lines(text):
    return [json.loads(line) for line in text.splitlines()]


def test_one_prompt_streams_the_text_generate_gives(folder, loaded, capsys):
    config = genjax.GenerationConfig.from_pretrained(folder)
    [(ids, text)] = _expected(loaded, ["def fib"], config)
    code, out, err = _run(capsys, "generate", "def fib", "--model", folder)
    assert (code, err) == (0, "")
    assert out == "def fib" + text + "\n" and len(ids) == 6  # the prompt, then the new text

    # --stop: a stop string taken from that text ends the row where generate ends it.
    # (Random weights write odd bytes: take the first whole character after the first token.)
    tok = loaded[2]
    end = next(k for k in range(2, 6) if tok.decode(ids[:k])[-1] not in "\ufffd ")
    stop = tok.decode(ids[:end])[-1]
    [(stop_ids, stop_text)] = _expected(loaded, ["def fib"], config.replace(stop_strings=stop))
    assert stop_ids == ids[:end]
    code, out, _ = _run(capsys, "generate", "def fib", "--model", folder, "--stop", stop, "--json")
    [record] = _json_lines(out)
    assert record == {
        "prompt": "def fib",
        "completion": stop_text,
        "token_ids": stop_ids,
        "num_new_tokens": end,
    }


def test_many_prompts_batch_with_flags_and_print_json(
    folder, loaded, capsys, tmp_path, monkeypatch
):
    prompts = ["def fib", "hello", "world"]
    flags = ["--do-sample", "--temperature", "0.8", "--top-k", "20", "--seed", "3"]
    code, out, err = _run(
        capsys, "generate", *prompts, "--model", folder, "--json", "--batch-size", 2, *flags
    )
    assert (code, err) == (0, "")
    config = genjax.GenerationConfig.from_pretrained(folder).replace(
        do_sample=True, temperature=0.8, top_k=20
    )
    # Prompt i samples alone, with the key fold_in(key(3), i), whatever its batch.
    expected = [
        _expected(loaded, [p], config, key=jax.random.fold_in(jax.random.key(3), i))[0]
        for i, p in enumerate(prompts)
    ]
    records = _json_lines(out)
    assert [r["prompt"] for r in records] == prompts
    assert [(r["token_ids"], r["completion"]) for r in records] == expected
    assert [r["num_new_tokens"] for r in records] == [len(ids) for ids, _ in expected]

    # The same prompts from --input (blank lines skipped), as text, with a progress bar.
    (tmp_path / "prompts.txt").write_text("def fib\n\nhello\nworld\n")
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    argv = ["generate", "--model", folder, "--input", tmp_path / "prompts.txt", "--batch-size", 2]
    code, out, _ = _run(capsys, *argv, *flags)
    assert code == 0
    blocks = [f"==> {p} <==\n{p}{text}\n" for p, (_, text) in zip(prompts, expected, strict=True)]
    assert out == "\n".join(blocks)
    assert "2/3 [" in terminal.getvalue() and "3/3 [" in terminal.getvalue()  # tqdm's bar


def test_chat_sends_each_prompt_through_the_chat_template(folder, loaded, capsys, tmp_path):
    config = genjax.GenerationConfig.from_pretrained(folder)
    [(ids, text)] = _expected(loaded, ["hi"], config, chat=True)
    assert (
        loaded[2].decode(
            loaded[2].apply_chat_template(
                [{"role": "user", "content": "hi"}], add_generation_prompt=True
            )
        )
        == "u:hi</s>a:"
    )
    code, out, _ = _run(capsys, "generate", "hi", "--model", folder, "--chat", "--json")
    assert code == 0
    assert _json_lines(out) == [
        {"prompt": "hi", "completion": text, "token_ids": ids, "num_new_tokens": len(ids)}
    ]

    plain = tmp_path / "plain"
    plain.mkdir()
    vocab = _write_tokenizer(plain, chat_template=None)
    write_random_checkpoint(plain, "llama", vocab_size=vocab, num_hidden_layers=1)
    code, out, err = _run(capsys, "generate", "hi", "--model", plain, "--chat")
    assert (code, out) == (2, "")
    assert err.startswith("genjax: error: --chat needs a chat template")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--temperature", "-1"], "GenerationConfig.temperature=-1.0 is invalid"),
        (["--top-k", "many"], "argument --top-k: invalid int value: 'many'"),
        (["--do-sample", "--greedy"], "argument --greedy: not allowed with argument --do-sample"),
        (["--batch-size", "0"], "argument --batch-size: must be at least 1"),
        (["--input", "absent.txt"], "--input file 'absent.txt' does not exist"),
        (["--model", "./absent"], "no checkpoint folder at './absent'"),
        (["--num-beams", "2", "--do-sample", "--top-k", "-3"], "top_k"),
    ],
)
def test_errors_are_one_line_with_exit_code_2(folder, capsys, argv, message):
    model = [] if "--model" in argv else ["--model", folder]
    code, out, err = _run(capsys, "generate", "hi", *model, *argv)
    assert (code, out) == (2, "")
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_config_show_prints_the_file_with_flag_overrides(folder, capsys):
    # --stop "\n\n" as typed in a shell: backslashes, unescaped by the command.
    flags = ["--max-new-tokens", 9, "--do-sample", "--top-p", 0.5, "--stop", r"\n\n"]
    code, out, _ = _run(capsys, "config", "show", folder, *flags)
    assert code == 0
    shown = json.loads(out)
    assert shown.pop("transformers_version")
    overrides = {"max_new_tokens": 9, "do_sample": True, "top_p": 0.5}
    assert shown == {**GENERATION, **overrides, "stop_strings": ["\n\n"]}
    expected = genjax.GenerationConfig(**{**GENERATION, **overrides}, stop_strings=("\n\n",))
    assert out == expected.to_json_string()


def test_config_validate_prints_ok_or_the_problems(folder, capsys, tmp_path):
    assert _run(capsys, "config", "validate", folder) == (0, "ok\n", "")
    code, out, err = _run(capsys, "config", "validate", folder, "--temperature", 0.5)
    assert code == 1 and "temperature" in out and "do_sample" in out and err == ""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "generation_config.json").write_text(json.dumps({"top_p": 2.0}))
    code, out, _ = _run(capsys, "config", "validate", bad)
    assert code == 1 and "top_p" in out
    code, _, err = _run(capsys, "config", "validate", tmp_path / "absent")
    assert code == 2 and err.startswith("genjax: error: no checkpoint folder")


def test_convert_then_generate_from_the_orbax_folder(folder, loaded, capsys, tmp_path):
    out_dir = tmp_path / "orbax"
    code, out, _ = _run(capsys, "convert", folder, out_dir)
    assert code == 0 and out == f"wrote {out_dir}\n"
    assert genjax.checkpoints.is_checkpoint(out_dir)
    _, params = genjax.checkpoints.restore(out_dir)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded[1]), strict=True):
        np.testing.assert_array_equal(a, b)
    argv = ["generate", "def fib", "--json"]
    assert _run(capsys, *argv, "--model", out_dir) == _run(capsys, *argv, "--model", folder)
    code, _, err = _run(capsys, "convert", folder, out_dir)
    assert code == 2 and "already exists and is not empty" in err
    assert _run(capsys, "convert", folder, out_dir, "--overwrite")[0] == 0


def test_console_script_runs():
    script = os.path.join(os.path.dirname(sys.executable), "genjax")
    if not os.path.exists(script):
        pytest.skip("the genjax console script is not installed in this environment")
    done = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert "generate" in done.stdout and "convert" in done.stdout


def test_prompt_too_long_errors_advise_something_possible(folder, loaded, capsys):
    # The tiny model has max_position_embeddings=64: a longer prompt leaves no room at all.
    code, out, err = _run(capsys, "generate", "hello " * 80, "--model", folder, "--json")
    assert (code, out) == (2, "")
    assert "Shorten the prompt to under 64 tokens" in err and "at most -" not in err
    model, params, tok = loaded
    batch = tok(["hello " * 6])
    config = genjax.GenerationConfig(max_length=3, eos_token_id=2, pad_token_id=0)
    with pytest.raises(genjax.errors.InputError) as info:
        # max_new_tokens=None: else the model's generation_config.json sets it, and it wins
        # over max_length (as in transformers).
        genjax.generate(model, params, batch["input_ids"], config, max_new_tokens=None)
    length = batch["input_ids"].shape[1]
    assert f"raise max_length above {length}" in str(info.value)


def _copy(folder, path):
    path.mkdir()
    for source in folder.iterdir():
        (path / source.name).write_bytes(source.read_bytes())
    return path


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_broken_files_and_bad_values_are_one_line_errors(folder, capsys, tmp_path):
    def fails(message, *argv):
        code, out, err = _run(capsys, *argv)
        assert (code, out) == (2, "")
        assert err.startswith("genjax: error: ") and message in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err

    for name in ("config.json", "tokenizer.json"):
        broken = _copy(folder, tmp_path / name.replace(".", "_"))
        _truncate(broken / name)
        fails(f"{broken / name} is not", "generate", "hi", "--model", broken)
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("café\n".encode("latin-1"))
    fails(f"--input {str(latin)!r} is not UTF-8", "generate", "--model", folder, "--input", latin)
    for seed in (2**64, -1):
        fails(
            f"argument --seed: must be an integer from 0 to 2**64 - 1, got {seed}",
            "generate",
            "hi",
            "--model",
            folder,
            "--seed",
            seed,
        )


def test_an_orbax_folder_with_a_data_file_missing_is_one_line_error(folder, capsys, tmp_path):
    orbax = tmp_path / "orbax"
    assert _run(capsys, "convert", folder, orbax)[0] == 0
    data = orbax / "params" / "ocdbt.process_0" / "d"
    for name in os.listdir(data):
        os.remove(data / name)
    # A real process: orbax's abandoned reads may fail on its threads as the process exits.
    argv = [sys.executable, "-m", "genjax.cli", "generate", "hi", "--model", str(orbax)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout) == (2, "")
    [line] = done.stderr.splitlines()
    assert line.startswith(f"genjax: error: cannot read the params in {str(orbax / 'params')!r}")


def test_seeds_beyond_32_bits_make_distinct_keys():
    data = [np.asarray(jax.random.key_data(cli_options.seed_key(s))) for s in (0, 2**32, 2**64 - 1)]
    np.testing.assert_array_equal(data[0], jax.random.key_data(jax.random.key(0)))
    assert len({d.tobytes() for d in data}) == 3


def test_convert_overwrite_refuses_a_folder_that_is_not_a_checkpoint(folder, capsys, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    code, out, err = _run(capsys, "convert", folder, mine, "--overwrite")
    assert (code, out) == (2, "") and "is not a genjax checkpoint" in err
    assert os.listdir(mine) == ["notes.txt"]


@pytest.mark.slow  # many CLI runs (24 s): runs with -m slow
def test_each_prompt_samples_with_its_own_key_whatever_the_batch(folder, loaded, capsys):
    prompts = ["hello", "hello", "def fib"]
    flags = ["--do-sample", "--top-k", "0", "--seed", "5", "--json", "--model", folder]
    runs = {}
    for size in (1, 3):
        code, out, err = _run(capsys, "generate", *prompts, *flags, "--batch-size", size)
        assert (code, err) == (0, "")
        runs[size] = [r["token_ids"] for r in _json_lines(out)]
    assert runs[1] == runs[3]
    assert runs[1][0] != runs[1][1]  # the same prompt twice: two samples
    config = genjax.GenerationConfig.from_pretrained(folder).replace(do_sample=True, top_k=0)
    key = jax.random.fold_in(jax.random.key(5), 2)
    assert runs[1][2] == _expected(loaded, ["def fib"], config, key=key)[0][0]
    # One prompt streams with the key of prompt 0: the same tokens as in a batch.
    code, out, _ = _run(capsys, "generate", "hello", *flags[:-3], "--model", folder)
    text = loaded[2].decode(runs[1][0], skip_special_tokens=True)
    assert (code, out) == (0, "hello" + text + "\n")


def test_json_counts_no_padding_after_a_stop_string_when_pad_is_eos(loaded, capsys, tmp_path):
    # Without pad_token_id, generate pads with the EOS id: a row ended by a stop string is
    # followed by EOS ids that were never generated.
    folder = tmp_path / "no_pad"
    vocab = _write_tokenizer(folder.mkdir() or folder)
    write_random_checkpoint(folder, "llama", vocab_size=vocab, num_hidden_layers=1, seed=0)
    (folder / "generation_config.json").write_text(
        json.dumps({"max_new_tokens": 6, "bos_token_id": 1, "eos_token_id": 2})
    )
    config = genjax.GenerationConfig.from_pretrained(folder)
    [(ids, _)] = _expected(loaded, ["def fib"], config.replace(pad_token_id=0))
    tok = loaded[2]
    end = next(k for k in range(2, 6) if tok.decode(ids[:k])[-1] not in "\ufffd ")
    stop = tok.decode(ids[:end])[-1]
    code, out, _ = _run(capsys, "generate", "def fib", "--model", folder, "--stop", stop, "--json")
    [record] = _json_lines(out)
    assert (record["token_ids"], record["num_new_tokens"]) == (ids[:end], end)


def test_text_output_echoes_the_prompt_in_every_mode(folder, loaded, capsys):
    config = genjax.GenerationConfig.from_pretrained(folder).replace(num_beams=2)
    [(_, beam_text)] = _expected(loaded, ["def fib"], config)
    code, out, _ = _run(capsys, "generate", "def fib", "--model", folder, "--num-beams", 2)
    assert (code, out) == (0, "def fib" + beam_text + "\n")
    code, out, _ = _run(capsys, "generate", "def fib", "hello", "--model", folder)
    greedy = _expected(loaded, ["def fib", "hello"], config.replace(num_beams=1))
    assert out == f"==> def fib <==\ndef fib{greedy[0][1]}\n\n==> hello <==\nhello{greedy[1][1]}\n"


def test_greedy_unsets_the_files_sampling_values_without_a_warning(
    folder, loaded, capsys, tmp_path
):
    sampling = _copy(folder, tmp_path / "sampling")
    settings = {**GENERATION, "do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 20}
    (sampling / "generation_config.json").write_text(json.dumps(settings))
    code, out, err = _run(capsys, "generate", "def fib", "--model", sampling, "--greedy", "--json")
    assert (code, err) == (0, "")
    [(ids, _)] = _expected(loaded, ["def fib"], genjax.GenerationConfig(**GENERATION))
    assert _json_lines(out)[0]["token_ids"] == ids
    code, out, err = _run(capsys, "config", "show", sampling, "--greedy")
    shown = json.loads(out)
    assert shown["do_sample"] is False and not {"temperature", "top_p", "top_k"} & set(shown)
    # A sampling flag given with --greedy is kept, and warned about as transformers does.
    code, out, err = _run(capsys, "config", "show", sampling, "--greedy", "--temperature", 0.5)
    assert json.loads(out)["temperature"] == 0.5 and "genjax: warning:" in err


def test_config_validate_reports_unknown_keys_with_the_closest_field(capsys, tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"top_kk": 5, "do_sample": True, "transformers_version": "5.0.0"})
    )
    code, out, err = _run(capsys, "config", "validate", tmp_path)
    assert (code, err) == (1, "")
    assert out == (
        f"{tmp_path / 'generation_config.json'}: unknown key 'top_kk', which no "
        "GenerationConfig field reads; did you mean 'top_k'?\n"
    )


def test_version_and_config_show_default_to_the_package_and_bundled_model(capsys):
    assert _run(capsys, "--version") == (0, "genjax 0.1.0\n", "")
    code, out, _ = _run(capsys, "config", "show")
    expected = genjax.GenerationConfig.from_pretrained(genjax.io.bundled.path())
    assert (code, out) == (0, expected.to_json_string())


def test_compile_cache_in_the_user_cache_dir_unless_turned_off(
    folder, capsys, monkeypatch, tmp_path
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("GENJAX_COMPILE_CACHE")
    argv = ["generate", "hi", "--model", folder, "--max-new-tokens", 2, "--json"]
    try:
        for off, env in ((["--no-compile-cache"], None), ([], "0"), ([], None)):
            genjax.disable_compile_cache()
            if env is not None:
                monkeypatch.setenv("GENJAX_COMPILE_CACHE", env)
            assert _run(capsys, *argv, *off)[0] == 0
            used = jax.config.values["jax_compilation_cache_dir"]
            assert used == (None if off or env else str(tmp_path / "genjax" / "xla"))
            monkeypatch.delenv("GENJAX_COMPILE_CACHE", raising=False)
        assert (tmp_path / "genjax" / "xla").is_dir()
    finally:
        genjax.disable_compile_cache()


@pytest.mark.slow  # many CLI runs (18 s): runs with -m slow
def test_token_healing_heals_each_prompt_as_generate_does(folder, loaded, capsys, tmp_path):
    model, params, tok = loaded
    healing = _copy(folder, tmp_path / "healing")  # the CLI reads token_healing from the file
    settings = {**GENERATION, "token_healing": True}
    (healing / "generation_config.json").write_text(json.dumps(settings))
    config = genjax.GenerationConfig(**settings)
    prompts = ["def fib", "hello w", "hello to"]
    want = []
    for prompt in prompts:
        ids = tok([prompt])["input_ids"]
        healed = np.asarray(genjax.heal_tokens(model, params, ids, tok))
        out = genjax.generate(model, params, ids, config, tokenizer=tok)
        new = np.asarray(out.sequences)[0, healed.shape[1] :].tolist()
        want.append(new[: new.index(2) + 1] if 2 in new else new)
        # The random model heals "fib" into "fibo" and "w" into "wor"; "to" stays.
        assert (healed.tolist() != ids.tolist()) == (prompt != "hello to")
    code, out, err = _run(capsys, "generate", *prompts, "--model", healing, "--json")
    assert (code, err) == (0, "")
    assert [record["token_ids"] for record in _json_lines(out)] == want
