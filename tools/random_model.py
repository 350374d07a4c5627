"""Write a random-init Qwen2.5-VL checkpoint with a released model's shapes (offline).

GPU checks and memory benchmarks need a model of real size, and nothing is downloaded:
this builds the configuration of Qwen2.5-VL-3B or -7B (real vocabulary, widths, depths,
heads) with random weights, the project's offline byte-level tokenizer and the family's
processor. ``--layers`` and ``--vision-depth`` shrink it for quick runs; every other
dimension stays real.

    python tools/random_model.py --shape 3b --out runs/random_3b [--layers 4] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers

from omni_rl.models import FAMILIES
from omni_rl.models.tokenizer import build_tokenizer

# Qwen2.5-VL's published configurations (text decoder, vision tower)
SHAPES = {
    "3b": {
        "text": {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36},
        "heads": (16, 2),
        "vision_out": 2048,
    },
    "7b": {
        "text": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28},
        "heads": (28, 4),
        "vision_out": 3584,
    },
}
VOCAB = 151_936


def config(
    shape: str, layers: int | None, vision_depth: int | None, tokenizer, full_attention: list[int] | None = None
) -> transformers.Qwen2_5_VLConfig:
    spec = SHAPES[shape]
    heads, kv_heads = spec["heads"]
    text = {
        **spec["text"],
        "vocab_size": VOCAB,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 128_000,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [16, 24, 24]},
        "tie_word_embeddings": shape == "3b",
        "bos_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if layers is not None:
        text["num_hidden_layers"] = layers
    depth = vision_depth if vision_depth is not None else 32
    vision = {
        "depth": depth,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "out_hidden_size": spec["vision_out"],
        "fullatt_block_indexes": (
            full_attention if full_attention is not None else [i for i in (7, 15, 23, 31) if i < depth] or [depth - 1]
        ),
    }
    ids = {
        key: tokenizer.convert_tokens_to_ids(token)
        for key, token in (
            ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"),
        )
    }
    return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="3b")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--layers", type=int, help="decoder layers (default: the real count)")
    parser.add_argument("--vision-depth", type=int, help="vision blocks (default: 32)")
    parser.add_argument(
        "--full-attention-blocks",
        help="vision blocks with full attention, comma-separated, or 'none' (default: the real 7,15,23,31 below "
        "the depth, else the last block); the others attend within 112-pixel windows",
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    family = FAMILIES.get("qwen2_5_vl")
    tokenizer = build_tokenizer(family.tokens)
    torch.manual_seed(args.seed)
    full = args.full_attention_blocks
    full = None if full is None else [] if full == "none" else [int(i) for i in full.split(",")]
    model = family.model_cls()(config(args.shape, args.layers, args.vision_depth, tokenizer, full))
    model.to(getattr(torch, args.dtype))
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    family.tiny_processor(tokenizer).save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote a random {args.shape}-shaped qwen2_5_vl ({params / 1e9:.2f} B parameters) to {args.out}")


if __name__ == "__main__":
    main()
