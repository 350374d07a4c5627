"""pi_0 as a flow policy's backbone: transformers' ``PI0ForConditionalGeneration`` (a
PaliGemma prefix over camera images and an instruction, and a Gemma action expert that
attends to the prefix's keys and values layer by layer).

The prefix is encoded once per observation (``encode_prefix``) and every denoising step
runs only the action expert over its cache (``Pi0Backbone.expert``), which also returns
the expert's output tokens: what a noise head and a critic read. The time convention
is the project's (t from 1 at noise to 0 at data, x_t = t·ε + (1-t)·a, velocity ε - a),
so ``omni_rl.algorithms.flow`` steps it unchanged. Whether the VLM trains is switched
per phase (``Pi0Backbone.train_vlm``); the expert, its state and action projections
always train.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from omni_rl.errors import OmniRLError
from omni_rl.models.config import LoRAConfig
from omni_rl.models.flow_policy import VelocityBackbone
from omni_rl.models.flow_policy_config import FlowPolicyConfig
from omni_rl.models.shared_prefix import gather_before_backward
from omni_rl.observations import FlatLayout
from omni_rl.runtime import umask_files


def tiny_pi0_config(
    vocab: int, image_token_id: int, width: int = 64, image_size: int = 32, chunk: int = 8, dims: int = 8
):
    """A PI0 config a CPU test runs in milliseconds (``tiny_vlm_and_expert``'s parts),
    ``chunk`` actions of ``dims`` numbers, 4 denoising steps."""
    from transformers import PI0Config

    vlm, expert = tiny_vlm_and_expert(vocab, image_token_id, width, image_size)
    return PI0Config(
        vlm_config=vlm,
        dit_config=expert,
        chunk_size=chunk,
        max_state_dim=dims,
        max_action_dim=dims,
        num_inference_steps=4,
    )


def tiny_vlm_and_expert(vocab: int, image_token_id: int, width: int, image_size: int) -> tuple[dict, dict]:
    """The configs of a tiny pi_0 family's VLM and action expert: a 2-layer
    ``width``-wide Gemma prefix over a 1-layer SigLIP on ``image_size``² images (16
    tokens an image) with the tokenizer's ``vocab`` and image placeholder id, and a
    2-layer expert half as wide."""
    if width < 32 or width % 32:
        raise OmniRLError(f"tiny pi0 width {width}: must be a multiple of 32")
    vlm = {
        "model_type": "paligemma",
        "text_config": {
            "model_type": "gemma",
            "hidden_size": width,
            "num_hidden_layers": 2,
            "intermediate_size": 2 * width,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "vocab_size": vocab,
        },
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "patch_size": image_size // 4,
            "image_size": image_size,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "vision_use_head": False,
        },
        "projection_dim": width,
        "image_token_id": image_token_id,
    }
    expert = {
        "model_type": "gemma",
        "hidden_size": width // 2,
        "num_hidden_layers": 2,
        "intermediate_size": width,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
    }
    return vlm, expert


def tiny_pi0_processor(
    image_size: int = 32, chunk: int = 8, dims: int = 8, image_tokens: int = 16, processor_class: str = "PI0Processor"
):
    """transformers' ``PI0Processor`` (or ``processor_class``, e.g. ``PI05Processor``) over
    an offline byte-level tokenizer (the 256 bytes, then ``<pad>``, ``<bos>``, ``<eos>``;
    the processor adds ``<image>`` and PaliGemma's location and segmentation tokens) and
    ``image_size``² images (``image_tokens`` tokens each). No state statistics:
    ``pi0_inputs`` passes the state as it is."""
    import transformers
    from transformers import PI0ImageProcessor

    from omni_rl.models.tokenizer import byte_level_tokenizer

    specials = ["<pad>", "<bos>", "<eos>"]
    tokenizer = byte_level_tokenizer(specials, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    images = PI0ImageProcessor(
        size={"max_height": image_size, "max_width": image_size},
        pad_size={"height": image_size, "width": image_size},
        image_seq_length=image_tokens,
    )
    return getattr(transformers, processor_class)(images, tokenizer, max_state_dim=dims, chunk_size=chunk)


def sized_pi0_processor(config, chunk: int, make=None):
    """``tiny_pi0_processor`` (or ``make``, of its arguments) sized for a PI0 or PI05
    ``config`` (its vision tower's image side and tokens, its state or action size), for
    a checkpoint of a released model's shapes with random weights; ``config``'s image
    token id becomes the processor's."""
    vision = config.vlm_config.vision_config
    tokens = (vision.image_size // vision.patch_size) ** 2
    dims = getattr(config, "max_state_dim", config.max_action_dim)
    processor = (make or tiny_pi0_processor)(vision.image_size, chunk, dims, tokens)
    config.vlm_config.image_token_id = processor.image_token_id
    return processor


def build_tiny_pi0(out: str | Path, seed: int = 0, width: int = 64) -> Path:
    """Write a tiny random-init PI0 checkpoint (``tiny_pi0_config``) with its processor
    (``tiny_pi0_processor``), which ``PI0ForConditionalGeneration.from_pretrained`` and
    ``AutoProcessor.from_pretrained`` load; the same seed gives the same weights."""
    processor = tiny_pi0_processor()
    config = tiny_pi0_config(len(processor.tokenizer), processor.image_token_id, width)
    return save_seeded("PI0ForConditionalGeneration", config, processor, out, seed)


def save_seeded(model_class: str, config, processor, out: str | Path, seed: int) -> Path:
    """Write transformers' ``model_class`` of ``config``, initialised under ``seed``,
    with ``processor`` to ``out``."""
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_class)(config)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    umask_files(out)  # safetensors writes 600
    return out


@dataclass
class Pi0Prefix:
    """One batch of observations' prefix, encoded once: every layer's keys and values
    (``cache``, holding only the prefix between denoising steps) and its token mask."""

    cache: object
    attention_mask: torch.Tensor
    length: int
    features: torch.Tensor | None  # [B, width] a critic's features of the VLM's output, detached (pi05)


@dataclass
class Pi0Observation:
    """A batch of observations as pi_0 reads them (``Pi0Backbone``'s inputs), and an
    optional privileged state only the critic reads (``value_input: obs``)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    pixel_values: torch.Tensor
    pixel_attention_mask: torch.Tensor
    state: torch.Tensor
    privileged: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.state.shape[0]

    @property
    def device(self) -> torch.device:
        return self.state.device

    def to(self, device) -> Pi0Observation:
        return Pi0Observation(*(None if v is None else v.to(device) for v in self._parts()))

    def _parts(self) -> tuple:
        return (
            self.input_ids,
            self.attention_mask,
            self.pixel_values,
            self.pixel_attention_mask,
            self.state,
            self.privileged,
        )


@dataclass
class Pi0Context:
    """What the denoising steps of one batch of observations share: the prefix, encoded
    once, the state, and the privileged state a critic may read."""

    prefix: Pi0Prefix
    state: torch.Tensor
    privileged: torch.Tensor | None


class Pi0Backbone(VelocityBackbone):
    """A PI0 checkpoint as a flow policy's velocity field over action chunks.

    Observations are ``Pi0Observation`` batches (what ``PI0Processor`` prepares:
    ``input_ids`` and ``attention_mask`` [B, P], instruction tokens with image
    placeholders first, ``pixel_values`` [B, cameras, 3, H, W], ``pixel_attention_mask``
    [B, cameras] and ``state`` [B, max_state_dim]), or an env's flat observations
    (``FlatLayout``), which go through ``processor`` first. The noise head reads each
    output token of the expert (which already encodes x and t); a critic on features
    reads the detached mean of the expert's tokens for a zero chunk at t = 1 (a
    function of the observation alone, not of the chain's start noise; the default
    here: the images are too large for a second network).

    Args:
        model: the ``PI0ForConditionalGeneration``.
        processor: its ``PI0Processor``, with the action and state statistics.
        layout: the env's flat observations; sets ``privileged_dim``.
        env_action_dim: the env's action numbers (at most the checkpoint's; default all).
        privileged_dim: the privileged state's size (``value_input: obs``).
    """

    KIND = "pi0"
    DEFAULT_VALUE_INPUT = "features"
    HAS_VLM = True
    SAVED_APART = "model."
    MODEL_CLASS = "PI0ForConditionalGeneration"  # transformers' class of the checkpoint
    CONFIG_CLASS = "PI0Config"  # and of its config

    def __init__(
        self,
        model,
        processor=None,
        layout: FlatLayout | None = None,
        env_action_dim: int | None = None,
        privileged_dim: int = 0,
    ):
        super().__init__()
        self.model, self.processor, self.layout = model, processor, layout
        self.lora_scale: float | None = None  # alpha / rank once the VLM has adapters
        config = model.config
        self.horizon, self.action_dim, self.steps = config.chunk_size, config.max_action_dim, config.num_inference_steps
        self.feature_dim = config.dit_config.hidden_size
        self.noise_dims = (self.feature_dim, self.action_dim)
        self.env_action_dim = self.action_dim if env_action_dim is None else env_action_dim
        if not 1 <= self.env_action_dim <= self.action_dim:
            raise OmniRLError(
                f"the env's {self.env_action_dim} action numbers do not fit the pi0 checkpoint's {self.action_dim}"
            )
        self.privileged_dim = privileged_dim if layout is None else layout.privileged_dim
        # the action expert reads the noisy actions' embeddings, never token ids: pi_0's
        # expert's token table (a quarter of a billion numbers) gets no gradient and stays frozen
        tokens = getattr(model.model.dit, "embed_tokens", None)
        if tokens is not None:
            tokens.requires_grad_(False)
        statistics(processor, "actions", torch.zeros(self.env_action_dim))  # other sizes fail here, not mid-run

    @staticmethod
    def build_tiny(out: str | Path, seed: int = 0, width: int = 64) -> Path:
        """Write a tiny random checkpoint of this family (``build_tiny_pi0``)."""
        return build_tiny_pi0(out, seed, width)

    @staticmethod
    def sized_processor(config, chunk: int):
        """The tiny processor sized for ``config`` (``sized_pi0_processor``)."""
        return sized_pi0_processor(config, chunk)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        processor=None,
        layout: FlatLayout | None = None,
        env_action_dim: int | None = None,
        privileged_dim: int = 0,
        **model_kwargs,
    ) -> Pi0Backbone:
        """The checkpoint at ``path``; ``model_kwargs`` go to transformers' loader
        (``chunk_size``: the weights do not depend on it)."""
        import transformers

        model_class = getattr(transformers, cls.MODEL_CLASS)
        model = model_class.from_pretrained(path, use_kernels=False, **model_kwargs)
        return cls(model, processor, layout, env_action_dim, privileged_dim)

    def train_vlm(self, on: bool) -> None:
        """Whether the VLM (vision tower, projector, language model) trains, or only its
        adapters when it has them (``add_vlm_lora``); the action expert and its
        projections always do. Off is pi_RL's RL setting."""
        for name, param in self.model.model.vlm.named_parameters():
            param.requires_grad_(on and (self.lora_scale is None or "lora_" in name))

    def add_vlm_lora(self, lora: LoRAConfig) -> None:
        """Low-rank adapters (peft) on the VLM language model's ``lora.target_modules``,
        which then train wherever the VLM does, in its weights' place."""
        from peft import inject_adapter_in_model

        inject_adapter_in_model(lora.peft_config(), self.model.model.vlm)
        self.lora_scale = lora.alpha / lora.rank

    def encode_prefix(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        pixel_values: torch.Tensor,
        pixel_attention_mask: torch.Tensor,
    ) -> Pi0Prefix:
        """Run the VLM over the images and instruction once: its cache is what every
        denoising step of these observations attends to."""
        core = self.model.model
        if pixel_values.shape[:2] != pixel_attention_mask.shape:
            raise OmniRLError(
                f"pi0 observations: pixel_values {tuple(pixel_values.shape)} does not match "
                f"pixel_attention_mask {tuple(pixel_attention_mask.shape)} (batch, cameras)"
            )
        embeds = core.embed_prefix(input_ids, pixel_values, pixel_attention_mask)
        out = core.vlm(
            inputs_embeds=embeds,
            attention_mask=attention_mask,
            position_ids=attention_mask.cumsum(-1) - 1,
            token_type_ids=torch.zeros_like(input_ids),
            use_cache=True,
        )
        cache = out.cache
        # the expert reads these keys and values past the VLM layers' outputs: under
        # FSDP2 their gradient gathers the layer that made them again
        attention = {m.layer_idx: m for m in core.vlm.modules() if isinstance(getattr(m, "layer_idx", None), int)}
        for index, layer in enumerate(cache.layers):
            gather_before_backward(attention[index], layer.keys, layer.values)
        features = self.prefix_features(out.last_hidden_state, attention_mask)
        return Pi0Prefix(cache, attention_mask, cache.get_seq_length(), features)

    def prefix_features(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor | None:
        """What a critic on features keeps of the VLM's last hidden states [B, P, width]:
        nothing here (pi_0's critic reads the expert's tokens), so they are not held."""
        return None

    def expert(
        self, prefix: Pi0Prefix, state: torch.Tensor, x: torch.Tensor, t: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(velocity [B, chunk, dims], the expert's output tokens [B, chunk, width]) at
        the noisy chunk ``x`` and times ``t`` [B]; the prefix's cache is left as it was."""
        model = self.model
        embeds = model.embed_action_time(state, x, t)
        try:
            out = model.model(action_embeds=embeds, attention_mask=prefix.attention_mask, cache=prefix.cache)
        finally:
            prefix.cache.crop(prefix.length - prefix.cache.get_seq_length())  # drop the chunk's keys
        tokens = out.last_hidden_state[:, -self.horizon :]
        return model.action_out_proj(tokens), tokens

    def observation(self, obs: Pi0Observation | torch.Tensor) -> Pi0Observation:
        """``obs`` as the model reads it."""
        if isinstance(obs, Pi0Observation):
            return obs
        if self.layout is None or self.processor is None:
            raise OmniRLError("a pi0 policy built without a FlatLayout and processor reads Pi0Observation batches only")
        images, index, state, privileged = self.layout.split(obs)
        instructions = [self.layout.instructions[i] for i in index.tolist()]
        inputs = self.inputs(images, instructions, state).to(obs.device)
        inputs.privileged = privileged
        return inputs

    def inputs(self, images: torch.Tensor, instructions: list[str], state: torch.Tensor) -> Pi0Observation:
        """An env's images, instructions and states as the model reads them (``pi0_inputs``)."""
        return pi0_inputs(self.processor, images, instructions, state)

    def encode(self, obs: Pi0Observation | torch.Tensor) -> Pi0Context:
        obs = self.observation(obs)
        prefix = self.encode_prefix(obs.input_ids, obs.attention_mask, obs.pixel_values, obs.pixel_attention_mask)
        return Pi0Context(prefix, obs.state, obs.privileged)

    def velocity(self, x: torch.Tensor, t: torch.Tensor, context: Pi0Context) -> tuple[torch.Tensor, torch.Tensor]:
        return self.expert(context.prefix, context.state, x, t)

    def critic_features(self, context: Pi0Context) -> torch.Tensor:
        n, state = context.state.shape[0], context.state
        still = torch.zeros(n, self.horizon, self.action_dim, device=state.device, dtype=state.dtype)
        with torch.no_grad():  # the critic reads the expert's features, and trains none of the expert
            _, tokens = self.expert(context.prefix, state, still, torch.ones(n, device=state.device))
        return tokens.mean(1)

    def privileged(self, obs: Pi0Observation | torch.Tensor, context: Pi0Context | None = None) -> torch.Tensor:
        if context is not None:
            return context.privileged
        if isinstance(obs, Pi0Observation) or self.layout is None:
            return self.observation(obs).privileged
        return self.layout.split(obs)[3]

    def from_env(self, actions: torch.Tensor) -> torch.Tensor:
        return normalize(self.processor, "actions", actions)

    def to_env(self, actions: torch.Tensor) -> torch.Tensor:
        return unnormalize(self.processor, "actions", actions)

    def save(self, directory: Path, weights: dict[str, torch.Tensor]) -> dict:
        """The checkpoint in ``backbone/`` (what transformers' ``from_pretrained`` reads,
        the VLM's adapters merged), with the processor."""
        if self.lora_scale is not None:
            weights = merge_lora(weights, self.lora_scale)
        model = {k.removeprefix(self.SAVED_APART): v for k, v in weights.items() if k.startswith(self.SAVED_APART)}
        self.model.save_pretrained(directory / "backbone", state_dict=model)
        if self.processor is not None:
            self.processor.save_pretrained(directory / "backbone")
        layout = self.layout
        return {
            "privileged_dim": self.privileged_dim,
            "env_action_dim": self.env_action_dim,
            "layout": None if layout is None else {**vars(layout), "instructions": list(layout.instructions)},
        }

    @classmethod
    def load(cls, directory: Path, spec: dict, config: FlowPolicyConfig) -> Pi0Backbone:
        layout, processor = spec["layout"], None
        if layout is not None:
            from transformers import AutoProcessor

            layout = FlatLayout(**{**layout, "instructions": tuple(layout["instructions"])})
            processor = AutoProcessor.from_pretrained(directory / "backbone")
        return cls.from_pretrained(
            directory / "backbone", processor, layout, spec["env_action_dim"], spec["privileged_dim"]
        )


def merge_lora(weights: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """``weights`` with peft's LoRA layers folded back into plain ones: each
    ``X.base_layer.weight`` becomes ``X.weight`` + ``scale`` · B A (its bias ``X.bias``),
    and the adapters' own entries are dropped."""
    merged = {}
    for key, value in weights.items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        if ".base_layer." in key:
            layer, _, leaf = key.rpartition(".base_layer.")
            if leaf == "weight":
                down, up = weights[f"{layer}.lora_A.default.weight"], weights[f"{layer}.lora_B.default.weight"]
                value = value + (scale * up.float() @ down.float()).to(value.dtype)
            key = f"{layer}.{leaf}"
        merged[key] = value
    return merged


def pi0_inputs(processor, images: torch.Tensor, instructions: list[str], state: torch.Tensor, max_tokens: int = 48):
    """A ``Pi0Observation`` from one camera's uint8 images [N, 3, H, W], N instructions
    and N states, through ``processor`` (a ``PI0Processor``): the images resized and
    normalized, each prompt ``<image>``s, ``<bos>``, instruction, newline, padded to the
    longest. The state is zero-padded to the processor's ``max_state_dim``, and
    normalized by its statistics when it has them. An instruction that makes the prompt's
    text (its tokens but the image's) longer than ``max_tokens`` is refused, naming it
    (pi_0 reads 48 tokens of text beside its 256 image tokens)."""
    check_images(images, instructions, state, "pi0")
    batch = processor(images=[[image] for image in images], text=instructions, padding="longest", return_tensors="pt")
    text = batch["attention_mask"] * (batch["input_ids"] != processor.image_token_id)
    lengths = text.sum(-1)
    if int(lengths.max()) > max_tokens:
        row = int(lengths.argmax())
        raise OmniRLError(
            f"pi0 observations: env {row}'s instruction {instructions[row]!r} makes a {int(lengths[row])}-token "
            f"prompt besides the image's, over the limit of {max_tokens}"
        )
    state = normalize(processor, "state", state.float())
    state = torch.nn.functional.pad(state, (0, processor.max_state_dim - state.shape[-1]))
    return Pi0Observation(
        batch["input_ids"], batch["attention_mask"], batch["pixel_values"], batch["pixel_attention_mask"], state
    )


def check_images(images: torch.Tensor, instructions: list[str], state: torch.Tensor, family: str) -> None:
    """Refuse images that are not uint8 [N, 3, H, W], or batches whose images,
    instructions and states differ in number."""
    if images.ndim != 4 or images.shape[1] != 3 or images.dtype != torch.uint8:
        raise OmniRLError(
            f"{family} observations: images must be uint8 [N, 3, H, W], got {images.dtype} {tuple(images.shape)}"
        )
    if not len(instructions) == images.shape[0] == state.shape[0]:
        raise OmniRLError(
            f"{family} observations: {images.shape[0]} images, {len(instructions)} instructions, "
            f"{state.shape[0]} states"
        )


NUMBERS = {"state": "state", "actions": "action"}
"""What a PI0Processor's statistics describe (``state_mean``, ``actions_mean``...), as
errors name them."""


STATISTICS = {"quantiles": ("q01", "q99"), "mean_std": ("mean", "std")}
"""The statistics a processor may hold of a feature, in the order they are preferred
(``PI05Processor.normalize``: quantiles where it has them, else mean and std)."""


def statistics(processor, feature: str, values: torch.Tensor) -> tuple[str, torch.Tensor, torch.Tensor] | None:
    """(rule, low, high): the processor's statistics [A] of ``feature`` ("state" or
    "actions") by ``STATISTICS``' order (quantiles q01 and q99, or mean and std), on
    ``values``' ([..., A]) device and dtype (the processors keep them as lists, and their
    own ``normalize`` makes CPU tensors of them); None where there is no processor or it
    has no statistics of ``feature``."""
    for rule, names in STATISTICS.items():
        low, high = (getattr(processor, f"{feature}_{name}", None) for name in names)
        if low is None and high is None:
            continue
        pair = " and ".join(f"{feature}_{name}" for name in names)
        if low is None or high is None:
            raise OmniRLError(f"pi0 processor: {pair} go together; it has only one of them")
        low, high = (torch.as_tensor(v, dtype=values.dtype, device=values.device) for v in (low, high))
        if not low.shape == high.shape == (values.shape[-1],):
            raise OmniRLError(
                f"pi0 processor: {NUMBERS[feature]} statistics of {low.numel()} numbers ({names[0]}) and "
                f"{high.numel()} ({names[1]}) for the env's {values.shape[-1]} {NUMBERS[feature]} numbers"
            )
        return rule, low, high
    return None


def normalize(processor, feature: str, values: torch.Tensor) -> torch.Tensor:
    """Env states or actions [..., A] in the units the model learns, by the processor's
    statistics of ``feature`` (before padding), unchanged without them: quantiles map
    [q01, q99] to [-1, 1] (``PI05Processor.normalize``'s rule), mean and std give
    (v - mean) / (std + 1e-8) (``PI0Processor.normalize``'s)."""
    found = statistics(processor, feature, values)
    if found is None:
        return values
    rule, low, high = found
    if rule == "quantiles":
        return 2.0 * (values - low) / torch.where(high - low == 0, 1e-8, high - low) - 1.0
    return (values - low) / (high + 1e-8)


def unnormalize(processor, feature: str, values: torch.Tensor) -> torch.Tensor:
    """``normalize`` reversed: the model's values [..., A] in the env's units."""
    found = statistics(processor, feature, values)
    if found is None:
        return values
    rule, low, high = found
    if rule == "quantiles":
        return (values + 1.0) / 2.0 * torch.where(high - low == 0, 1e-8, high - low) + low
    return values * (high + 1e-8) + low
