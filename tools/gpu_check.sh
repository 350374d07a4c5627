#!/usr/bin/env bash
# What only a GPU can show, in one command: FSDP2 bf16-mixed GRPO on GPUS (default 2)
# GPUs for 5 steps with a random-init model of Qwen2.5-VL-3B's shapes (real vocabulary
# and widths) on synthetic video QA; prints s/step, rollout tokens/s and peak memory
# per GPU; then one GRPO update of the full 3B-shaped model on a 64-frame video
# (8,192 visual tokens, G = 8, 256 new tokens, gradient checkpointing), the shared
# prompt against a copy per completion: seconds, tokens/s and peak memory. Needs CUDA and the project's environment (make setup). CI never runs it.
# Then the same 3B config on GPU 0 synchronously and with a one-step-off rollout (one trainer
# and one rollout process sharing the GPU): seconds per step of each and their ratio.
# Where vllm is installed it then runs tools/gpu_smoke_vllm.py (PASS or FAIL per check).
# Last, on one GPU: flow-policy PPO in ManiSkill's batched GPU simulation (PushCube, 256
# envs, state observations, 20 iterations from scratch): env steps/s of the rollout,
# seconds per update and per seeded reset (env by env, see omni_rl/sim/maniskill.py).
# Then, on one GPU: pi_0 of pi0_base's shapes (3.5 B, random weights, tools/random_pi0.py)
# on ManiSkill PushCube from a 224x224 camera, one rank's share of
# configs/maniskill_pushcube_pi0_gpu.yaml (40 envs, 8 BC rows): 20 BC steps of the whole
# model, then 3 Flow-Noise PPO iterations; seconds per iteration and peak memory, beside
# the peak traced for the same settings; then the same for pi_0.5 (pi05_base's shapes).
# Beside the measured peak it prints the peak tools/trace_memory.py traces for the same
# config on fake tensors, and it runs 2 steps on mixed modalities (half the rows text-only).
#   tools/gpu_check.sh            # GPUS=1 tools/gpu_check.sh on a single GPU
#   SIM_ONLY=1 tools/gpu_check.sh # the ManiSkill GPU run alone (one GPU)
#   PI0_ONLY=1 tools/gpu_check.sh # the pi_0 run alone (one GPU, about 80 GB)
#   PI05_ONLY=1 tools/gpu_check.sh # the same for pi_0.5 (configs/maniskill_pushcube_pi05_gpu.yaml)
#   OFF_ONLY=1 tools/gpu_check.sh # the one-step-off pair alone (one GPU)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
GPUS=${GPUS:-2}
WORK=${WORK:-runs/gpu_check}

sim_check() {
  echo "gpu_check: flow PPO on ManiSkill's GPU backend (PushCube-v1, 256 envs, 20 iterations)"
  rm -rf "$WORK/sim"
  "$PY" -m omni_rl train configs/maniskill_pushcube_flow_noise_gpu.yaml --set bc.demos=null \
    --set trainer.steps=20 --set trainer.eval_every=0 --set trainer.eval_episodes=256 \
    --set run.output_dir="$WORK/sim"
  "$PY" - "$WORK/sim/metrics.jsonl" <<'PYEOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if '"throughput/rollout_env_steps_per_s"' in line]
steady = rows[2:] or rows  # the first iterations pay for CUDA and PhysX warm-up
med = lambda key: statistics.median(r[key] for r in steady)
print(f"gpu_check sim: iterations={len(rows)} rollout env steps/s={med('throughput/rollout_env_steps_per_s'):.0f} "
      f"whole-iteration env steps/s={med('throughput/env_steps_per_s'):.0f} update s/iteration={med('time/update'):.3f} "
      f"reset s/iteration={med('time/reset'):.3f} rollout s/iteration={med('time/rollout'):.3f} "
      f"held-out success at the end={rows[-1].get('eval/success')}")
PYEOF
}

