"""A LeRobot pi_0 or pi_0.5 checkpoint as the transformers checkpoint the flow recipe loads.

LeRobot's ``save_pretrained`` writes, in one directory:

- ``config.json``: LeRobot's own (``"type": "pi0"`` or ``"pi05"``, ``chunk_size``,
  ``max_state_dim``, ``max_action_dim``, ``num_inference_steps``, the time-sampling
  fields, ``paligemma_variant`` and ``action_expert_variant`` naming the sizes,
  ``image_resolution``, ``normalization_mapping``; pi_0.5's ``tokenizer_max_length``),
  not transformers' ``PI0Config``/``PI05Config``;
- ``model.safetensors``: the weights under openpi's names (``paligemma_with_expert.*``,
  ``action_in_proj``, pi_0's ``state_proj``, pi_0.5's ``time_mlp_in``...), which
  transformers' ``PI0`` and ``PI05`` read through their key mapping
  (``transformers.conversion_mapping``, entry ``pi0``, which ``pi05`` shares);
- ``policy_preprocessor.json`` and one safetensors file per stateful step: the
  normalizer's holds the dataset statistics as ``observation.state.mean``,
  ``action.q01``... for the modes its ``norm_map`` names (pi_0: mean and std; pi_0.5:
  the 1st and 99th percentiles, ``QUANTILES``).

``convert_lerobot_policy`` writes a transformers checkpoint: the config from LeRobot's
fields, the weights re-saved by the model class, and the processor whose state and
action statistics are LeRobot's (``omni_rl.models.pi0.normalize`` applies them: mean and
std, or quantiles mapped to [-1, 1]). The tokenizer is not in older LeRobot checkpoints
(only PaliGemma's name is): it comes from a local directory. The file names, fields and
key names are LeRobot's code's (``src/lerobot/policies/pi0``, ``.../pi05``,
``src/lerobot/processor``); no released checkpoint was read here (nothing is downloaded).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from omni_rl.errors import OmniRLError

_log = logging.getLogger(__name__)

# LeRobot's variant names of the two Gemma sizes, which PI0Config's and PI05Config's defaults are
SIZES = {"paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m"}
# LeRobot's config fields that PI0Config has under the same name (PI05Config: all but max_state_dim)
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
# the statistics' feature names: LeRobot's (state, action) -> the processor's
FEATURES = {"observation.state": "state", "action": "actions"}
NORMALIZER = "normalizer_processor"
# LeRobot's normalization modes -> the two statistics each reads, under the names LeRobot
# and transformers' processors both give them
STATISTICS = {"MEAN_STD": ("mean", "std"), "QUANTILES": ("q01", "q99")}
# the prompt length pi05_inputs allows (openpi's), which LeRobot's tokenizer_max_length must be
PI05_PROMPT = 200


@dataclass(frozen=True)
class Family:
    """What one LeRobot policy type converts to: transformers' config, model and
    processor classes, the LeRobot config fields the config shares, and the
    normalization modes the processor applies."""

    config: str
    model: str
    processor: str
    fields: tuple[str, ...]
    modes: tuple[str, ...]


FAMILIES = {
    "pi0": Family("PI0Config", "PI0ForConditionalGeneration", "PI0Processor", SHARED_FIELDS, ("MEAN_STD",)),
    "pi05": Family(
        "PI05Config",
        "PI05ForConditionalGeneration",
        "PI05Processor",
        tuple(name for name in SHARED_FIELDS if name != "max_state_dim"),
        ("MEAN_STD", "QUANTILES"),
    ),
}


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise OmniRLError(f"{path}: no such file")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise OmniRLError(f"{path}: not JSON ({err})") from None


def family_of(lerobot: dict, source: Path) -> Family:
    """The ``Family`` of a LeRobot ``config.json`` (read from ``source``), by its type."""
    kind = lerobot.get("type")
    if kind not in FAMILIES:
        raise OmniRLError(f"{source}: a LeRobot policy of type {kind!r}; only {sorted(FAMILIES)} convert")
    if kind == "pi05" and lerobot.get("tokenizer_max_length", PI05_PROMPT) != PI05_PROMPT:
        raise OmniRLError(
            f"{source}: tokenizer_max_length {lerobot['tokenizer_max_length']}; pi_0.5's prompts are "
            f"read with openpi's limit of {PI05_PROMPT} tokens here"
        )
    return FAMILIES[kind]


def transformers_config(lerobot: dict, source: Path, sizes: Path | None = None):
    """transformers' ``PI0Config`` or ``PI05Config`` of a LeRobot ``config.json`` (read
    from ``source``): its shared fields, and the Gemma sizes its variants name (the
    configs' defaults are LeRobot's ``gemma_2b`` and ``gemma_300m``), or those of the
    transformers config.json ``sizes`` (any other variant, a test's tiny one)."""
    import transformers

    family = family_of(lerobot, source)
    make = getattr(transformers, family.config)
    fields = {name: lerobot[name] for name in family.fields if name in lerobot}
    if sizes is not None:
        sized = _read_json(sizes)
        return make(vlm_config=sized["vlm_config"], dit_config=sized["dit_config"], **fields)
    other = {k: lerobot.get(k) for k, v in SIZES.items() if lerobot.get(k, v) != v}
    if other:
        raise OmniRLError(
            f"{source}: {other}: only {SIZES} are known sizes; pass a transformers "
            f"{lerobot['type']} config.json with them (--sizes)"
        )
    return make(**fields)


def normalizer_statistics(source: Path, family: Family) -> dict[str, list[float]]:
    """The processor's statistics (``state_mean``, ``state_std``, ``actions_q01``...) from
    the normalizer step of ``source``'s ``policy_preprocessor.json``, for the mode its
    ``norm_map`` names for the state and for the actions (``STATISTICS``; a feature in
    ``IDENTITY`` mode gets none); {} where the checkpoint has no normalizer state (the
    run then says so). A mode ``family``'s processor does not apply is refused."""
    from safetensors.torch import load_file

    pipeline = source / "policy_preprocessor.json"
    if not pipeline.is_file():
        return {}
    steps = [s for s in _read_json(pipeline).get("steps", []) if s.get("registry_name") == NORMALIZER]
    if not steps or not steps[0].get("state_file"):
        return {}
    step = steps[0]
    modes = (step.get("config") or {}).get("norm_map") or {}
    path = source / step["state_file"]
    if not path.is_file():
        raise OmniRLError(f"{pipeline}: its normalizer's state file {path} does not exist")
    tensors = load_file(str(path))
    found = {}
    for (feature, name), kind in zip(FEATURES.items(), ("STATE", "ACTION"), strict=True):
        mode = modes.get(kind, "MEAN_STD")
        if mode == "IDENTITY":
            continue
        if mode not in family.modes:
            raise OmniRLError(
                f"{pipeline}: {kind} is normalized by {mode}; {family.processor} normalizes by "
                f"{' or '.join(family.modes)} only"
            )
        stats = {stat: tensors.get(f"{feature}.{stat}") for stat in STATISTICS[mode]}
        given = [stat for stat, value in stats.items() if value is not None]
        if len(given) == 1:
            raise OmniRLError(f"{path}: {mode} needs {feature}.{' and '.join(stats)}; it holds only {given[0]}")
        if given:
            found.update({f"{name}_{stat}": value.float().tolist() for stat, value in stats.items()})
    return found


def convert_lerobot_policy(
    source: str | Path, out: str | Path, tokenizer: str | Path, sizes: str | Path | None = None
) -> Path:
    """Write the transformers checkpoint of the LeRobot pi_0 or pi_0.5 checkpoint
    ``source`` to ``out`` (see the module docstring), with the tokenizer in the local
    directory ``tokenizer`` (PaliGemma's for a released checkpoint). Returns ``out``."""
    import transformers
    from transformers import AutoTokenizer, PI0ImageProcessor

    from omni_rl.runtime import umask_files

    source, out = Path(source), Path(out)
    lerobot = _read_json(source / "config.json")
    family = family_of(lerobot, source / "config.json")
    config = transformers_config(lerobot, source / "config.json", None if sizes is None else Path(sizes))
    if not (source / "model.safetensors").is_file():
        raise OmniRLError(f"{source / 'model.safetensors'}: no such file")
    stats = normalizer_statistics(source, family)
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
    state_dim = lerobot.get("max_state_dim", getattr(config, "max_state_dim", config.max_action_dim))
    processor = getattr(transformers, family.processor)(
        images, words, max_state_dim=state_dim, chunk_size=config.chunk_size, **stats
    )
    want = config.vlm_config.image_token_id
    if processor.image_token_id != want:
        raise OmniRLError(f"{tokenizer}: its image token is id {processor.image_token_id}, the model's {want}")
    # transformers' key mapping reads openpi's names, with or without "model."; it would
    # start a weight it finds no value for at random, so each must be found
    model, loading = getattr(transformers, family.model).from_pretrained(
        str(source), config=config, local_files_only=True, use_kernels=False, output_loading_info=True
    )
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if loading.get(what):
            names = sorted(map(str, loading[what]))
            raise OmniRLError(
                f"{source / 'model.safetensors'}: {len(names)} {what.replace('_', ' ')} against "
                f"{lerobot['type'].upper()} ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
            )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    umask_files(out)
    return out
