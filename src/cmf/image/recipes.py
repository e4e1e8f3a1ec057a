"""The pipelines this version packs and runs, as data (spec §12; docs/IMAGE.md).

A :class:`Recipe` says which diffusers pipeline class it is, which subfolders become which
namespace in the file, which source tensors each namespace keeps and how their names change,
and which classes the loader may build from the component configs. Classes are only ever
looked up from these lists, never from a name a file or folder supplies on its own.

Only Lumina-Image 2.0 (``arch_name: "lumina2-image"``) is supported. Stable-Diffusion-class
(UNet, CLIP) and Flux-class (two text encoders and two tokenizers) pipelines do not fit §12's
one-text-encoder, one-tokenizer layout without new namespaces; they are refused by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Component", "Recipe", "LUMINA2", "RECIPES", "by_arch", "by_pipeline_class", "CONFIG_SUFFIX",
           "KNOWN_UNSUPPORTED", "supported_text"]

CONFIG_SUFFIX = "config_json"  # `{prefix}.config_json`: the component's config as a u8 tensor


@dataclass(frozen=True)
class Component:
    """One weight-carrying component: diffusers subfolder -> file namespace."""

    prefix: str  # namespace in the file (`te`, `dit`, `vae`)
    folder: str  # diffusers subfolder (`text_encoder`, `transformer`, `vae`)
    what: str  # provenance.components text
    library: str  # "transformers" or "diffusers": who builds it
    classes: tuple[str, ...]  # model_index.json classes accepted for this folder
    build: str  # the class the loader builds (transformers: built through AutoModel)
    keep: str = r""  # regex a source name must match to be packed ("" = every tensor)
    strip: str = ""  # a source-name prefix dropped (the checkpoint's `model.` wrapper)
    drop: tuple[str, ...] = ()  # source names never packed (after strip)
    model_types: tuple[str, ...] = ()  # accepted transformers `model_type`s

    def out_name(self, source: str) -> str | None:
        """The file name of source tensor ``source``, or None when it is not packed."""
        n = source[len(self.strip):] if self.strip and source.startswith(self.strip) else source
        if n in self.drop or (self.keep and not re.match(self.keep, n)):
            return None
        return f"{self.prefix}.{n}"

    @property
    def config_name(self) -> str:
        return f"{self.prefix}.{CONFIG_SUFFIX}"


@dataclass(frozen=True)
class Recipe:
    """A whole pipeline: its header tag, components, scheduler and tokenizer."""

    arch_name: str  # header arch.arch_name
    pipeline: str  # provenance.pipeline
    pipeline_class: str  # diffusers pipeline class (model_index.json `_class_name`)
    components: tuple[Component, ...]
    text_encoder: str  # the prefix whose config the header's `arch` block describes
    scheduler_classes: tuple[str, ...]
    tokenizer_classes: tuple[str, ...]
    default_tokenizer: str
    # Within-component names of the timestep-only (adaLN / modulation) projections.
    modulation: str = r"(?!)"
    token_table: str = r"(?!)"  # the text encoder's embedding table
    scheduler_prefix: str = "scheduler"

    def component(self, prefix: str) -> Component:
        for c in self.components:
            if c.prefix == prefix:
                return c
        raise KeyError(prefix)


LUMINA2 = Recipe(
    arch_name="lumina2-image",
    pipeline="lumina-image-2.0",
    pipeline_class="Lumina2Pipeline",
    components=(
        Component("te", "text_encoder", "gemma-2 encoder", "transformers",
                  ("Gemma2Model", "Gemma2ForCausalLM"), "Gemma2Model",
                  strip="model.", drop=("lm_head.weight",), model_types=("gemma2",)),
        Component("dit", "transformer", "next-dit", "diffusers",
                  ("Lumina2Transformer2DModel",), "Lumina2Transformer2DModel"),
        # Text-to-image needs only the decoder half (and the post-quant conv in front of it).
        Component("vae", "vae", "flux-vae decoder", "diffusers", ("AutoencoderKL",), "AutoencoderKL",
                  keep=r"(decoder|post_quant_conv)\."),
    ),
    text_encoder="te",
    scheduler_classes=("FlowMatchEulerDiscreteScheduler",),
    tokenizer_classes=("GemmaTokenizer", "GemmaTokenizerFast"),
    default_tokenizer="GemmaTokenizer",
    # LuminaRMSNormZero's `norm1.linear`, the final norm's `linear_1` and the timestep MLP: maps
    # of the timestep alone, whose error reaches every token's normalization (FORMATS.md).
    modulation=r"(.*\.norm1\.linear|norm_out\.linear_1|time_caption_embed\.timestep_embedder\.linear_[12])\.weight\Z",
    token_table=r"embed_tokens\.weight\Z",
)

RECIPES: dict[str, Recipe] = {r.arch_name: r for r in (LUMINA2,)}

# Pipeline classes recognised but not supported, with the reason given to the user.
KNOWN_UNSUPPORTED = {
    "StableDiffusionPipeline": "a UNet denoiser and a CLIP text encoder",
    "StableDiffusionXLPipeline": "two text encoders and two tokenizers",
    "FluxPipeline": "two text encoders (CLIP + T5) and two tokenizers",
    "StableDiffusion3Pipeline": "three text encoders",
    "SanaPipeline": "a different denoiser and text encoder",
}


def by_arch(arch_name: str) -> Recipe | None:
    """The recipe of a file's ``arch.arch_name``, or None."""
    return RECIPES.get(arch_name)


def by_pipeline_class(name: str) -> Recipe | None:
    """The recipe of a diffusers pipeline class name (``model_index.json``), or None."""
    return next((r for r in RECIPES.values() if r.pipeline_class == name), None)


def supported_text() -> str:
    """Human list of supported pipelines for error messages."""
    return ", ".join(f"{r.pipeline_class} ({r.arch_name})" for r in RECIPES.values())