vla_check() {  # pi0 or pi05
  local kind=$1 dir="$WORK/$1"
  echo "gpu_check: $kind (random weights of ${kind}_base's shapes) on ManiSkill PushCube from a 224x224 camera"
  [ -f "$dir/model/config.json" ] || "$PY" tools/random_pi0.py --family "$kind" --out "$dir/model" --device cuda
  [ -f "$WORK/pi0/demos.safetensors" ] || "$PY" -m omni_rl sim collect-demos --task PushCube-v1 --episodes 20 \
    --obs-mode rgb --image-size 224 --backend cpu --out "$WORK/pi0/demos.safetensors"
  rm -rf "$dir/run"
  # one rank of the 8-GPU config: its 40 envs and 8 BC rows, in one process
  local one_rank=(--set trainer.strategy=single --set env.num_envs=40 --set bc.batch_size=8)
  local start
  start=$(date +%s)
  "$PY" -m omni_rl train "configs/maniskill_pushcube_${kind}_gpu.yaml" "${one_rank[@]}" \
    --set policy.path="$dir/model" --set bc.demos="$WORK/pi0/demos.safetensors" --set bc.steps=20 \
    --set trainer.steps=3 --set trainer.eval_every=0 --set trainer.eval_episodes=40 --set run.output_dir="$dir/run"
  echo "gpu_check $kind: the run took $(( $(date +%s) - start )) s (model load, demos' upload and warm-up included)"
  "$PY" - "$dir/run/metrics.jsonl" "$kind" <<'PYEOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if '"time/update"' in line]
med = lambda key: statistics.median(r[key] for r in rows)
print(f"gpu_check {sys.argv[2]}: iterations={len(rows)} rollout s/iteration={med('time/rollout'):.2f} "
      f"update s/iteration={med('time/update'):.2f} rollout env steps/s={med('throughput/rollout_env_steps_per_s'):.0f} "
      f"peak memory: allocated {max(r.get('memory/peak_allocated_gb', float('nan')) for r in rows):.1f} GiB, "
      f"reserved {max(r.get('memory/peak_reserved_gb', float('nan')) for r in rows):.1f} GiB")
PYEOF
  echo "gpu_check $kind: the peak traced on fake tensors for the same settings (tools/trace_memory.py; 20 demo episodes)"
  "$PY" tools/trace_memory.py "configs/maniskill_pushcube_${kind}_gpu.yaml" --world 1 "${one_rank[@]}" \
    --set policy.path="$dir/model" --demo-chunks 1000 | tail -n 1 | sed "s/^/gpu_check $kind traced: /"
}

prepare_3b() {
  [ -f "$WORK/model/config.json" ] || "$PY" tools/random_model.py --shape 3b --out "$WORK/model" --dtype float32
  [ -f "$WORK/data/data.jsonl" ] || "$PY" tools/make_synthetic_media.py --out "$WORK/data" --videos 16 --seconds 8
}

off_check() {
  echo "gpu_check: one-step-off rollout (rollout.staleness: 1): 1 trainer and 1 rollout process on GPU 0, 5 steps,"
  echo "  beside the same config synchronous in one process (trainer.strategy: single)"
  for staleness in 0 1; do
    rm -rf "$WORK/off$staleness"
    timeout 900 "$(dirname "$PY")/torchrun" --standalone --nproc-per-node=$((1 + staleness)) -m omni_rl train \
      configs/gpu_check_grpo_3b.yaml --set model.path="$WORK/model" --set data.train="$WORK/data/data.jsonl" \
      --set run.output_dir="$WORK/off$staleness" --set trainer.strategy=single --set rollout.staleness=$staleness \
      --set trainer.dist_timeout_minutes=5
  done
  "$PY" - "$WORK/off0/metrics.jsonl" "$WORK/off1/metrics.jsonl" <<'PYEOF'
import json, statistics, sys
runs = [[json.loads(line) for line in open(path)][1:] for path in sys.argv[1:]]  # step 1 pays for warm-up
step = [statistics.median(r["time/step"] for r in rows) for rows in runs]
waits = [r["time/rollout_wait"] for r in runs[1] if "time/rollout_wait" in r]  # the last step waits for none
print(f"gpu_check one-step-off: s/step synchronous {step[0]:.2f}, one-step-off {step[1]:.2f} "
      f"(trainer waited {statistics.median(waits):.2f} s for batches, "
      f"rollout process waited {statistics.median(r['rollout_process/weights_wait_s'] for r in runs[1]):.2f} s for weights), "
      f"speedup sync/async = {step[0] / step[1]:.2f}, staleness {[r['rollout/staleness'] for r in runs[1]]}, "
      f"trainer's peak allocated {[max(r.get('memory/peak_allocated_gb', float('nan')) for r in rows) for rows in runs]} GiB")
PYEOF
}

if [ "${PI0_ONLY:-0}" = 1 ] || [ "${PI05_ONLY:-0}" = 1 ]; then
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || { echo "gpu_check: needs a CUDA GPU" >&2; exit 1; }
  [ "${PI0_ONLY:-0}" = 1 ] && vla_check pi0
  [ "${PI05_ONLY:-0}" = 1 ] && vla_check pi05
  exit 0
