"""A LeRobot pi_0 checkpoint as the transformers checkpoint the flow recipe loads.

LeRobot's ``save_pretrained`` writes, in one directory:

- ``config.json``: LeRobot's own (``"type": "pi0"``, ``chunk_size``, ``max_state_dim``,
  ``max_action_dim``, ``num_inference_steps``, the time-sampling fields,
  ``paligemma_variant`` and ``action_expert_variant`` naming the sizes,
  ``image_resolution``, ``normalization_mapping``), not transformers' ``PI0Config``;
- ``model.safetensors``: the weights under openpi's names (``paligemma_with_expert.*``,
  ``state_proj``, ``action_in_proj``...), which transformers' ``PI0`` reads through its
  own key mapping (``transformers.conversion_mapping``, entry ``pi0``);
- ``policy_preprocessor.json`` and one safetensors file per stateful step: the
  normalizer's holds the dataset statistics as ``observation.state.mean``,
  ``action.std``... for the modes its ``norm_map`` names (pi_0: mean and std).

``convert_lerobot_pi0`` writes a transformers checkpoint: ``PI0Config`` from LeRobot's
fields, the weights re-saved by ``PI0ForConditionalGeneration``, and a ``PI0Processor``
whose state and action statistics are LeRobot's (``omni_rl.models.pi0.normalize`` applies
them). The tokenizer is not in older LeRobot checkpoints (only PaliGemma's name is):
it comes from a local directory. The file names, fields and key names are LeRobot's
code's (``src/lerobot/policies/pi0``, ``src/lerobot/processor``); no released
checkpoint was read here (nothing is downloaded).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from omni_rl.errors import OmniRLError

_log = logging.getLogger(__name__)

# LeRobot's variant names of the two Gemma sizes, which PI0Config's defaults are
SIZES = {"paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m"}
# LeRobot's config fields that PI0Config has under the same name
SHARED_FIELDS = (
    "chunk_size",
    "max_state_dim",
    "max_action_dim",
    "num_inference_steps",
    "time_sampling_beta_alpha",
    "time_sampling_beta_beta",
    "time_sampling_scale",
    "time_sampling_offset",
    "min_period",
    "max_period",
)
# the statistics' feature names: LeRobot's (state, action) -> PI0Processor's
FEATURES = {"observation.state": "state", "action": "actions"}
NORMALIZER = "normalizer_processor"


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise OmniRLError(f"{path}: no such file")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise OmniRLError(f"{path}: not JSON ({err})") from None


def pi0_config(lerobot: dict, source: Path, sizes: Path | None = None):
    """transformers' ``PI0Config`` of a LeRobot pi_0 ``config.json`` (read from
    ``source``): its shared fields, and the Gemma sizes its variants name (PI0Config's
    defaults are LeRobot's ``gemma_2b`` and ``gemma_300m``), or those of the transformers
    config.json ``sizes`` (any other variant, a test's tiny one)."""
    from transformers import PI0Config

    if lerobot.get("type") != "pi0":
        raise OmniRLError(
            f"{source}: a LeRobot policy of type {lerobot.get('type')!r}; only pi0 converts (pi05 is not built yet)"
        )
    fields = {name: lerobot[name] for name in SHARED_FIELDS if name in lerobot}
    if sizes is not None:
        sized = _read_json(sizes)
        return PI0Config(vlm_config=sized["vlm_config"], dit_config=sized["dit_config"], **fields)
    other = {k: lerobot.get(k) for k, v in SIZES.items() if lerobot.get(k, v) != v}
    if other:
        raise OmniRLError(
            f"{source}: {other}: only {SIZES} are known sizes; pass a transformers PI0 config.json with them (--sizes)"
        )
    return PI0Config(**fields)


def normalizer_statistics(source: Path) -> dict[str, list[float]]:
    """PI0Processor's ``state_mean``, ``state_std``, ``actions_mean``, ``actions_std``
    from the normalizer step of ``source``'s ``policy_preprocessor.json``; {} where the
    checkpoint has no normalizer state (the run then says so)."""
    from safetensors.torch import load_file

    pipeline = source / "policy_preprocessor.json"
    if not pipeline.is_file():
        return {}
    steps = [s for s in _read_json(pipeline).get("steps", []) if s.get("registry_name") == NORMALIZER]
    if not steps or not steps[0].get("state_file"):
        return {}
    step = steps[0]
    modes = (step.get("config") or {}).get("norm_map") or {}
    for kind in ("STATE", "ACTION"):
        if modes.get(kind, "MEAN_STD") != "MEAN_STD":
            raise OmniRLError(
                f"{pipeline}: {kind} is normalized by {modes[kind]}; PI0Processor normalizes by mean and std only"
            )
    path = source / step["state_file"]
    if not path.is_file():
        raise OmniRLError(f"{pipeline}: its normalizer's state file {path} does not exist")
    tensors = load_file(str(path))
    found = {}
    for feature, name in FEATURES.items():
        mean, std = tensors.get(f"{feature}.mean"), tensors.get(f"{feature}.std")
        if (mean is None) != (std is None):
            raise OmniRLError(f"{path}: {feature}.mean and {feature}.std go together; it holds only one of them")
        if mean is not None:
            found[f"{name}_mean"], found[f"{name}_std"] = mean.float().tolist(), std.float().tolist()
    return found


def convert_lerobot_pi0(source: str | Path, out: str | Path, tokenizer: str | Path, sizes: str | Path | None = None):
    """Write the transformers checkpoint of the LeRobot pi_0 checkpoint ``source`` to
    ``out`` (see the module docstring), with the tokenizer in the local directory
    ``tokenizer`` (PaliGemma's for a released checkpoint). Returns ``out``."""
    from transformers import AutoTokenizer, PI0ForConditionalGeneration, PI0ImageProcessor, PI0Processor

    from omni_rl.runtime import umask_files

    source, out = Path(source), Path(out)
    lerobot = _read_json(source / "config.json")
    config = pi0_config(lerobot, source / "config.json", None if sizes is None else Path(sizes))
    if not (source / "model.safetensors").is_file():
        raise OmniRLError(f"{source / 'model.safetensors'}: no such file")
    stats = normalizer_statistics(source)
    if not stats:
        _log.warning("%s: no normalizer statistics: states and actions will pass unnormalized", source)
    words = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    side = lerobot.get("image_resolution", [224, 224])
    vision = config.vlm_config.vision_config
    images = PI0ImageProcessor(
        size={"max_height": side[0], "max_width": side[1]},
        pad_size={"height": side[0], "width": side[1]},
        image_seq_length=(vision.image_size // vision.patch_size) ** 2,
    )
    processor = PI0Processor(images, words, max_state_dim=config.max_state_dim, chunk_size=config.chunk_size, **stats)
    want = config.vlm_config.image_token_id
    if processor.image_token_id != want:
        raise OmniRLError(f"{tokenizer}: its image token is id {processor.image_token_id}, the model's {want}")
    # transformers' key mapping for pi0 reads openpi's names, with or without "model.";
    # it would start a weight it finds no value for at random, so each must be found
    model, loading = PI0ForConditionalGeneration.from_pretrained(
        str(source), config=config, local_files_only=True, use_kernels=False, output_loading_info=True
    )
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if loading.get(what):
            names = sorted(map(str, loading[what]))
            raise OmniRLError(
                f"{source / 'model.safetensors'}: {len(names)} {what.replace('_', ' ')} against PI0 "
                f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
            )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    umask_files(out)
    return out
