"""Finding the decoder layers apply changes, and each layer's MLP and attention module."""

from __future__ import annotations

from torch import nn

# What a decoder layer calls its MLP: "mlp" in most families, "feed_forward" in Llama 4's.
_MLP_NAMES = ("mlp", "feed_forward")


def _mlp_name(layer: nn.Module) -> str | None:
    """The name of the layer's MLP child (see _MLP_NAMES), or None."""
    return next((name for name in _MLP_NAMES if isinstance(getattr(layer, name, None), nn.Module)), None)


def _layer_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) > 0 and all(_mlp_name(m) for m in module)
    ]


def _decoder(model: nn.Module) -> nn.Module | None:
    # transformers' get_decoder() names the language model of a VLM (model.language_model).
    get_decoder = getattr(model, "get_decoder", None)
    if not callable(get_decoder):
        return None
    try:
        decoder = get_decoder()
    except (AttributeError, NotImplementedError, ValueError):  # transformers raises for a few exotic models
        return None
    return decoder if isinstance(decoder, nn.Module) else None


def _find_layers(model: nn.Module, path: str | None) -> tuple[str, nn.ModuleList]:
    if path is not None:
        try:
            layers = model.get_submodule(path)
        except AttributeError as error:
            raise ValueError(f"torch_offload.apply: layers={path!r}: {error}") from None
        if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
            raise ValueError(
                f"torch_offload.apply: layers={path!r} is a {type(layers).__name__}, not a non-empty nn.ModuleList"
            )
        return path, layers
    found = _layer_lists(model)
    if not found:
        raise ValueError(
            f"torch_offload.apply: found no decoder layers in {type(model).__name__}: looked for an nn.ModuleList "
            "whose every module has an `mlp` or a `feed_forward` (model.model.layers in Llama/Mistral/Qwen/Gemma/"
            "Phi-3, model.transformer.h in GPT-2); name them with layers='path.to.layers'"
        )
    decoder = _decoder(model)
    inside = found if decoder is None else [(n, m) for n, m in found if any(m is d for d in decoder.modules())]
    if len(inside) == 1:
        return inside[0]
    where = "" if decoder is None else f" (of which {len(inside)} inside its decoder {type(decoder).__name__})"
    raise ValueError(
        f"torch_offload.apply: cannot tell which of {[n for n, _ in found]}{where} are the decoder layers of "
        f"{type(model).__name__}; name them with layers='path.to.layers'"
    )


def _attention_of(layer: nn.Module) -> str | None:
    """The name of the layer's one attention child module (``self_attn``, ``attn``...), or None."""
    names = [name for name, child in layer.named_children() if type(child).__name__.endswith("Attention")]
    return names[0] if len(names) == 1 else None
