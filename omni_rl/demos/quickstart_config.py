"""The quickstart's config (``omni-rl quickstart``): the synthetic set and tiny model it
generates, and the SFT and GRPO recipes' own configs, which it fills with what it
generates and runs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from omni_rl.config import require
from omni_rl.data.config import DataConfig
from omni_rl.engine.config import AdamWConfig, TrainerConfig
from omni_rl.preprocess.config import MediaConfig
from omni_rl.preprocess.motion import KINDS, QUESTIONS
from omni_rl.recipes.grpo_config import AlgorithmConfig, GRPOConfig
from omni_rl.recipes.sft_config import SFTConfig
from omni_rl.rewards.config import RewardsConfig
from omni_rl.rollout.config import RolloutConfig
from omni_rl.runtime import RunConfig

DEFAULT_KINDS = (*KINDS, "quarter", "counting", "grounding")
"""The quickstart's kinds: the four two-option ones, a four-option one and the two
routed to rewards of their own (a number, a span scored by IoU)."""

# what the quickstart fills in its sft and grpo sections (from its run, media, model
# and data sections, and the files it generates), each with what sets it; setting them
# there is an error
FILLED = {
    "run": "set the quickstart's run section instead",
    "media": "set the quickstart's media section instead",
    "model.path": "the tiny model it builds, then the SFT checkpoint",
    "model.tiny_family": "set media.family instead",
    "model.tiny_width": "set model.width instead",
    "data.train": "the rows it generates (data.train_clips sets how many)",
    "data.cache": "its cache under run.output_dir",
    "data.prompt_template": "set the quickstart's data.prompt_template instead",
    "data.eval": "the held-out rows it generates (data.heldout_clips sets how many)",
}


@dataclass
class QuickstartData:
    """The synthetic video-QA set of the quickstart: one clip per question, kinds whose
    answers are in the frames (``omni_rl.preprocess.motion``)."""

    kinds: list[str] = field(default_factory=lambda: list(DEFAULT_KINDS))
    """The kinds of question, cycled (default ``DEFAULT_KINDS``): the four two-option
    kinds; ``quarter``, in which quarter of the clip the square shows (four options);
    ``counting`` (a number, 0 to 4, the ``counting`` reward) and ``grounding`` (a
    [start, end] span, the ``temporal_grounding`` reward, which needs
    ``grpo.rollout.max_new_tokens: 32`` to end its answer). Also: the two-option
    ``wrap_direction``, ``adjacent_order`` and ``equal_count``, which one frame does not
    answer, and ``heading`` (four options). The summary gives each kind's chance: a
    uniform guess, or for grounding the best constant span's IoU."""
    train_clips: int = 1400
    """Training clips (one question each)."""
    heldout_clips: int = 350
    """Held-out clips, never trained on (50 per kind of the seven)."""
    sft_fraction: float = 1.0
    """Part of the training set used for the SFT cold start (in whole cycles of the
    kinds). On a quarter of the clips, 400 steps pass seven times over each row and the
    cold start ties the shuffled answers to the clips: the SFT model starts off chance
    (docs/results/quickstarts.md)."""
    sft_shuffled_answers: bool = True
    """The cold start learns the answers shuffled among the rows of each kind: it
    teaches the answer format and leaves the questions at chance, for GRPO to learn from
    the frames (off: the true answers, which SFT itself learns)."""
    sft_color_questions: bool = True
    """The cold start also asks, of each of its clips that shows one square (but the
    ``grounding`` clips), the square's colour (four options, the true answer; ``omni_rl.preprocess.motion.color_rows``),
    which no kind's answer depends on. The held-out questions are the kinds' alone.
    It makes the cold start look at the clips: without it the SFT model's answer barely
    moves with the clip, and GRPO on the seven kinds learned nothing in 1,000 steps at
    seed 0 (docs/results/quickstarts.md)."""
    blank_frames: bool = False
    """Control run: the same questions over empty frames (accuracy should stay at chance)."""
    shuffle_frames: bool = False
    """Control run: each clip's frames in a random order (direction, order and when
    need the order and should fall to chance; a count can still be read from how many
    frames show the square)."""
    prompt_template: str = "{problem}{options}"
    """How rows become questions."""
    decoy_every: int = 0
    """Every k-th question of the training and held-out sets a decoy, labelled
    ``"decoy": true``: its wording states the answer, so the text alone answers it (the
    known truth to check ``omni-rl curate text-only`` against; 0: none). Prime to the
    number of kinds (odd for the four), so that the decoys fall on every kind, which
    cycle (k = 4 would make every "when" question a decoy and no other). The cold start
    keeps decoys' true answers where it shuffles the others': the wording states them."""
    sft_text_only: float = 0.0
    """Share of the cold start's rows shown without their clip, the question alone, so
    the SFT model answers text-only prompts in form, as ``omni-rl curate text-only``
    asks them (0: every row with its clip)."""
    curate: str = "none"
    """``text-only``: before GRPO, ``omni-rl curate text-only`` asks each GRPO training
    question without its clip of the cold start's model (or ``curate_model``): 8
    answers at ``grpo.rollout.temperature``, and a row right in 7 or 8 of them leaves.
    GRPO trains on the rows it keeps (``data/kept.jsonl``; the report, the drops and,
    where there are decoys, recall and precision against their labels beside it, and in
    the summary). ``labels``: the rows the generator labels decoys leave, and no others
    (what a curator that finds every decoy and nothing else would keep: the value of
    the curation itself). ``none``: GRPO trains on every row."""
    curate_model: str | None = None
    """With ``curate: text-only``, the checkpoint directory of the model it asks
    (default: the cold start's)."""
    unreachable_rows: int = 0
    """GRPO training rows of a fifth source, ``unreachable``: a training clip asked for a
    six-digit number no completion gives (numerical, scored on accuracy alone:
    ``grpo.rewards.weights`` gets ``numerical: [1, 0]``), so every group of theirs scores
    0 and teaches nothing. Neither the cold start nor the held-out set has them. The
    case for ``grpo.data.sampler.type: ucb`` (0: none)."""

    def __post_init__(self):
        require(self.train_clips >= 8 and self.heldout_clips >= 4, "train_clips", "need >= 8 train, >= 4 held out")
        require(0 < self.sft_fraction <= 1, "sft_fraction", "must be in (0, 1]")
        unknown = [k for k in self.kinds if k not in QUESTIONS]
        require(not unknown, "kinds", f"{unknown}: no such kind; the kinds are {list(QUESTIONS)}")
        require(len(self.kinds) == len(set(self.kinds)) > 0, "kinds", "must name each kind once, at least one")
        count, answers = len(self.kinds), sorted({len(QUESTIONS[kind][1]) for kind in self.kinds})
        require(
            self.decoy_every == 0
            or (self.decoy_every > 0 and all(math.gcd(self.decoy_every, n) == 1 for n in (count, *answers))),
            "decoy_every",
            f"must be 0 (no decoys) or prime to the {count} kinds and to each kind's number of answers "
            f"({', '.join(map(str, answers))}): both cycle, so else decoys fall on some kinds or answers only and "
            "the other rows' answers are unbalanced (the text alone would answer them)",
        )
        require(0 <= self.sft_text_only <= 1, "sft_text_only", "must be in [0, 1]")
        require(self.unreachable_rows >= 0, "unreachable_rows", "must be >= 0")
        require(self.curate in ("none", "text-only", "labels"), "curate", "must be none, text-only or labels")
        require(self.curate_model is None or self.curate == "text-only", "curate_model", "needs curate: text-only")
        require(self.curate != "labels" or self.decoy_every > 0, "curate", "labels needs decoys (decoy_every)")