fi
if [ "${OFF_ONLY:-0}" = 1 ]; then
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || { echo "gpu_check: needs a CUDA GPU" >&2; exit 1; }
  prepare_3b
  off_check
  exit 0
fi
if [ "${SIM_ONLY:-0}" = 1 ]; then
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || { echo "gpu_check: needs a CUDA GPU" >&2; exit 1; }
  sim_check
  exit 0
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.device_count() >= $GPUS else 1)"; then
  echo "gpu_check: needs $GPUS CUDA GPU(s); found $("$PY" -c 'import torch; print(torch.cuda.device_count())')" >&2
  exit 1
fi
prepare_3b
rm -rf "$WORK/run"
one=()  # FSDP2 needs 2 or more processes: one GPU trains in one process
[ "$GPUS" -ge 2 ] || one=(--set trainer.strategy=single)
start=$(date +%s)
"$(dirname "$PY")/torchrun" --standalone --nproc-per-node="$GPUS" -m omni_rl train configs/gpu_check_grpo_3b.yaml \
  --set model.path="$WORK/model" --set data.train="$WORK/data/data.jsonl" --set run.output_dir="$WORK/run" "${one[@]}"
echo "gpu_check: the run took $(( $(date +%s) - start )) s (model load and warm-up included)"
"$PY" - "$WORK/run/metrics.jsonl" "$GPUS" <<'PYEOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
steady = rows[1:] or rows  # step 1 pays for warm-up
step = statistics.median(r["time/step"] for r in steady)
tokens = statistics.median(r["throughput/rollout_tokens_per_s"] for r in steady)
peak = max(r.get("memory/peak_allocated_gb", float("nan")) for r in rows)
reserved = max(r.get("memory/peak_reserved_gb", float("nan")) for r in rows)
print(f"gpus={sys.argv[2]} steps={len(rows)} s/step={step:.2f} (rollout {statistics.median(r['time/rollout'] for r in steady):.2f}, "
      f"update {statistics.median(r['time/update'] for r in steady):.2f}) rollout tokens/s={tokens:.0f} "
      f"peak memory per GPU: allocated {peak:.1f} GiB, reserved {reserved:.1f} GiB")
PYEOF
echo "gpu_check: the peak traced on fake tensors for the same config and world (tools/trace_memory.py; a 16:9"
echo "  video of the media budgets' most frames, longer than the check's 8-second clips, and full-length"
echo "  completions, so at or above the measured peak)"
"$PY" tools/trace_memory.py configs/gpu_check_grpo_3b.yaml --world "$GPUS" --set model.path="$WORK/model" "${one[@]}" \
  --checks warn | tail -n 1 | sed 's/^/gpu_check traced: /'
if [ "$GPUS" -ge 2 ]; then
  # half the rows without their video: ranks' micro-batches differ in which encoders run
  # (each rank runs every encoder under FSDP2; a mismatch here hangs NCCL or corrupts weights)
  echo "gpu_check: FSDP2 on mixed modalities (every second row text-only), 2 steps"
  "$PY" - "$WORK/data/data.jsonl" "$WORK/data/mixed.jsonl" <<'PYEOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
mixed = [row if i % 2 == 0 else {k: v for k, v in row.items() if k != "videos"} for i, row in enumerate(rows)]
open(sys.argv[2], "w").write("".join(json.dumps(row) + "\n" for row in mixed))
PYEOF
  rm -rf "$WORK/mixed"
  timeout 900 "$(dirname "$PY")/torchrun" --standalone --nproc-per-node="$GPUS" -m omni_rl train \
    configs/gpu_check_grpo_3b.yaml --set model.path="$WORK/model" --set data.train="$WORK/data/mixed.jsonl" \
    --set run.output_dir="$WORK/mixed" --set trainer.steps=2 --set trainer.dist_timeout_minutes=5
  echo "gpu_check mixed: $(wc -l < "$WORK/mixed/metrics.jsonl") steps logged, no hang"
fi
off_check
echo "gpu_check: one GRPO update on a 64-frame video, shared prompt (omni) against a copy per completion (peer)"
"$PY" tools/bench_memory.py --device cuda --model "$WORK/model" --frames 64 --size 448 --new-tokens 256 \
  --checkpointing --runs omni:8,peer:8
if "$PY" -c "import vllm" 2>/dev/null; then
  echo "gpu_check: the vLLM rollout engine's checks"
  "$PY" tools/gpu_smoke_vllm.py --work "$WORK/vllm"
else
  echo "gpu_check: vllm is not installed (pip install -e '.[vllm]'): tools/gpu_smoke_vllm.py not run"
fi
sim_check
vla_check pi0
vla_check pi05
