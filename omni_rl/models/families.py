"""Model families: how each Qwen multimodal family is built tiny, loaded and prompted.

A family is registered under its Hugging Face ``model_type``; ``omni_rl.models.load``
reads that field from a checkpoint's config.json and finds the family here, so tiny
and released checkpoints load through one path. Tiny configs are random-init models
of at most 2 M parameters for tests and CPU demos; their token ids match the offline
tokenizer of ``omni_rl.models.tokenizer``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import transformers
from transformers import PretrainedConfig, ProcessorMixin, Qwen2Tokenizer

from omni_rl.models.tokenizer import TokenSpec
from omni_rl.registry import Registry

CHAT = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Pixel budgets small enough for CPU tests; real checkpoints carry their own.
TINY_IMAGE_PIXELS = {"shortest_edge": 4 * 28 * 28, "longest_edge": 64 * 28 * 28}
TINY_VIDEO_PIXELS = {"shortest_edge": 4 * 28 * 28, "longest_edge": 32 * 28 * 28}


@dataclass(frozen=True)
class Family:
    """One model family.

    Attributes:
        name: the Hugging Face ``model_type`` of its checkpoints' config.json.
        model_class: the transformers class name that loads it.
        modalities: media the family takes besides text (``image``, ``video``, ``audio``).
        patch_size: the vision encoder's spatial patch (0 for audio-only families).
        tokens: special tokens and prompt markup of the offline tokenizer.
        tiny_config: ``(tokenizer, width) -> config`` for a random-init model whose
            decoder is ``width`` wide (a multiple of 32; 64 gives about 0.2 M params).
        tiny_processor: ``(tokenizer) -> processor`` with budgets sized for CPU tests.
        loader: ``(path, dtype, empty=False) -> model`` for checkpoints whose trained part
            is not the whole model (a released Omni's thinker); ``empty``: built on the meta
            device, nothing read. None: ``model_class.from_pretrained`` (or, empty,
            ``omni_rl.models.weights.empty_model``).
    """

    name: str
    model_class: str
    modalities: tuple[str, ...]
    patch_size: int
    tokens: TokenSpec
    tiny_config: Callable[[Qwen2Tokenizer, int], PretrainedConfig]
    tiny_processor: Callable[[Qwen2Tokenizer], ProcessorMixin]
    loader: Callable | None = None

    def model_cls(self) -> type:
        """The transformers model class of this family."""
        return getattr(transformers, self.model_class)


FAMILIES: Registry[Family] = Registry("model family")


def _ids(tokenizer: Qwen2Tokenizer, **tokens: str) -> dict[str, int]:
    return {key: tokenizer.convert_tokens_to_ids(token) for key, token in tokens.items()}


def _text_config(tokenizer: Qwen2Tokenizer, width: int, **extra) -> dict:
    """A 2-layer decoder ``width`` wide, head_dim 16, with multimodal RoPE sections (2+3+3=8)."""
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": width,
        "intermediate_size": 2 * width,
        "num_hidden_layers": 2,
        "num_attention_heads": width // 16,
        "num_key_value_heads": width // 32,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        "bos_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        **extra,
    }


def _audio_encoder_config(**extra) -> dict:
    """A 1-layer Whisper-style encoder over 128 mel bins."""
    return {
        "num_mel_bins": 128,
        "encoder_layers": 1,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 64,
        "d_model": 32,
        "max_source_positions": 1500,
        **extra,
    }


def _vision_encoder_config(width: int, patch_size: int = 14, **extra) -> dict:
    """A 2-block ViT half as wide as the ``width``-wide decoder it projects to."""
    return {
        "depth": 2,
        "hidden_size": width // 2,
        "intermediate_size": width,
        "num_heads": width // 32,
        "patch_size": patch_size,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": width,
        **extra,
    }


VL_TOKENS = TokenSpec(
    specials=(*CHAT, "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
    named={
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "vision_start_token": "<|vision_start|>",
        "vision_end_token": "<|vision_end|>",
    },
    markup={
        "image": "<|vision_start|><|image_pad|><|vision_end|>",
        "video": "<|vision_start|><|video_pad|><|vision_end|>",
    },
    system_prompt="You are a helpful assistant.",
)


def _vl_ids(tokenizer: Qwen2Tokenizer) -> dict[str, int]:
    return _ids(
        tokenizer,
        image_token_id="<|image_pad|>",
        video_token_id="<|video_pad|>",
        vision_start_token_id="<|vision_start|>",
        vision_end_token_id="<|vision_end|>",
    )


def _qwen_vl_processor(processor_class: str, patch_size: int, video_processor_class: str) -> Callable:
    def build(tokenizer: Qwen2Tokenizer) -> ProcessorMixin:
        scale = (patch_size * 2) ** 2 / 28**2
        image_size = {k: int(v * scale) for k, v in TINY_IMAGE_PIXELS.items()}
        video_size = {k: int(v * scale) for k, v in TINY_VIDEO_PIXELS.items()}
        image_processor = transformers.Qwen2VLImageProcessor(size=image_size, patch_size=patch_size)
        video_processor = getattr(transformers, video_processor_class)(
            size=video_size,
            patch_size=patch_size,
            # omni_rl samples frames itself; the per-frame pixel cap matches qwen-vl-utils.
            do_sample_frames=False,
            cap_pixels_per_frame=True,
        )
        return getattr(transformers, processor_class)(
            image_processor=image_processor,
            video_processor=video_processor,
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
        )

    return build


FAMILIES.register("qwen2_vl")(
    Family(
        name="qwen2_vl",
        model_class="Qwen2VLForConditionalGeneration",
        modalities=("image", "video"),
        patch_size=14,
        tokens=VL_TOKENS,
        tiny_config=lambda tok, width: transformers.Qwen2VLConfig(
            text_config=_text_config(tok, width),
            vision_config={
                "depth": 2,
                "embed_dim": width // 2,
                "hidden_size": width,
                "mlp_ratio": 2,
                "num_heads": width // 32,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
            },
            **_vl_ids(tok),
        ),
        tiny_processor=_qwen_vl_processor("Qwen2VLProcessor", 14, "Qwen2VLVideoProcessor"),
    )
)

FAMILIES.register("qwen2_5_vl")(
    Family(
        name="qwen2_5_vl",
        model_class="Qwen2_5_VLForConditionalGeneration",
        modalities=("image", "video"),
        patch_size=14,
        tokens=VL_TOKENS,
        tiny_config=lambda tok, width: transformers.Qwen2_5_VLConfig(
            text_config=_text_config(tok, width),
            vision_config=_vision_encoder_config(width, window_size=112, fullatt_block_indexes=[1]),
            **_vl_ids(tok),
        ),
        tiny_processor=_qwen_vl_processor("Qwen2_5_VLProcessor", 14, "Qwen2VLVideoProcessor"),
    )
)

FAMILIES.register("qwen3_vl")(
    Family(
        name="qwen3_vl",
        model_class="Qwen3VLForConditionalGeneration",
        modalities=("image", "video"),
        patch_size=16,
        tokens=VL_TOKENS,
        tiny_config=lambda tok, width: transformers.Qwen3VLConfig(
            text_config=_text_config(
                tok,
                width,
                head_dim=16,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "mrope_section": [2, 3, 3],
                    "mrope_interleaved": True,
                },
            ),
            vision_config=_vision_encoder_config(
                width, patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0]
            ),
            **_vl_ids(tok),
        ),
        tiny_processor=_qwen_vl_processor("Qwen3VLProcessor", 16, "Qwen3VLVideoProcessor"),
    )
)

AUDIO_TOKENS = TokenSpec(
    specials=(*CHAT, "<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>"),
    named={"audio_token": "<|AUDIO|>", "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"},
    markup={"audio": "<|audio_bos|><|AUDIO|><|audio_eos|>"},
    system_prompt="You are a helpful assistant.",
)

FAMILIES.register("qwen2_audio")(
    Family(
        name="qwen2_audio",
        model_class="Qwen2AudioForConditionalGeneration",
        modalities=("audio",),
        patch_size=0,
        tokens=AUDIO_TOKENS,
        tiny_config=lambda tok, width: transformers.Qwen2AudioConfig(
            audio_config=_audio_encoder_config(),
            text_config={"model_type": "qwen2", **_text_config(tok, width, rope_parameters=None)},
            audio_token_index=tok.convert_tokens_to_ids("<|AUDIO|>"),
        ),
        tiny_processor=lambda tok: transformers.Qwen2AudioProcessor(
            feature_extractor=transformers.WhisperFeatureExtractor(feature_size=128),
            tokenizer=tok,
            chat_template=tok.chat_template,
        ),
    )
)

OMNI_TOKENS = TokenSpec(
    specials=(
        *CHAT,
        "<|audio_bos|>",
        "<|audio_eos|>",
        "<|AUDIO|>",
        "<|vision_bos|>",
        "<|vision_eos|>",
        "<|IMAGE|>",
        "<|VIDEO|>",
    ),
    named={
        "image_token": "<|IMAGE|>",
        "video_token": "<|VIDEO|>",
        "audio_token": "<|AUDIO|>",
        "vision_bos_token": "<|vision_bos|>",
        "vision_eos_token": "<|vision_eos|>",
        "audio_bos_token": "<|audio_bos|>",
        "audio_eos_token": "<|audio_eos|>",
    },
    markup={
        "image": "<|vision_bos|><|IMAGE|><|vision_eos|>",
        "video": "<|vision_bos|><|VIDEO|><|vision_eos|>",
        "audio": "<|audio_bos|><|AUDIO|><|audio_eos|>",
    },
    system_prompt="You are a helpful assistant.",
)


def _omni_thinker_config(tok: Qwen2Tokenizer, width: int) -> PretrainedConfig:
    ids = _ids(
        tok,
        audio_token_index="<|AUDIO|>",
        image_token_index="<|IMAGE|>",
        video_token_index="<|VIDEO|>",
        audio_start_token_id="<|audio_bos|>",
        audio_end_token_id="<|audio_eos|>",
        vision_start_token_id="<|vision_bos|>",
        vision_end_token_id="<|vision_eos|>",
    )
    return transformers.Qwen2_5OmniThinkerConfig(
        audio_config=_audio_encoder_config(n_window=50, output_dim=width),
        vision_config=_vision_encoder_config(width, window_size=112, fullatt_block_indexes=[1]),
        text_config=_text_config(tok, width),
        user_token_id=tok.convert_tokens_to_ids("<|im_start|>"),
        **ids,
    )


def _omni_processor(tok: Qwen2Tokenizer) -> ProcessorMixin:
    return transformers.Qwen2_5OmniProcessor(
        image_processor=transformers.Qwen2VLImageProcessor(size=TINY_IMAGE_PIXELS),
        video_processor=transformers.Qwen2VLVideoProcessor(
            size=TINY_VIDEO_PIXELS, do_sample_frames=False, cap_pixels_per_frame=True
        ),
        feature_extractor=transformers.WhisperFeatureExtractor(feature_size=128),
        tokenizer=tok,
        chat_template=tok.chat_template,
    )


FAMILIES.register("qwen2_5_omni_thinker")(
    Family(
        name="qwen2_5_omni_thinker",
        model_class="Qwen2_5OmniThinkerForConditionalGeneration",
        modalities=("image", "video", "audio"),
        patch_size=14,
        tokens=OMNI_TOKENS,
        tiny_config=_omni_thinker_config,
        tiny_processor=_omni_processor,
    )
)


def _omni_config(tok: Qwen2Tokenizer, width: int) -> PretrainedConfig:
    """A released-layout Omni: the tiny thinker plus a 1-layer talker and a tiny
    vocoder (DiT and BigVGAN), so that loading one can be tested without a download."""
    thinker = _omni_thinker_config(tok, width)
    media_ids = {
        key: getattr(thinker, key)
        for key in (
            "audio_token_index",
            "image_token_index",
            "video_token_index",
            "vision_start_token_id",
            "vision_end_token_id",
            "audio_start_token_id",
            "audio_end_token_id",
        )
    }
    talker = {
        "vocab_size": 64,
        "embedding_size": width,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        "tts_codec_start_token_id": 60,
        "tts_codec_end_token_id": 61,
        "tts_codec_pad_token_id": 62,
        "tts_codec_mask_token_id": 63,
        **_ids(
            tok,
            tts_text_start_token_id="<|im_start|>",
            tts_text_end_token_id="<|im_end|>",
            tts_text_pad_token_id="<|endoftext|>",
        ),
        **media_ids,
    }
    dit = {
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "head_dim": 16,
        "emb_dim": 16,
        "num_embeds": 64,
        "enc_emb_dim": 16,
        "enc_dim": 16,
        "enc_channels": [16, 16, 16, 16, 48],
        "enc_attention_channels": 8,
        "enc_se_channels": 8,
        "look_ahead_layers": [0],
        "look_backward_layers": [0],
    }
    bigvgan = {"upsample_initial_channel": 64, "resblock_kernel_sizes": [3], "resblock_dilation_sizes": [[1, 3, 5]]}
    return transformers.Qwen2_5OmniConfig(
        thinker_config=thinker.to_dict(),
        talker_config=talker,
        token2wav_config={"dit_config": dit, "bigvgan_config": bigvgan},
    )


def _thinker_loader(thinker_class: str) -> Callable:
    def load(path, dtype, empty=False):
        from omni_rl.models.omni import load_thinker

        return load_thinker(path, dtype, getattr(transformers, thinker_class), empty)

    return load


# A released Qwen2.5-Omni checkpoint (thinker + talker): its thinker is what trains.
FAMILIES.register("qwen2_5_omni")(
    Family(
        name="qwen2_5_omni",
        model_class="Qwen2_5OmniForConditionalGeneration",
        modalities=("image", "video", "audio"),
        patch_size=14,
        tokens=OMNI_TOKENS,
        tiny_config=_omni_config,
        tiny_processor=_omni_processor,
        loader=_thinker_loader("Qwen2_5OmniThinkerForConditionalGeneration"),
    )
)

QWEN3_OMNI_TOKENS = TokenSpec(
    specials=(
        *CHAT,
        "<|audio_start|>",
        "<|audio_end|>",
        "<|audio_pad|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ),
    named={
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "audio_token": "<|audio_pad|>",
        "vision_bos_token": "<|vision_start|>",
        "vision_eos_token": "<|vision_end|>",
        "audio_bos_token": "<|audio_start|>",
        "audio_eos_token": "<|audio_end|>",
    },
    markup={
        "image": "<|vision_start|><|image_pad|><|vision_end|>",
        "video": "<|vision_start|><|video_pad|><|vision_end|>",
        "audio": "<|audio_start|><|audio_pad|><|audio_end|>",
    },
    system_prompt="You are a helpful assistant.",
)


def _qwen3_omni_thinker_config(tok: Qwen2Tokenizer, width: int) -> PretrainedConfig:
    """The Qwen3-Omni thinker: a mixture-of-experts decoder (4 experts, 2 per token)
    with interleaved multimodal RoPE, a Qwen3-VL-style vision tower and a chunked audio
    encoder."""
    text = _text_config(
        tok,
        width,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=width,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        },
    )
    return transformers.Qwen3OmniMoeThinkerConfig(
        audio_config=_audio_encoder_config(output_dim=width, downsample_hidden_size=16),
        vision_config=_vision_encoder_config(
            width, patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0]
        ),
        text_config=text,
        user_token_id=tok.convert_tokens_to_ids("<|im_start|>"),
        **_ids(
            tok,
            audio_token_id="<|audio_pad|>",
            image_token_id="<|image_pad|>",
            video_token_id="<|video_pad|>",
            audio_start_token_id="<|audio_start|>",
            audio_end_token_id="<|audio_end|>",
            vision_start_token_id="<|vision_start|>",
            vision_end_token_id="<|vision_end|>",
        ),
    )


def _qwen3_omni_processor(tok: Qwen2Tokenizer) -> ProcessorMixin:
    scale = 32**2 / 28**2
    return transformers.Qwen3OmniMoeProcessor(
        image_processor=transformers.Qwen2VLImageProcessor(
            size={k: int(v * scale) for k, v in TINY_IMAGE_PIXELS.items()}, patch_size=16
        ),
        video_processor=transformers.Qwen2VLVideoProcessor(
            size={k: int(v * scale) for k, v in TINY_VIDEO_PIXELS.items()},
            patch_size=16,
            do_sample_frames=False,
            cap_pixels_per_frame=True,
        ),
        feature_extractor=transformers.WhisperFeatureExtractor(feature_size=128),
        tokenizer=tok,
        chat_template=tok.chat_template,
    )


FAMILIES.register("qwen3_omni_moe_thinker")(
    Family(
        name="qwen3_omni_moe_thinker",
        model_class="Qwen3OmniMoeThinkerForConditionalGeneration",
        modalities=("image", "video", "audio"),
        patch_size=16,
        tokens=QWEN3_OMNI_TOKENS,
        tiny_config=_qwen3_omni_thinker_config,
        tiny_processor=_qwen3_omni_processor,
    )
)


def _qwen3_omni_config(tok: Qwen2Tokenizer, width: int) -> PretrainedConfig:
    """A released-layout Qwen3-Omni: the tiny thinker plus a 1-layer talker (with its
    code predictor) and a tiny code-to-wave decoder."""
    thinker = _qwen3_omni_thinker_config(tok, width)
    shared = ("audio_token_id", "image_token_id", "video_token_id", "vision_start_token_id", "audio_start_token_id")
    media_ids = {key: getattr(thinker, key) for key in shared}
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    talker = {
        "code_predictor_config": {
            **small,
            "vocab_size": 64,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "num_code_groups": 2,
        },
        "text_config": {
            **small,
            "vocab_size": 64,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "num_experts": 2,
            "num_experts_per_tok": 1,
            "rope_parameters": thinker.text_config.rope_parameters,
        },
        "num_code_groups": 2,
        "spatial_merge_size": 2,
        "thinker_hidden_size": width,
        "accept_hidden_layer": 1,
        "codec_pad_id": 58,
        "codec_bos_id": 59,
        "codec_eos_token_id": 60,
        "codec_nothink_id": 61,
        "codec_think_bos_id": 62,
        "codec_think_eos_id": 63,
        **media_ids,
    }
    code2wav = {
        **small,
        "codebook_size": 64,
        "num_key_value_heads": 2,
        "num_quantizers": 2,
        "sliding_window": 8,
        "decoder_dim": 32,
        "upsample_rates": [2, 2, 2, 2],
        "upsampling_ratios": [2, 2],
    }
    return transformers.Qwen3OmniMoeConfig(
        thinker_config=thinker.to_dict(), talker_config=talker, code2wav_config=code2wav
    )


# A released Qwen3-Omni checkpoint (thinker + talker + code2wav): its thinker trains.
FAMILIES.register("qwen3_omni_moe")(
    Family(
        name="qwen3_omni_moe",
        model_class="Qwen3OmniMoeForConditionalGeneration",
        modalities=("image", "video", "audio"),
        patch_size=16,
        tokens=QWEN3_OMNI_TOKENS,
        tiny_config=_qwen3_omni_config,
        tiny_processor=_qwen3_omni_processor,
        loader=_thinker_loader("Qwen3OmniMoeThinkerForConditionalGeneration"),
    )
)
