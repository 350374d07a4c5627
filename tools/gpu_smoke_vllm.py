"""The vLLM rollout engine's checks that need a GPU and vllm, one command, PASS or FAIL each.

    pip install -e ".[vllm]"            # on the GPU machine (vllm==0.33.0)
    .venv/bin/python tools/gpu_smoke_vllm.py [--work runs/gpu_smoke_vllm]

It builds a random-init model of Qwen2.5-VL-3B's widths (4 decoder layers, 4 vision
blocks; real vocabulary and heads) and a few synthetic videos, then checks, against the
trainer (bf16-mixed, fp32 master weights):
  apply_model         weight loading runs in this process (no pickling)
  prompt_parity       vLLM's prompt token ids equal the trainer's, video tokens included
  weight_sync         every vLLM parameter is loaded; q/k/v and gate/up slices, the patch
                      embedding and lm_head equal the policy's bf16 weights exactly
  logprob_parity      rollout log-probs against the trainer's at T=1 (like with like),
                      before and after 3 optimizer steps (through sleep and wake)
  encoder_cache       changing only the vision weights changes a greedy answer on a video
                      the engine has already encoded
  distinct_groups     two identical prompts in one call give different groups
  lora                adapter-only sync: log-prob parity before and after 3 steps
  grpo_steps          two GRPO steps through `omni-rl train` with rollout.engine vllm, an
                      over-long prompt skipped and counted
  curate              `omni-rl curate text-only` with rollout.engine vllm: every row asked
                      once, 4 answers each
  memory              GPU memory used after init, rollout, sleep, update and wake
Exit status 1 if any check fails. CI never runs it (it needs CUDA and vllm).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS: list[tuple[str, bool, str]] = []


def report(name: str, ok: bool, detail: str) -> None:
    RESULTS.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def run_check(name: str, fn, *args) -> None:
    """Run one check; an exception is that check's FAIL (with its traceback) and the
    remaining checks still run. The exit status reports every failure."""
    try:
        ok, detail = fn(*args)
    except Exception as err:  # noqa: BLE001 -- reported as this check's FAIL, never hidden
        traceback.print_exc()
        ok, detail = False, f"{type(err).__name__}: {err}"
    report(name, ok, detail)


def used_gib() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


# ------------------------------------------------------------------- functions run
# inside vLLM's worker by apply_model (module level: nothing to pickle or close over)


def _pid(_model) -> int:
    return os.getpid()


class _Tensors:
    def __init__(self, names: list[str]):
        self.names = names

    def __call__(self, model) -> dict:
        params = dict(model.named_parameters())
        missing = [n for n in self.names if n not in params]
        if missing:
            near = sorted(n for n in params if "layers.0." in n or "patch_embed" in n or "lm_head" in n)
            raise KeyError(f"vLLM has no {missing}; it has {near}")
        return {n: params[n].detach().float().cpu() for n in self.names}


# ------------------------------------------------------------------------- setup


def build_inputs(work: Path):
    """The random model, a GRPO config on the vllm engine, and a few video samples."""
    from omni_rl.data.dataset import Sample, encode_sample
    from omni_rl.preprocess.synthetic import moving_square, write_video
    from omni_rl.preprocess.video import VideoBudget, read_video
    from omni_rl.recipe_loader import load_config

    model_dir = work / "model"
    if not (model_dir / "config.json").is_file():
        subprocess.run(
            [
                *(sys.executable, str(ROOT / "tools/random_model.py"), "--shape", "3b", "--layers", "4"),
                *("--vision-depth", "4", "--dtype", "float32", "--out", str(model_dir)),
            ],
            check=True,
        )
    overrides = [
        "data.train=unused",
        "rollout.engine=vllm",
        "rollout.n=4",
        "rollout.max_new_tokens=32",
        "rollout.max_prompt_length=4096",
        "rollout.vllm.max_model_len=4128",
        "rollout.vllm.gpu_memory_utilization=0.25",
    ]
    cfg = load_config(None, overrides, recipe="grpo")
    samples = []
    for i, direction in enumerate(["up", "left", "down"]):
        path = work / f"clip{i}.mp4"
        write_video(path, moving_square(direction, 2.0, 10, 160, 120), 10)
        clip = read_video(path, VideoBudget(patch_size=14, min_pixels=16 * 784, max_pixels=64 * 784, max_frames=8))
        content = [{"type": "video"}, {"type": "text", "text": "Which way does the square move? Answer in a word."}]
        samples.append(
            Sample(f"clip{i}", "free_form", direction, [{"role": "user", "content": content}], videos=[clip])
        )
    return model_dir, cfg, samples, encode_sample


def trainer(model_dir: Path, lora: bool):
    from omni_rl.engine.config import AdamWConfig
    from omni_rl.engine.engine import TrainingEngine, load_dtype
    from omni_rl.models import load

    model, processor = load(model_dir, device="cuda", dtype=load_dtype("bf16-mixed"))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]))
    engine = TrainingEngine(model, AdamWConfig(lr=1e-4), torch.device("cuda"), total_steps=10, precision="bf16-mixed")
    return engine, processor


# ------------------------------------------------------------------------ checks


def check_apply_model(rollout):
    pids = rollout.llm.apply_model(_pid)
    return pids == [os.getpid()], f"apply_model ran in pid {pids}, this process is {os.getpid()}"


def check_prompt_parity(rollout, processor, samples, encoded):
    import vllm

    from omni_rl.rollout.vllm import check_prompts, request

    video = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    outputs = rollout.llm.generate(
        [request(processor, s) for s in samples], vllm.SamplingParams(max_tokens=1), use_tqdm=False
    )
    check_prompts(outputs, samples, encoded)  # raises, naming the row, on any difference
    counts = [
        (list(o.prompt_token_ids).count(video), int((e["input_ids"] == video).sum()))
        for o, e in zip(outputs, encoded, strict=True)
    ]
    return all(a == b for a, b in counts), f"video tokens (vLLM, trainer) per prompt: {counts}; token ids equal"


def check_weight_sync(rollout, engine):
    rollout.load_weights(engine.module)  # raises if any vLLM parameter is left unloaded
    hf = {k: v.detach() for k, v in engine.module.state_dict().items()}
    layer = "model.language_model.layers.0."
    pairs = {
        "language_model.model.layers.0.self_attn.qkv_proj.weight": torch.cat(
            [hf[layer + f"self_attn.{p}_proj.weight"] for p in "qkv"]
        ),
        "language_model.model.layers.0.mlp.gate_up_proj.weight": torch.cat(
            [hf[layer + "mlp.gate_proj.weight"], hf[layer + "mlp.up_proj.weight"]]
        ),
        "visual.patch_embed.proj.weight": hf["model.visual.patch_embed.proj.weight"],
    }
    if engine.module.config.get_text_config().tie_word_embeddings:  # vLLM's head is the embedding
        pairs["language_model.model.embed_tokens.weight"] = hf["lm_head.weight"]
    else:
        pairs["language_model.lm_head.weight"] = hf["lm_head.weight"]
    (served,) = rollout.llm.apply_model(_Tensors(list(pairs)))
    bad = [
        n
        for n, w in pairs.items()
        if not torch.equal(served[n].flatten(), w.to(torch.bfloat16).float().cpu().flatten())
    ]
    return not bad, f"all of vLLM's parameters loaded; exact: {sorted(set(pairs) - set(bad))}; differ: {bad}"


def logprob_gap(rollout, engine, processor, samples, encoded, cfg) -> dict:
    """Sample G=4 per prompt at T=1 and compare with the trainer like with like."""
    from omni_rl.algorithms.correction import log_ratio, mismatch_sums
    from omni_rl.models.forward import SamplingFilter, group_forward
    from omni_rl.models.inputs import collate_prompts
    from omni_rl.recipes.grpo import prompt_seed
    from omni_rl.rollout.hf import SamplingParams

    seeds = [prompt_seed(0, 100 + i, 4) for i in range(len(samples))]
    got = rollout.rollout(samples, encoded, 4, SamplingParams(1.0, 1.0, 0, 32), seeds)
    inputs = collate_prompts(encoded, processor.tokenizer.pad_token_id)
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    ids, mask = got.completion_ids.cuda(), got.completion_mask.cuda()
    with torch.no_grad():
        out = group_forward(engine.model, inputs, ids, mask, 4, 1.0, kept=SamplingFilter(tuple(rollout.banned)))
    r = log_ratio(out.logp - out.log_kept, got.logprobs.cuda(), mask)
    sums = mismatch_sums(r, mask, 2.0)
    return {"abs": sums.abs_diff / sums.tokens, "k3": sums.k3 / sums.tokens, "max": float(r.abs().max())}


def optimizer_steps(engine, rollout, processor, samples, encoded, cfg, steps: int = 3) -> None:
    """``steps`` GRPO updates on fresh rollouts, the engine asleep during each."""
    from omni_rl.recipes import grpo
    from omni_rl.rollout.hf import SamplingParams

    for step in range(steps):
        numbers = [200 + 10 * step + i for i in range(len(samples))]
        seeds = [grpo.prompt_seed(0, number, 4) for number in numbers]
        got = rollout.rollout(samples, encoded, 4, SamplingParams(1.0, 1.0, 0, 32), seeds)
        rollout.sleep()
        advantages = torch.randn(len(samples) * 4, generator=torch.Generator().manual_seed(step)).cuda()
        batch = grpo.Batch(samples, encoded, seeds, numbers)
        mask = got.completion_mask.cuda()
        grpo._update(engine, None, batch, got, mask, advantages, processor.tokenizer.pad_token_id, cfg, False)
        rollout.load_weights(engine.module)


def check_logprob_parity(rollout, engine, processor, samples, encoded, cfg, label: str):
    before = logprob_gap(rollout, engine, processor, samples, encoded, cfg)
    optimizer_steps(engine, rollout, processor, samples, encoded, cfg)
    after = logprob_gap(rollout, engine, processor, samples, encoded, cfg)
    ok = before["abs"] < 0.05 and after["abs"] < 0.05 and after["k3"] < 0.01
    fmt = lambda g: f"mean |dlogp| {g['abs']:.4f}, k3 {g['k3']:.5f}, max {g['max']:.3f}"  # noqa: E731
    return ok, f"{label}: before {fmt(before)}; after 3 steps {fmt(after)} (pass: mean < 0.05, k3 < 0.01)"


def check_encoder_cache(rollout, engine, samples, encoded):
    from omni_rl.rollout.hf import SamplingParams

    greedy = SamplingParams(0.0, 1.0, 0, 16)
    first = rollout.rollout(samples[:1], encoded[:1], 1, greedy, [0]).completion_ids
    again = rollout.rollout(samples[:1], encoded[:1], 1, greedy, [0]).completion_ids  # encoder output cached
    with torch.no_grad():
        for name, p in engine.module.named_parameters():
            if ".visual." in f".{name}":
                p.mul_(-3.0)
    rollout.sleep()
    rollout.load_weights(engine.module)
    after = rollout.rollout(samples[:1], encoded[:1], 1, greedy, [0]).completion_ids
    ok = torch.equal(first, again) and not torch.equal(first, after)
    return (
        ok,
        f"greedy answer repeated before the change: {torch.equal(first, again)}; "
        f"changed after: {not torch.equal(first, after)}",
    )


def check_distinct_groups(rollout, samples, encoded):
    from omni_rl.recipes.grpo import prompt_seed
    from omni_rl.rollout.hf import SamplingParams

    seeds = [prompt_seed(0, 300, 4), prompt_seed(0, 301, 4)]
    got = rollout.rollout([samples[0]] * 2, [encoded[0]] * 2, 4, SamplingParams(1.0, 1.0, 0, 16), seeds)
    same = torch.equal(got.completion_ids[:4], got.completion_ids[4:])
    return not same, f"seeds {seeds}: the two groups {'are identical' if same else 'differ'}"


def check_grpo_steps(work: Path, model_dir: Path, encoded):
    """Two GRPO steps in their own process; the prompt limit sits below the longest
    synthetic prompt, so some prompts are skipped and counted."""
    from omni_rl.preprocess.scenes import write_video_qa

    data = write_video_qa(work / "qa", videos=8, seed=0, seconds=2.0)
    run = work / "grpo_run"
    command = [
        sys.executable, "-m", "omni_rl", "train", str(ROOT / "configs/gpu_check_grpo_3b.yaml"),
        "--set", f"model.path={model_dir}", "--set", f"data.train={data}", "--set", f"run.output_dir={run}",
        "--set", "trainer.steps=2", "--set", "trainer.strategy=single", "--set", "rollout.engine=vllm",
        "--set", "rollout.max_new_tokens=32", "--set", "rollout.vllm.max_model_len=4096",
        "--set", "rollout.vllm.gpu_memory_utilization=0.25", "--set", "media.max_frames=8",
        "--set", "rollout.max_prompt_length=PLACEHOLDER",
    ]  # fmt: skip
    lengths = probe_lengths(data, model_dir)
    limit = sorted(lengths)[len(lengths) // 2]
    command[-1] = f"rollout.max_prompt_length={limit}"
    start = time.time()
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        return False, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    skipped = sum(r.get("skipped/prompt_too_long", 0) for r in rows)
    detail = (
        f"{len(rows)} steps in {time.time() - start:.0f} s; prompt lengths {min(lengths)}..{max(lengths)}, "
        f"limit {limit}: {skipped} skipped; rollout/logp_abs_diff "
        f"{[round(r['rollout/logp_abs_diff'], 4) for r in rows]}"
    )
    return len(rows) == 2 and skipped > 0, detail


def check_curate(work: Path, model_dir: Path):
    """``omni-rl curate text-only`` answered by vLLM, in its own process: every row asked
    and written once, the report's rows those of the data."""
    from omni_rl.preprocess.scenes import write_video_qa

    data = write_video_qa(work / "qa_curate", videos=8, seed=1, seconds=2.0)
    out = work / "curate_vllm"
    command = [
        sys.executable, "-m", "omni_rl", "curate", "text-only", str(data), "--model", str(model_dir),
        "--out", str(out), "--samples", "4", "--max-new-tokens", "16", "--config",
        str(ROOT / "configs/gpu_check_grpo_3b.yaml"), "--set", f"model.path={model_dir}", "--set",
        "rollout.engine=vllm", "--set", "rollout.vllm.max_model_len=4096", "--set",
        "rollout.max_prompt_length=3968", "--set", "rollout.vllm.gpu_memory_utilization=0.25",
    ]  # fmt: skip
    start = time.time()
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        return False, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    rows = len(data.read_text().splitlines())
    asked = [json.loads(line) for line in (out / "passes.jsonl").read_text().splitlines()]
    report = json.loads((out / "report.json").read_text())
    detail = f"{len(asked)} of {rows} rows asked in {time.time() - start:.0f} s, {report['overall']['dropped']} dropped"
    ok = len(asked) == len({a["id"] for a in asked}) == rows == report["overall"]["rows"]
    return ok and all(len(a["answers"]) == 4 for a in asked), detail


