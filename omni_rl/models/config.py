"""The model sections: which checkpoint (``model:``, with ``lora:``) and how answers
are decoded (``generation:``, the demo's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from omni_rl.config import ModeDefaults, require, require_unset
from omni_rl.registry import did_you_mean


def require_family(name: str, field_name: str) -> None:
    """Validation helper: ``name`` is a registered model family."""
    from omni_rl.models.families import FAMILIES

    require(
        name in FAMILIES,
        field_name,
        f"unknown family '{name}'{did_you_mean(name, FAMILIES.names())}; known: {', '.join(FAMILIES)}",
    )


@dataclass
class LoRAConfig:
    """Low-rank adapters (peft); the reference policy is the base with adapters off."""

    rank: int = 16
    """Adapter rank r."""
    alpha: int = 32
    """Scaling numerator (the update is scaled by alpha / r)."""
    dropout: float = 0.0
    """Dropout on the adapter input."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Names of the linear layers that get adapters (in the language model)."""

    def __post_init__(self):
        require(self.rank >= 1, "rank", "must be >= 1")
        require(self.alpha > 0, "alpha", "must be > 0 (the adapters' update is scaled by alpha / rank)")
        require(0 <= self.dropout < 1, "dropout", "must be in [0, 1)")

    def peft_config(self):
        """peft's ``LoraConfig``: adapters on ``target_modules`` inside a language model."""
        from peft import LoraConfig

        targets = "|".join(self.target_modules)
        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=rf".*language_model.*\.({targets})",
        )


@dataclass
class ModelConfig(ModeDefaults):
    """Which checkpoint to load and which of its parameters train."""

    UNSET: ClassVar[dict[str, Any]] = {"tiny_family": "qwen2_5_vl", "tiny_width": 64, "tiny_audio_seconds": 30}

    path: str | None = None
    """A local Hugging Face checkpoint directory; unset builds a tiny model."""
    tiny_family: str | None = None
    """Family of the tiny model built when ``path`` is unset (unset: qwen2_5_vl)."""
    tiny_width: int | None = None
    """Decoder width of that tiny model (a multiple of 32; unset: 64, ~0.2 M params;
    128: ~0.6 M)."""
    tiny_audio_seconds: int | None = None
    """Audio window of that tiny model, for audio families (unset: 30 s, Qwen2-Audio's;
    a shorter window makes CPU runs on short clips cheaper)."""
    freeze_vision_tower: bool = False
    """Keep the vision encoder's weights fixed (refused for a model without one, and
    with ``lora``, whose adapters train the language model alone)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory (the group forward then
    recomputes the shared prompt prefix per mini-batch)."""
    lora: LoRAConfig | None = None
    """Train low-rank adapters instead of the full model."""

    def family(self) -> str:
        """The family of the model this section loads: ``path``'s, else ``tiny_family``."""
        from omni_rl.models import family_of

        return family_of(self.path).name if self.path else self.setting("tiny_family")

    def __post_init__(self):
        tiny = {name: getattr(self, name) for name in self.UNSET}
        if self.path:
            require_unset(tiny, "model.path (the checkpoint is loaded; no tiny model is built)")
        require_family(self.setting("tiny_family"), "tiny_family")
        width = self.setting("tiny_width")
        require(width >= 32 and width % 32 == 0, "tiny_width", "must be a multiple of 32")
        require(self.setting("tiny_audio_seconds") >= 1, "tiny_audio_seconds", "must be >= 1")
        require(
            not (self.freeze_vision_tower and self.lora is not None),
            "freeze_vision_tower",
            "does nothing with model.lora: the adapters train the language model alone, every other weight frozen",
        )


@dataclass
class GenerationConfig:
    """Sampling parameters for answers."""

    max_new_tokens: int = 16
    """Longest answer in tokens."""
    temperature: float = 0.0
    """0 decodes greedily."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0 disables."""

    def __post_init__(self):
        require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        require(self.temperature >= 0, "temperature", "must be >= 0")
        require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        require(self.top_k >= 0, "top_k", "must be >= 0")