@dataclass
class QuickstartModel:
    """The tiny model the quickstart builds (its family is ``media.family``)."""

    width: int = 128
    """Decoder width (128: about 0.6 M params; 64 barely sees the video)."""

    def __post_init__(self):
        require(self.width >= 32 and self.width % 32 == 0, "width", "must be a multiple of 32")


def quickstart_sft() -> SFTConfig:
    """The SFT cold start: 400 steps of 8 prompts at lr 5e-4, which teach the answer
    format of each kind and the colour questions (at 2e-3 the tiny model stops seeing:
    800 steps on the true answers stay at chance, where 800 steps at 5e-4 reach 0.78 to
    1.00 on every kind of the four)."""
    return SFTConfig(
        data=DataConfig(prompts_per_step=8),
        trainer=TrainerConfig(steps=400),
        optimizer=AdamWConfig(lr=5e-4),
    )


def quickstart_grpo() -> GRPOConfig:
    """The GRPO phase: 800 steps of 8 prompts x 8 completions at lr 2e-4 with a KL
    penalty of 0.05 to the SFT model (without it, three runs collapsed to malformed
    answers between steps 210 and 550, at lr 1e-4 to 5e-4); 32 new tokens (a letter's
    answer is about 18, one token per byte, a span's about 28); answers without a
    <think> part, accuracy rewarded
    only in responses that end with the answer; the held-out set scored every 100 steps
    (the curves of ``plots/grpo/eval_heldout_*``)."""
    return GRPOConfig(
        data=DataConfig(prompts_per_step=8),
        rollout=RolloutConfig(n=8, max_new_tokens=32, temperature=1.0),
        algorithm=AlgorithmConfig(advantage="grpo", dynamic_sampling=False, kl_coef=0.05),
        rewards=RewardsConfig(template="answer_only", require_template=True),
        trainer=TrainerConfig(steps=800, eval_every=100),
        optimizer=AdamWConfig(lr=2e-4),
    )


