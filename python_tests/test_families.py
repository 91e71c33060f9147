"""The model description (torch_offload/families.py): the README's support matrix is its table, and the tests'
registry of small models (test_apply's MODELS and FAMILIES) builds a model of every family it lists, and of no other."""

import re
import warnings
from pathlib import Path

from test_apply import FAMILIES as REGISTRY
from test_apply import make_model

from torch_offload.families import FAMILIES, support_matrix
from torch_offload.integrations.chunk_model import _decoder_and_layers

README = Path(__file__).parents[1] / "README.md"


def test_the_readmes_support_matrix_is_the_table():
    text = README.read_text()
    found = re.search(r"<!-- support matrix -->\n(.*?)\n<!-- end of the support matrix -->", text, re.S)
    assert found is not None, "README.md has no support matrix between its markers"
    assert found.group(1).strip() == support_matrix().strip()


def test_the_registry_builds_every_family_of_the_table():
    built = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "gpt2", *REGISTRY]:
            model = make_model(name) if name not in REGISTRY else REGISTRY[name][0]()
            decoder, _ = _decoder_and_layers(model)
            built[name] = decoder.config.model_type
    assert sorted(set(built.values())) == sorted(FAMILIES), built
