"""How much a video quickstart model's answer reads its clip, before it is sampled.

For each held-out question with options of a quickstart run, the prompt and the
completion's opening ``<answer>`` are forwarded once (teacher-forced), and the next
token's log-probabilities of the option letters are read. Per kind it prints, for each
model of the run named:

- the spread over the clips (the standard deviation) of the log-odds of option A over
  option B: how much the clip moves the answer; a model that answers the same way
  whatever the clip shows has 0;
- their mean: the model's lean to one letter, whatever the clip;
- P(correct): the probability of the right letter among the options, averaged over
  the clips (0.5 for two options at chance), and how often the most probable letter
  is the right one;
- the letters' share of the next token's probability (how much of it is an answer at all).

The models default to the run's random start (``sft/tiny_model``), its SFT model
(``sft/model``) and its GRPO model (``grpo/model``); the questions to the run's
held-out set, or ``--data`` (a rows file of the run whose clips are in its cache, such
as the cold start's ``data/train/sft.jsonl``), of the data sources ``--source`` names.

    python tools/answer_spread.py runs/quickstart [sft/tiny_model sft/model grpo/model]
    python tools/answer_spread.py runs/quickstart sft/model --data runs/quickstart/data/train/sft.jsonl \
        --source video_color
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import yaml

from omni_rl.data.dataset import MediaDataset, encode_sample
from omni_rl.models import load
from omni_rl.models.forward import reset_rope_deltas
from omni_rl.models.inputs import append_completion
from omni_rl.preprocess.config import MediaConfig
from omni_rl.preprocess.pipeline import Budgets

LETTERS = "ABCDEFGH"
OPENING = "<answer>"


def letter_logprobs(model, processor, sample) -> torch.Tensor:
    """log p(letter) of each of ``sample``'s option letters as the token after its
    prompt and ``OPENING``."""
    tokenizer = processor.tokenizer
    opening = torch.tensor([tokenizer(OPENING, add_special_tokens=False)["input_ids"]])
    batch, _ = append_completion(encode_sample(processor, sample), opening, torch.ones_like(opening))
    letters = [tokenizer(LETTERS[i], add_special_tokens=False)["input_ids"][0] for i in range(len(sample.options))]
    reset_rope_deltas(model)
    with torch.no_grad():
        logits = model(**batch, use_cache=False).logits[0, -1].float()
    return torch.log_softmax(logits, -1)[letters]


def spread_rows(model, processor, data: MediaDataset, sources: set[str] | None = None) -> dict[str, list[tuple]]:
    """Per data source (those in ``sources``, or all): (log-odds A over B, P(correct)
    among the options, whether the most probable option is right, the options'
    probability mass) of each question with options."""
    found: dict[str, list[tuple]] = {}
    for i in range(len(data)):
        sample = data[i]
        if not sample.options or len(sample.options) < 2 or (sources and sample.data_source not in sources):
            continue
        logprobs = letter_logprobs(model, processor, sample)
        among = torch.log_softmax(logprobs, -1)
        right = LETTERS.index(str(sample.answer))
        row = (
            float(among[0] - among[1]),
            float(among[right].exp()),
            float(int(among.argmax()) == right),
            float(logprobs.exp().sum()),
        )
        found.setdefault(sample.data_source or "", []).append(row)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a video quickstart's output directory")
    parser.add_argument("models", nargs="*", default=["sft/tiny_model", "sft/model", "grpo/model"])
    parser.add_argument("--data", type=Path, help="a rows file of the run (default: its held-out set)")
    parser.add_argument("--source", action="append", help="only this data source (repeatable)")
    args = parser.parse_args()
    config = yaml.safe_load((args.run / "config.yaml").read_text())
    budgets = Budgets.from_config(MediaConfig(**config["media"]))
    data = MediaDataset(
        args.data or args.run / "data" / "heldout" / "data.jsonl",
        budgets,
        cache=args.run / "cache",
        prompt_template=config["data"]["prompt_template"],
    )
    print(
        "| model | kind | questions | log-odds A:B spread | mean | P(correct) | most probable right | letters' mass |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models:
        model, processor = load(args.run / name)
        model.eval()
        for source, rows in sorted(spread_rows(model, processor, data, set(args.source or [])).items()):
            odds, right, argmax, mass = zip(*rows, strict=True)
            print(
                f"| {name} | {source} | {len(rows)} | {statistics.stdev(odds):.3f} | {statistics.fmean(odds):+.3f} "
                f"| {statistics.fmean(right):.3f} | {statistics.fmean(argmax):.3f} | {statistics.fmean(mass):.2f} |"
            )


if __name__ == "__main__":
    main()