# the quickstart's one evaluation set is its held-out set
REFUSED_KEYS = {
    f"{phase}.trainer.best_metric": "the only evaluation set is the held-out set the quickstart reports, "
    "and a model chosen on it would inflate that figure"
    for phase in ("sft", "grpo")
}


def _dotted_get(obj, dotted: str):
    for name in dotted.split("."):
        obj = getattr(obj, name)
    return obj


def require_unfilled(cfg, defaults: dict, filled: dict[str, str]) -> None:
    """Validation helper: the fields of the recipe sections (``defaults``: section name
    -> its default config) that a quickstart fills (``filled``: key -> what fills it, or
    what to set instead) are left at default."""
    for name, default in defaults.items():
        for key, instead in filled.items():
            require(
                _dotted_get(getattr(cfg, name), key) == _dotted_get(default, key),
                f"{name}.{key}",
                f"the quickstart fills this: {instead}",
            )


@dataclass
class QuickstartConfig:
    """``omni-rl quickstart``: synthetic data, cache, tiny model, SFT, eval, GRPO, eval."""

    run: RunConfig = field(
        default_factory=lambda: RunConfig(
            name="quickstart", output_dir="runs/quickstart", threads=2, cpu_kernels="avx2"
        )
    )
    """Output directory, seed and hardware (of both phases)."""
    media: MediaConfig = field(
        default_factory=lambda: MediaConfig(
            fps=None, nframes=16, min_frames=2, max_frames=16, video_min_pixels=3136, video_max_pixels=3136
        )
    )
    """Frame sampling and budgets (of both phases): all 16 frames of each clip, at the
    clips' own 56 x 56 pixels."""
    data: QuickstartData = field(default_factory=QuickstartData)
    """The synthetic set."""
    model: QuickstartModel = field(default_factory=QuickstartModel)
    """The tiny model."""
    sft: SFTConfig = field(default_factory=quickstart_sft)
    """The cold start: an SFT recipe config whose run, media, model path and tiny
    settings, data.train, data.cache and data.prompt_template the quickstart fills."""
    grpo: GRPOConfig = field(default_factory=quickstart_grpo)
    """The RL phase: a GRPO recipe config, filled like ``sft`` (model.path: the SFT
    checkpoint)."""
    REFUSED_KEYS: ClassVar[dict[str, str]] = REFUSED_KEYS

    def __post_init__(self):
        require_unfilled(self, {"sft": quickstart_sft(), "grpo": quickstart_grpo()}, FILLED)
