"""Decode speed of the hf rollout engine against transformers' ``generate``, by prompt length.

Both sample G completions for each of B text prompts of P tokens on the same random
tiny Qwen2.5-VL (``build_tiny`` at ``--width``): omni_rl's ``HFRolloutEngine`` (each
prompt prefilled once, its keys read in place by every decoding step) and
``model.generate(num_return_sequences=G)`` (the prompt copied G times, its keys in a
dynamic cache). A decoding step's time is the difference between a run of
``--new-tokens`` tokens and a run of one token, over the steps between them (so the
prefill cancels out); the median of ``--repeats`` runs. Last line:
``decode ms/token omni/transformers = a/b at P=...`` for the longest prompt.

    python tools/bench_decode.py [--lengths 1024,4096,16384] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from functools import partial

import torch

from omni_rl.models import build_tiny, load
from omni_rl.rollout.hf import HFRolloutEngine, SamplingParams


def prompts(processor, batch: int, length: int, seed: int) -> dict:
    """B prompts of ``length`` ordinary text tokens (no special or media tokens)."""
    tokenizer = processor.tokenizer
    ordinary = torch.tensor([i for i in range(min(tokenizer.vocab_size, 256)) if i not in tokenizer.all_special_ids])
    g = torch.Generator().manual_seed(seed)
    ids = ordinary[torch.randint(0, len(ordinary), (batch, length), generator=g)]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def omni_seconds(engine: HFRolloutEngine, inputs: dict, group: int, tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    seeds = list(range(len(inputs["input_ids"])))
    out = engine.generate(inputs, group, SamplingParams(max_new_tokens=tokens), seeds=seeds)
    return time.perf_counter() - start, out.completion_ids.shape[1]


def transformers_seconds(model, inputs: dict, group: int, tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            **inputs,
            do_sample=True,
            num_return_sequences=group,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
        )
    return time.perf_counter() - start, out.shape[1] - inputs["input_ids"].shape[1]


def per_token_ms(run, repeats: int, tokens: int) -> float:
    """Median over ``repeats`` of (time of ``tokens`` steps - time of 1 step) / steps."""
    run(2)  # warm-up: first calls allocate and pick kernels
    samples = []
    for _ in range(repeats):
        short, _ = run(1)
        long, steps = run(tokens)
        samples.append(1000 * (long - short) / max(1, steps - 1))
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=17)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as root:
        model, processor = load(build_tiny("qwen2_5_vl", f"{root}/model", width=args.width))
    model.eval()
    engine = HFRolloutEngine(model, processor)
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        inputs = prompts(processor, args.batch, length, seed=length)
        omni = per_token_ms(partial(omni_seconds, engine, inputs, args.group), args.repeats, args.new_tokens)
        peer = per_token_ms(partial(transformers_seconds, model, inputs, args.group), args.repeats, args.new_tokens)
        rows.append((length, omni, peer))
        print(f"P={length:>6}  omni {omni:7.1f} ms/token  transformers {peer:7.1f} ms/token  ratio {omni / peer:.2f}")
    length, omni, peer = rows[-1]
    print(f"decode ms/token omni/transformers = {omni:.1f}/{peer:.1f} at P={length}")


if __name__ == "__main__":
    main()
