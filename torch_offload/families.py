"""The model description: the transformers families apply() was read against, one row each, one column per feature.

Every part of apply() that depends on a family's code reads it here (``family_of(config)``), never a list of its own:
the segment-id masks and the sliding windows their attention passes on (masking.py, integrations/implementations.py),
attention over sequence-parallel ranks (integrations/sequence_parallelism.py), apply's loop over the layers
(integrations/layer_loop.py) and the chunk-recurrent step (integrations/chunk_recurrent.py). What a probe at apply
time cannot see is here as a fact of the family's code; what it can see, the probes check on the model at hand. The
README's support matrix is this table (python_tests/test_families.py checks it), and the tests and benches build each
family's small model from one registry (python_tests/families.py).

A family not in the table gets none of the features below: apply's other parts (tiled MLPs, the fused loss,
checkpointing and offload) need no row, their probes decide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["FAMILIES", "Family", "family_of"]


@dataclass(frozen=True)
class Family:
    """One family's row.

    - ``masks``: how packed documents and padded rows reach its attention without a ``[T, T]`` mask: ``"sdpa"``
      (masking.IMPLEMENTATION, where the model runs SDPA), ``"eager"`` (eager_attention.IMPLEMENTATION: soft-capped
      scores, sinks), or None (transformers' own masks); its modelling code hands the mask to the attention untouched.
    - ``passes_window``: its attention modules pass their layer's sliding window to the attention function.
    - ``sequence_parallel``: its attention runs over a sequence-parallel group's ranks (tested over ranks).
    - ``packs_documents``: its decoder reads packed documents off ``position_ids`` (GPT-OSS's, in transformers 5.24,
      builds its masks without them, so its documents attend to each other; its attention over ranks does the same;
      Qwen2-VL's reads them only off a fourth row of 3D positions, text positions, which a text call does not pass).
    - ``llama_loop``: its decoder and layer forwards are Llama's, so that apply can run the loop over the layers.
    - ``places_from_cache``: its attention reads each token's place in the call (the call's 0..T-1, not its
      ``position_ids``) off a key/value cache's length: Llama 4's query temperature in its layers without rotary
      embedding. The step cuts its chunks at row ends and hands each layer a cache that says where its chunk begins.
    - ``step``: None where the chunk-recurrent step computes what its forward computes, chunk by chunk; else why not,
      a fact of its code no probe on a short batch shows.
    """

    name: str
    masks: str | None = "sdpa"
    passes_window: bool = False
    sequence_parallel: bool = True
    packs_documents: bool = True
    llama_loop: bool = False
    places_from_cache: bool = False
    step: str | None = None


FAMILIES: dict[str, Family] = {
    "llama": Family("Llama", llama_loop=True),
    "mistral": Family("Mistral", passes_window=True, llama_loop=True),
    "qwen2": Family("Qwen2", passes_window=True, llama_loop=True),
    "qwen3": Family("Qwen3", passes_window=True, llama_loop=True),
    "gemma": Family("Gemma", llama_loop=True),
    "gemma2": Family("Gemma 2", masks="eager", passes_window=True),
    "gemma3_text": Family("Gemma 3", passes_window=True),
    "gemma3n_text": Family("Gemma 3n", masks=None, sequence_parallel=False),
    "phi3": Family("Phi-3", passes_window=True),
    "gpt2": Family("GPT-2"),
    "olmo2": Family("OLMo 2"),
    "granite": Family("Granite"),
    "smollm3": Family("SmolLM3", passes_window=True, llama_loop=True),
    "cohere": Family("Cohere"),
    "glm4": Family("GLM-4"),
    "mixtral": Family("Mixtral", passes_window=True, llama_loop=True),
    "qwen2_moe": Family("Qwen2-MoE"),
    "qwen3_moe": Family("Qwen3-MoE", passes_window=True, llama_loop=True),
    "deepseek_v3": Family("DeepSeek-V3", llama_loop=True),
    "gpt_oss": Family("GPT-OSS", masks="eager", passes_window=True, packs_documents=False),
    "llama4_text": Family("Llama 4", sequence_parallel=False, places_from_cache=True),
    "qwen2_vl_text": Family("Qwen2-VL", masks=None, sequence_parallel=False, packs_documents=False),
}


def family_of(config: Any) -> Family | None:
    """The row of ``config``'s family (its ``model_type``), or None for a family not read."""
    return FAMILIES.get(getattr(config, "model_type", None))


def support_matrix() -> str:
    """The table as the README shows it (python_tests/test_families.py checks that it does): a row per family, a word
    per feature, the step's reasons as notes below."""
    notes: dict[str, int] = {}
    rows = [
        "| family | packed, padded batches | windows | sequence parallel | apply's layer loop | chunk-recurrent step |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for family in FAMILIES.values():
        step = "Y" if family.step is None else f"no [{notes.setdefault(family.step, len(notes) + 1)}]"
        cells = [
            {"sdpa": "Y", "eager": "Y (eager)", None: "dense mask"}[family.masks],
            "Y" if family.passes_window else "—",
            "Y" if family.sequence_parallel else "—",
            "Y" if family.llama_loop else "—",
            step,
        ]
        rows.append(f"| {family.name} | {' | '.join(cells)} |")
    return "\n".join(rows + [""] + [f"[{number}] {why}." for why, number in notes.items()])
