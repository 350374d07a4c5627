"""The audio quickstart: a tiny Qwen2-Audio learns synthetic audio QA on a CPU, SFT then GRPO.

It generates clips of tones with four kinds of question (which tone is higher, how
many beeps, which comes first, louder or softer) and a held-out split, caches the
audio, builds a tiny Qwen2-Audio with a short audio window, runs a short SFT cold
start on part of the training set, evaluates on the held-out split, runs GRPO from
the SFT checkpoint, evaluates again, and writes ``summary.json`` and curve PNGs, as
the video quickstart does.
"""

from __future__ import annotations

from omni_rl.demos.quickstart import begin, run_phases, split_rows, write_summary
from omni_rl.demos.quickstart_audio_config import AudioQuickstartConfig
from omni_rl.preprocess.sounds import write_audio_qa


def main(cfg: AudioQuickstartConfig) -> dict:
    """Run the audio quickstart; returns (and writes) its summary."""
    started, out, runtime = begin(cfg)
    d = cfg.data
    # DATA: tone clips with known answers; the held-out split is drawn with another seed
    train = write_audio_qa(out / "data" / "train", d.train_clips, cfg.run.seed, silent=d.silent)
    heldout = write_audio_qa(out / "data" / "heldout", d.heldout_clips, cfg.run.seed + 10_000, silent=d.silent)
    sft_rows = split_rows(train, d.sft_fraction, train.parent / "sft.jsonl")
    after_sft, after_rl, without = run_phases(cfg, train, sft_rows, heldout, tiny_audio_seconds=cfg.model.audio_seconds)
    return write_summary(
        out,
        heldout,
        after_sft,
        after_rl,
        started,
        without=without,
        settings=cfg.grpo.rewards.settings(),
        silent=d.silent,
        runtime=runtime,
    )
