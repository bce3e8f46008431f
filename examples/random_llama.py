"""Generate end to end with no network: a small random Llama, greedy and sampled.

Writes a Hugging Face-format checkpoint (config.json + model.safetensors) with random weights
into a temporary folder, loads it with ``genjax.models.from_pretrained``, and generates from a
left-padded batch of two prompts. Random weights give arbitrary token ids, not text; the point is
the API and the mechanics (padding, EOS, sampling keys, jit).

Run:  python examples/random_llama.py
"""

import functools
import tempfile

import jax
import numpy as np

import genjax
from genjax.testing import write_random_checkpoint


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        write_random_checkpoint(
            folder,
            "llama",
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
            max_position_embeddings=256,
        )
        model, params = genjax.models.from_pretrained(folder)

    pad = 0
    input_ids = np.array([[pad, pad, 17, 42, 99], [5, 6, 7, 8, 9]], np.int32)
    attention_mask = (input_ids != pad).astype(np.int32)

    greedy = genjax.GenerationConfig(max_new_tokens=12, pad_token_id=pad, eos_token_id=2)
    out = genjax.generate(model, params, input_ids, greedy, attention_mask=attention_mask)
    print("greedy:\n", np.asarray(out.sequences))

    sampling = greedy.replace(do_sample=True, temperature=0.8, top_k=50, top_p=0.95)
    out = genjax.generate(
        model, params, input_ids, sampling, attention_mask=attention_mask, key=jax.random.key(0)
    )
    print("sampled (temperature 0.8, top-k 50, top-p 0.95):\n", np.asarray(out.sequences))

    # The same call inside your own jit, with the config as an ordinary argument.
    generate = jax.jit(functools.partial(genjax.generate, model))
    out = generate(
        params,
        input_ids,
        sampling.replace(temperature=1.2),
        attention_mask=attention_mask,
        key=jax.random.key(1),
    )
    print("jitted, temperature 1.2:\n", np.asarray(out.sequences))


if __name__ == "__main__":
    main()
