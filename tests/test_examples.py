"""The examples run end to end on the bundled model and print what they promise."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import chat  # noqa: E402
import quickstart  # noqa: E402


@pytest.mark.slow  # the example end to end (19 s): runs with -m slow
def test_quickstart_streams_batches_and_resamples(capsys):
    result = quickstart.main(["--max-new-tokens", "8"])
    printed = capsys.readouterr().out
    greedy = result["greedy"]
    assert greedy[0].startswith("import os\n") and greedy[1].startswith("class Stack:")
    assert len(greedy[0]) > len("import os\n")  # new text was added
    for text in greedy:
        assert text in printed
    assert printed.startswith("1. streamed") and "def fibonacci(n):" in printed
    first, second = np.asarray(result["first"]), np.asarray(result["second"])
    assert first.shape == second.shape
    np.testing.assert_array_equal(first[:, :-8], second[:, :-8])  # the same prompts
    assert not np.array_equal(first, second)  # new key and temperature, new samples


@pytest.mark.slow  # the example end to end (15 s): runs with -m slow
def test_chat_keeps_the_history_and_streams_replies(capsys):
    messages = chat.main(["--max-new-tokens", "6"], lines=["hello\n", "and again\n", "\n"])
    printed = capsys.readouterr().out
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert [m["content"] for m in messages[::2]] == ["hello", "and again"]
    for reply in messages[1::2]:
        assert reply["content"] and reply["content"] in printed
    assert printed.count("model> ") == 2
