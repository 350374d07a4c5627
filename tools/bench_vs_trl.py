"""omni_rl's GRPO against TRL's GRPOTrainer on one workload, step for step, in one process.

    python tools/bench_vs_trl.py [--steps 8 --warmup 2 --threads 1 --seed 0 --width 128]

The workload, the same for both: one tiny random-init Qwen2.5-VL written once to a
temporary directory and loaded by both (the same weights at the start); 16 generated
224x224 PNG images with two questions each (multiple choice on the shapes' colour,
counting them), scored by omni_rl's reward scorers (TRL calls them from a plain python
reward function, omni_rl through its reward router); 4 prompts x G = 8 completions of
at most 32 new tokens at temperature 1.0 per step; no KL (beta 0, no reference model);
one AdamW update per rollout batch (lr constant, clip 0.2/0.28, token-mean loss, group
std-normalized advantages, gradient norm clipped at 1.0); fp32 on the CPU; the same
torch thread count on both sides. Nothing is downloaded (HF_HUB_OFFLINE=1).

How each side runs: each trainer runs its own training loop, untouched, and the two
take strict turns, one step each (TRL's ``trainer.train()`` in the main thread, the
omni_rl recipe's ``grpo.train(cfg)`` in a second thread, handing a baton over at every
step boundary, so only one of them computes at any moment). A step is timed from the
moment its side gets the baton to the moment it hands it back, so each side's step
includes everything its loop does between two steps (data, logging). The first
``--warmup`` steps of each side are excluded; medians are over the ``--steps`` after.

Phases. omni_rl: its own per-phase timers (``time/rollout`` with prompt encoding,
``time/reward``, ``time/advantage``, ``time/update``) read back from its metrics.jsonl.
TRL: ``_generate`` (prompt tokenization, ``model.generate`` of the B*G sequences,
decoding) is the rollout, ``_calculate_rewards`` the reward, the rest of
``_generate_and_score_completions`` (re-running the processor on the images for the
loss forward, padding, advantages) is "prep", and from its end to ``on_step_end``
(loss forward, backward, clipping, optimizer step) the update. "other" is the step
minus those phases (the loop's data loading and logging).

The second section times omni_rl's shared-prefix gradient forward (``group_forward``:
each prompt and its video computed once per group) against its naive forward
(``full_forward``: every completion with its own copy of the prompt and video, as TRL
does for images; TRL drops video frames from its loss, so it has no video forward to
compare) on a generated clip, forward plus backward, and checks that both give the same
log-probs.

Differences left between the two setups: each side samples with its own random draws
(the same distribution; completion lengths and rewards are printed for both), and TRL
visits the rows in its own shuffled order; omni_rl reads prompt images decoded once
into its media cache and its processor's output for each prompt cached there once (what
``omni-rl preprocess --config`` writes), TRL decodes the PNGs from its
``datasets.Dataset`` at every step and runs its processor over the B*G image copies,
both as each library is meant to be used; the per-step logging differs (omni_rl: JSONL and TensorBoard rows; TRL: its
metric dicts). With a random-init model nearly every reward is 0 and most advantages
are 0 too; both sides still run the full loss forward, backward and optimizer step.

The last line is ``ratio trl/omni = X``, median TRL s/step over median omni_rl s/step;
the measured figures, with their machines and commits, are in docs/results/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

import numpy as np

PROMPTS, GROUP, NEW_TOKENS, IMAGE_SIDE, LR = 4, 8, 32, 224, 1e-5
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 200, 30)}
REWARD_TEMPLATE = "answer_only"


# ---------------------------------------------------------------------------- workload


def write_model(out: Path, seed: int, width: int) -> Path:
    """The tiny Qwen2.5-VL both sides load. Its generation config lists both stop tokens
    (end of turn and end of text), as the released Qwen2.5-VL checkpoints' do: omni_rl's
    sampler always stops on both, TRL stops on what the checkpoint lists."""
    from transformers import AutoTokenizer, GenerationConfig

    from omni_rl.models import build_tiny

    build_tiny("qwen2_5_vl", out, seed=seed, width=width)
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    generation = GenerationConfig.from_pretrained(out, local_files_only=True)
    generation.eos_token_id = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    generation.save_pretrained(out)
    return out


def write_images(out: Path, count: int, seed: int) -> Path:
    """``count`` 224x224 PNGs of 1 to 4 squares of one colour on a grey background, two
    questions each (colour: multiple choice; how many: counting). Returns the JSONL."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    names = list(COLOURS)
    rows = []
    for i in range(count):
        colour, shapes = names[i % len(names)], int(rng.integers(1, 5))
        pixels = np.full((IMAGE_SIDE, IMAGE_SIDE, 3), 128, dtype=np.uint8)
        half = IMAGE_SIDE // 2
        for cell in rng.permutation(4)[:shapes]:  # one square per quadrant: they never overlap
            y, x = (cell // 2) * half + rng.integers(8, half - 40), (cell % 2) * half + rng.integers(8, half - 40)
            pixels[y : y + 32, x : x + 32] = COLOURS[colour]
        Image.fromarray(pixels).save(out / f"image_{i:02d}.png")
        image = [f"image_{i:02d}.png"]
        rows.append(
            {
                "id": f"{i}-colour",
                "problem": "What colour are the squares?",
                "problem_type": "multiple_choice",
                "options": names,
                "answer": "ABCD"[names.index(colour)],
                "images": image,
            }
        )
        rows.append(
            {
                "id": f"{i}-count",
                "problem": "How many squares are there?",
                "problem_type": "counting",
                "answer": str(shapes),
                "images": image,
            }
        )
    path = out / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def prompt_text(row: dict) -> str:
    """The question as omni_rl's default prompt template renders it."""
    from omni_rl.data.dataset import DEFAULT_TEMPLATE, render_prompt
    from omni_rl.preprocess.rows import Row

    fields = {k: row[k] for k in ("id", "problem", "problem_type", "answer")}
    return render_prompt(DEFAULT_TEMPLATE, Row(**fields, fields=row))


# --------------------------------------------------------------------------- the turns


class Stop(Exception):
    """The other side failed: stop this one."""


class Baton:
    """Strict turns between the two trainers' threads: only the holder computes."""

    def __init__(self, holder: str):
        self.holder, self.failed = holder, False
        self.cond = threading.Condition()

    def wait(self, side: str) -> float:
        """Block until ``side`` holds the baton; returns the time it got it."""
        with self.cond:
            self.cond.wait_for(lambda: self.holder == side or self.failed)
            if self.failed:
                raise Stop
        return time.perf_counter()

    def give(self, side: str) -> None:
        with self.cond:
            self.holder = side
            self.cond.notify_all()

    def fail(self) -> None:
        with self.cond:
            self.failed = True
            self.cond.notify_all()


class PacedSteps:
    """Stands in for the omni_rl recipe's progress bar: each step waits for the baton,
    is timed, and hands the baton back. After the last step it waits once more, so the
    recipe's closing work never overlaps a TRL step."""

    def __init__(self, steps: int, baton: Baton, seconds: list[float], threads: list[int]):
        self.steps, self.baton, self.seconds, self.threads = steps, baton, seconds, threads

    def __iter__(self):
        import torch

        for step in range(self.steps):
            start = self.baton.wait("omni")
            self.threads.append(torch.get_num_threads())
            yield step
            self.seconds.append(time.perf_counter() - start)
            self.baton.give("trl")
        self.baton.wait("omni")

    def set_postfix(self, **_) -> None:
        """The recipe's progress display: nothing to show here."""


def omni_side(config, steps: int, baton: Baton, seconds: list[float], threads: list[int], errors: list) -> None:
    """The omni_rl GRPO recipe, unmodified, with its step iterator paced by ``baton``.
    It runs ``steps + 1`` configured steps and stops after ``steps``, so the final
    checkpoint (written after the configured last step) is never part of a timed step."""
    from omni_rl.recipes import grpo

    real = grpo.resume_steps

    def paced(*args, **kwargs):
        log, bar = real(*args, **kwargs)
        bar.close()
        return log, PacedSteps(steps, baton, seconds, threads)

    try:
        baton.wait("omni")
        with mock.patch.object(grpo, "resume_steps", paced):
            grpo.train(config)
    except Stop:
        pass
    except Exception as err:  # noqa: BLE001 - raised again by the main thread, after TRL stops
        errors.append(err)
        baton.fail()


def omni_config(model_dir: Path, data: Path, cache: Path, out: Path, steps: int, threads: int, seed: int):
    from omni_rl.data.config import DataConfig
    from omni_rl.engine.config import AdamWConfig, TrainerConfig
    from omni_rl.models.config import ModelConfig
    from omni_rl.preprocess.config import MediaConfig
    from omni_rl.recipes.grpo_config import AlgorithmConfig, GRPOConfig
    from omni_rl.rewards.config import RewardsConfig
    from omni_rl.rollout.config import RolloutConfig
    from omni_rl.runtime import RunConfig

    return GRPOConfig(
        run=RunConfig(name="bench", output_dir=str(out), seed=seed, device="cpu", threads=threads),
        model=ModelConfig(path=str(model_dir)),
        data=DataConfig(train=str(data), cache=str(cache), prompts_per_step=PROMPTS),
        media=MediaConfig(family="qwen2_5_vl"),
        rollout=RolloutConfig(n=GROUP, max_new_tokens=NEW_TOKENS, temperature=1.0),
        algorithm=AlgorithmConfig(advantage="grpo", eps_low=0.2, eps_high=0.28, kl_coef=0.0, epochs=1),
        rewards=RewardsConfig(template=REWARD_TEMPLATE),
        trainer=TrainerConfig(steps=steps + 1, log_every=1, precision="fp32", strategy="single", max_grad_norm=1.0),
        optimizer=AdamWConfig(lr=LR),
    )


def reward(completions, problem_type, answer, options, **_) -> list[float]:
    """TRL's reward function: omni_rl's scorers, called directly."""
    from omni_rl.rewards import score
    from omni_rl.rewards.config import RewardsConfig

    settings = RewardsConfig(template=REWARD_TEMPLATE).settings()
    return [
        score(kind, completion[0]["content"], gold, options=choices, settings=settings).score
        for completion, kind, gold, choices in zip(completions, problem_type, answer, options, strict=True)
    ]


def trl_trainer(
    model_dir: Path, rows: list[dict], root: Path, out: Path, steps: int, seed: int, baton: Baton, threads: int
):
    """TRL's GRPOTrainer on the same model and rows, its methods wrapped with timers and
    a callback that takes turns with omni_rl. Returns (trainer, timings)."""
    import datasets
    import torch
    from PIL import Image
    from transformers import AutoProcessor, PrinterCallback, Qwen2_5_VLForConditionalGeneration, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    dataset = datasets.Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": prompt_text(row)}],
                "image": Image.open(root / row["images"][0]).convert("RGB"),
                "problem_type": row["problem_type"],
                "answer": row["answer"],
                "options": row.get("options"),
            }
            for row in rows
        ]
    )
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    args = GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,  # TRL's GRPOConfig turns it on by default; omni_rl's is off
        seed=seed,
        max_steps=steps,
        per_device_train_batch_size=PROMPTS * GROUP,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=GROUP,
        max_completion_length=NEW_TOKENS,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        scale_rewards="group",
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        # never sample a media placeholder (TRL bans the image one; omni_rl both)
        generation_kwargs={"suppress_tokens": [model.config.image_token_id, model.config.video_token_id]},
    )
    processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=processor
    )
    trainer.remove_callback(PrinterCallback)
    times: dict[str, list[float]] = {k: [] for k in ("step", "rollout", "reward", "prep", "update", "length", "score")}
    wanted, threads = threads, []
    marks = {"start": 0.0, "scored": 0.0}

    def timed(name: str, method):
        def run(*a, **kw):
            start = time.perf_counter()
            out = method(*a, **kw)
            times[name].append(time.perf_counter() - start)
            if name == "rollout":  # (prompt ids, completion ids, ...)
                times["length"].append(float(np.mean([len(ids) for ids in out[1]])))
            else:  # rewards [B*G, reward functions]
                times["score"].append(float(out.mean()))
            return out

        return run

    generate_and_score = trainer._generate_and_score_completions

    def scored(*a, **kw):
        start = time.perf_counter()
        out = generate_and_score(*a, **kw)
        marks["scored"] = time.perf_counter()
        times["prep"].append(marks["scored"] - start - times["rollout"][-1] - times["reward"][-1])
        return out

    trainer._generate = timed("rollout", trainer._generate)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    trainer._generate_and_score_completions = scored

    class Turns(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            torch.set_num_threads(wanted)  # the trainer's set-up can change this thread's count
            baton.give("omni")
            marks["start"] = baton.wait("trl")

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            times["update"].append(now - marks["scored"])
            times["step"].append(now - marks["start"])
            threads.append(torch.get_num_threads())
            if state.global_step < steps:
                baton.give("omni")
                marks["start"] = baton.wait("trl")

    trainer.add_callback(Turns())
    return trainer, times, threads


def check_same_prompt(model_dir: Path, data: Path, cache: Path, rows: list[dict], root: Path) -> int:
    """Both sides tokenize the first row to the same ids (image tokens included)."""
    from PIL import Image
    from transformers import AutoProcessor
    from trl.data_utils import prepare_multimodal_messages

    from omni_rl.data.dataset import MediaDataset, encode_sample
    from omni_rl.preprocess.config import MediaConfig
    from omni_rl.preprocess.pipeline import Budgets

    processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
    sample = MediaDataset(data, Budgets.from_config(MediaConfig(family="qwen2_5_vl")), cache)[0]
    ours = encode_sample(processor, sample)["input_ids"][0].tolist()
    image = Image.open(root / rows[0]["images"][0]).convert("RGB")
    messages = prepare_multimodal_messages([{"role": "user", "content": prompt_text(rows[0])}], images=[image])
    theirs = processor.apply_chat_template(
        conversation=[messages], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"][0]
    if list(theirs) != ours:
        raise SystemExit(f"the two sides' prompts differ:\n omni_rl {ours}\n TRL     {list(theirs)}")
    return len(ours)


# ------------------------------------------------------------------ video: shared vs naive


def repeat_prompts(inputs: dict, n: int) -> dict:
    """The naive layout: every prompt, its tokens and its video patches copied ``n`` times."""
    import torch

    out = {k: v.repeat_interleave(n, dim=0) for k, v in inputs.items() if k != "pixel_values_videos"}
    patches = torch.split(inputs["pixel_values_videos"], inputs["video_grid_thw"].prod(-1).tolist())
    out["pixel_values_videos"] = torch.cat([p for p in patches for _ in range(n)])
    return out


def video_forward(model_dir: Path, reps: int, seed: int) -> tuple[float, float, float, int]:
    """Median seconds of forward+backward of 2 video prompts x G completions: shared
    prefix, naive; the largest log-prob difference; video tokens per prompt."""
    import torch

    from omni_rl.models import load
    from omni_rl.models.forward import full_forward, group_forward
    from omni_rl.models.inputs import encode_prompts
    from omni_rl.preprocess.synthetic import moving_square
    from omni_rl.preprocess.video import VideoClip

    model, processor = load(model_dir)
    model.train()
    clips, conversations = [], []
    for direction in ("left", "up"):
        frames = moving_square(direction, 2.0, 8, 168, 168).transpose(0, 3, 1, 2).copy()  # [16, 3, 168, 168]
        clips.append(VideoClip(frames, 8.0, len(frames), list(range(len(frames))), (168, 168)))
        text = "Which way does the square move?\nOptions:\nA. left\nB. right\nC. up\nD. down"
        conversations.append([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": text}]}])
    inputs = dict(encode_prompts(processor, conversations, videos=clips))
    expanded = repeat_prompts(inputs, GROUP)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (2 * GROUP, NEW_TOKENS), generator=generator)
    mask = torch.ones_like(ids)
    # the two call sites: each completion's prompt and video once per group, or copied per completion
    forwards = {
        "shared": lambda: group_forward(model, inputs, ids, mask, GROUP).logp,
        "naive": lambda: full_forward(model, expanded, ids, mask).logp,
    }
    seconds: dict[str, list[float]] = {"shared": [], "naive": []}
    logp = {}
    for rep in range(reps + 1):
        for name, forward in forwards.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            out = forward()
            (out * mask).sum().backward()
            if rep:  # the first pass of each is a warm-up
                seconds[name].append(time.perf_counter() - start)
            logp[name] = out.detach()
    diff = float((logp["shared"] - logp["naive"]).abs().max())
    video_tokens = int(inputs["video_grid_thw"][0].prod()) // 4
    return statistics.median(seconds["shared"]), statistics.median(seconds["naive"]), diff, video_tokens


# ------------------------------------------------------------------------------- main


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="measured steps per side")
    parser.add_argument("--warmup", type=int, default=2, help="steps per side excluded from the medians")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, the same for both sides")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--width", type=int, default=128, help="the tiny model's decoder width")
    parser.add_argument("--video-reps", type=int, default=3, help="timed forward+backward passes (0: skip)")
    args = parser.parse_args()
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[name] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch

    from omni_rl.preprocess.config import MediaConfig
    from omni_rl.preprocess.pipeline import Budgets, preprocess
    from omni_rl.recipes.common import write_model_inputs

    torch.set_num_threads(args.threads)
    total = args.warmup + args.steps
    with tempfile.TemporaryDirectory(prefix="bench_vs_trl_") as tmp:
        root = Path(tmp)
        model_dir = write_model(root / "model", args.seed, args.width)
        (root / "data").mkdir()
        data = write_images(root / "data", 16, args.seed)
        rows = [json.loads(line) for line in data.read_text().splitlines()]
        cache = root / "cache"
        preprocess(data, cache, Budgets.from_config(MediaConfig(family="qwen2_5_vl")), workers=1, progress=False)
        prompt_tokens = check_same_prompt(model_dir, data, cache, rows, root / "data")
        baton = Baton("trl")
        omni_seconds: list[float] = []
        omni_threads: list[int] = []
        errors: list = []
        config = omni_config(model_dir, data, cache, root / "omni", total, args.threads, args.seed)
        write_model_inputs(config, data, cache, torch.device("cpu"), progress=False)
        worker = threading.Thread(
            target=omni_side, args=(config, total, baton, omni_seconds, omni_threads, errors), daemon=True
        )
        worker.start()
        trainer, trl, trl_threads = trl_trainer(
            model_dir, rows, root / "data", root / "trl", total, args.seed, baton, args.threads
        )
        try:
            trainer.train()
        except Stop:
            pass
        except BaseException:
            baton.fail()
            raise
        baton.give("omni")  # let the recipe finish
        trl_checkpointing = any(getattr(m, "gradient_checkpointing", False) for m in trainer.model.modules())
        worker.join()
        if errors:
            raise errors[0]
        metrics = [json.loads(line) for line in (root / "omni" / "metrics.jsonl").read_text().splitlines()]
        inputs = metrics[-1]["data/inputs_hits"], metrics[-1]["data/inputs_misses"]
        metrics = metrics[args.warmup : total]
        omni = {
            "step": omni_seconds[args.warmup :],
            **{k: [m[f"time/{k}"] for m in metrics] for k in ("rollout", "reward", "advantage", "update")},
            "length": [m["response/length_mean"] for m in metrics],
            "score": [m["reward/mean"] for m in metrics],
            "reused": [m["update/prefill_reused"] for m in metrics],
            "inference": [m["rollout/inference_mode"] for m in metrics],
        }
        trl = {k: v[args.warmup :] for k, v in trl.items()}
        video = video_forward(model_dir, args.video_reps, args.seed) if args.video_reps else None

    omni_step, trl_step = median(omni["step"]), median(trl["step"])
    print(
        f"workload: tiny Qwen2.5-VL (width {args.width}), {PROMPTS} prompts x G={GROUP}, {NEW_TOKENS} new tokens, "
        f"224x224 images ({prompt_tokens} prompt tokens incl. 64 image tokens), beta 0, one update per batch"
    )
    print(
        f"threads: omni_rl {sorted(set(omni_threads))}, TRL {sorted(set(trl_threads))}; "
        f"{args.warmup} warm-up + {args.steps} measured steps each, alternating; "
        f"TRL activation checkpointing {'on' if trl_checkpointing else 'off'} (omni_rl: off); "
        f"omni_rl prompts' model inputs read from its cache: {inputs[0]}, encoded: {inputs[1]}; "
        f"its update read the rollout's prefill in {int(sum(omni['reused']))} of {len(omni['reused'])} measured "
        f"steps, its rollout ran in inference mode in {int(sum(omni['inference']))}"
    )
    print(
        f"median over steps of the mean completion length: omni_rl {median(omni['length']):.1f}, "
        f"TRL {median(trl['length']):.1f} tokens; of the mean reward: omni_rl {median(omni['score']):.3f}, "
        f"TRL {median(trl['score']):.3f}"
    )
    print("medians, s/step:")
    other = omni_step - sum(median(omni[k]) for k in ("rollout", "reward", "advantage", "update"))
    print(
        f"  omni_rl {omni_step:.3f}  rollout {median(omni['rollout']):.3f}  reward {median(omni['reward']):.4f}  "
        f"advantage {median(omni['advantage']):.4f}  update {median(omni['update']):.3f}  other {other:.3f}"
    )
    other = trl_step - sum(median(trl[k]) for k in ("rollout", "reward", "prep", "update"))
    print(
        f"  TRL     {trl_step:.3f}  rollout {median(trl['rollout']):.3f}  reward {median(trl['reward']):.4f}  "
        f"prep {median(trl['prep']):.4f}  update {median(trl['update']):.3f}  other {other:.3f}"
    )
    print(f"  per-step seconds, omni_rl: {' '.join(f'{s:.3f}' for s in omni['step'])}")
    print(f"  per-step seconds, TRL:     {' '.join(f'{s:.3f}' for s in trl['step'])}")
    if video is not None:
        shared, naive, diff, tokens = video
        print(
            f"video (2 prompts x G={GROUP}, 16 frames 168x168 = {tokens} video tokens each, {NEW_TOKENS} completion "
            f"tokens): shared {shared:.3f} s, naive {naive:.3f} s, max |logp difference| {diff:.1e}"
        )
        print(f"video shared vs naive forward+backward: naive/shared = {naive / shared:.2f}")
    print(f"ratio trl/omni = {trl_step / omni_step:.2f}")


if __name__ == "__main__":
    main()
