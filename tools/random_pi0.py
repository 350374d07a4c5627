"""Write a random-init pi_0 or pi_0.5 checkpoint of a released model's shapes (offline),
with the tiny models' byte-level processor sized for it: what ``tools/gpu_check.sh``
trains where no released checkpoint is at hand.

    python tools/random_pi0.py --out runs/pi0_random [--family pi0|pi05]
        [--config tools/model_configs/pi0_base.json] [--chunk 8] [--device cuda]

The weights are transformers' initialisation of ``PI0ForConditionalGeneration`` or
``PI05ForConditionalGeneration`` (seeded), saved in float32 with the processor (the
backbone's ``sized_processor``: 224x224 images, 256 image tokens for pi0_base and
pi05_base), so that ``omni-rl train`` loads it by path like a released one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    import transformers

    from omni_rl.models.flow_policy import backbone_class

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--family", choices=["pi0", "pi05"], default="pi0")
    parser.add_argument("--config", type=Path, help="default: tools/model_configs/<family>_base.json")
    parser.add_argument("--chunk", type=int, default=8, help="the chunk_size it is saved with")
    parser.add_argument("--device", default="cpu", help="where the weights are initialised (cuda: faster)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    backbone = backbone_class(args.family, "--family")
    path = args.config or ROOT / "tools" / "model_configs" / f"{args.family}_base.json"
    raw = json.loads(path.read_text())
    raw.pop("_source", None)
    config = getattr(transformers, backbone.CONFIG_CLASS)(**{**raw, "chunk_size": args.chunk})
    processor = backbone.sized_processor(config, args.chunk)
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = getattr(transformers, backbone.MODEL_CLASS)(config)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    processor.save_pretrained(args.out)
    count = sum(p.numel() for p in model.parameters())
    print(f"wrote a random {args.family} of {count / 1e9:.2f} B parameters to {args.out}")


if __name__ == "__main__":
    main()