def probe_lengths(data: Path, model_dir: Path) -> list[int]:
    """Prompt token counts of the synthetic rows under the GRPO config's media settings."""
    from omni_rl.data.dataset import encode_sample
    from omni_rl.models import load
    from omni_rl.recipe_loader import load_config
    from omni_rl.recipes.common import setup_data

    cfg = load_config(
        ROOT / "configs/gpu_check_grpo_3b.yaml", [f"model.path={model_dir}", f"data.train={data}", "media.max_frames=8"]
    )
    _, processor = load(model_dir)
    dataset, _ = setup_data(cfg, torch.device("cuda"))
    return [int(encode_sample(processor, dataset[i])["input_ids"].shape[1]) for i in range(len(dataset))]


# -------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=ROOT / "runs/gpu_smoke_vllm")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_smoke_vllm: needs a CUDA GPU", file=sys.stderr)
        return 1
    try:
        import vllm
    except ImportError:
        print("gpu_smoke_vllm: needs vllm (pip install -e '.[vllm]')", file=sys.stderr)
        return 1
    from omni_rl.rollout import build_rollout_engine

    args.work.mkdir(parents=True, exist_ok=True)
    print(f"vllm {vllm.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    model_dir, cfg, samples, encode_sample = build_inputs(args.work)
    memory = {"before": used_gib()}
    engine, processor = trainer(model_dir, lora=False)
    encoded = [dict(encode_sample(processor, s)) for s in samples]
    memory["trainer"] = used_gib()
    rollout = build_rollout_engine(cfg, engine.module, processor, model_dir, args.work / "run")
    memory["vllm init"] = used_gib()
    run_check("apply_model", check_apply_model, rollout)
    run_check("prompt_parity", check_prompt_parity, rollout, processor, samples, encoded)
    run_check("weight_sync", check_weight_sync, rollout, engine)
    run_check("distinct_groups", check_distinct_groups, rollout, samples, encoded)
    memory["after rollout"] = used_gib()
    rollout.sleep()
    memory["asleep"] = used_gib()
    rollout.load_weights(engine.module)
    memory["awake"] = used_gib()
    run_check("logprob_parity", check_logprob_parity, rollout, engine, processor, samples, encoded, cfg, "full")
    memory["peak allocated by the trainer"] = torch.cuda.max_memory_allocated() / 2**30
    run_check("encoder_cache", check_encoder_cache, rollout, engine, samples, encoded)
    rollout.sleep()
    freed = memory["after rollout"] - memory["asleep"]
    report(
        "memory",
        freed > 1.0,
        ", ".join(f"{k} {v:.1f} GiB" for k, v in memory.items()) + f"; sleep freed {freed:.1f} GiB",
    )
    lora_engine, _ = trainer(model_dir, lora=True)
    lora_rollout = build_rollout_engine(cfg, lora_engine.module, processor, model_dir, args.work / "run_lora")
    lora_rollout.load_weights(lora_engine.module)
    run_check("lora", check_logprob_parity, lora_rollout, lora_engine, processor, samples, encoded, cfg, "LoRA")
    lora_rollout.sleep()
    run_check("grpo_steps", check_grpo_steps, args.work, model_dir, encoded)
    run_check("curate", check_curate, args.work, model_dir)
    failed = [name for name, ok, _ in RESULTS if not ok]
    print(f"gpu_smoke_vllm: {len(RESULTS) - len(failed)} passed, {len(failed)} failed {failed if failed else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
