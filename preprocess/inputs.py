"""Model inputs in the cache: what a family's processor makes of a row's prompt and media.

Reading a cached medium is hundreds of times faster than decoding its file, but a
sample's model inputs still cost the processor's rescale, normalise and patchify on
every read. An inputs entry stores the processor's output for one row (``input_ids``,
``attention_mask``, ``pixel_values_videos`` and ``video_grid_thw``, audio features and
their masks: whatever ``omni_rl.models.inputs.encode_prompts`` returns), so training
reads it as it is.

Its key hashes everything that changes that output: the row's media entry keys (which
hash the source files and the media settings), its chat messages (the prompt after
``data.prompt_template``), the processor (class, preprocessing settings, tokenizer,
chat template), the transformers version, ``ENCODING_VERSION`` and the stored dtype. A
change to any of them is a miss, never stale inputs.

Stored dtype. Token ids, masks, grids and timings are kept as the processor returns
them. The media features (``COMPACT``) are kept in float32, or, for a run that computes
in bf16, in bfloat16: the model's first layer over them (the patch embedding, the audio
encoder's first convolution) rounds them to bf16 anyway, under autocast as under FSDP2's
mixed precision, so the stored bf16 values give that layer the same input and the run
computes exactly what it would from the float32 features, in half the bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import numpy as np
import torch
import transformers

from omni_rl.errors import OmniRLError
from omni_rl.preprocess.cache import Entry, MediaCache, entry_key

KIND = "inputs"
ENCODING_VERSION = 1
"""Bumped whenever ``encode_prompts`` asks the processor for something else."""
COMPACT = ("pixel_values", "pixel_values_videos", "input_features")
"""The processor's media features, which the model's first layer over them rounds to
its compute dtype."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def inputs_dtype(precision: str) -> str:
    """The dtype media features are stored in for a run of ``precision`` (resolved:
    fp32, bf16-mixed or bf16-pure): bfloat16 where the run computes in bf16."""
    return "bfloat16" if precision.startswith("bf16") else "float32"


def processor_digest(processor) -> str:
    """A digest of everything in ``processor`` that changes its output: its class, its
    media processors' settings, its tokenizer and its chat template."""
    tokenizer = getattr(processor, "tokenizer", None)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # its padding and truncation state is set by each call (padding_side left for prompts)
        model = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("padding", "truncation")}
        vocabulary = json.dumps(model, sort_keys=True)
    else:
        vocabulary = repr(sorted(tokenizer.get_vocab().items())) if tokenizer is not None else ""
    parts = {
        "class": type(processor).__name__,
        "settings": processor.to_json_string(),
        "tokenizer": vocabulary,
        "special": repr(sorted(tokenizer.special_tokens_map.items())) if tokenizer is not None else "",
        "chat_template": json.dumps(getattr(processor, "chat_template", None), sort_keys=True, default=str),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def inputs_key(media_keys: list[str], messages: list[dict], processor: str, dtype: str) -> str:
    """The key of a row's inputs entry: its media entry keys, its chat messages, the
    ``processor_digest`` and the stored dtype (see the module docstring)."""
    if dtype not in DTYPES:
        raise OmniRLError(f"inputs dtype '{dtype}' is not one of {', '.join(DTYPES)}")
    row = json.dumps({"media": list(media_keys), "messages": messages}, sort_keys=True, default=str)
    params = {
        "processor": processor,
        "dtype": dtype,
        "encoding": ENCODING_VERSION,
        "transformers": transformers.__version__,
    }
    return entry_key(KIND, hashlib.sha256(row.encode()).hexdigest(), params)


def pack(inputs: Mapping[str, torch.Tensor], dtype: str, media_keys: list[str]) -> tuple[dict[str, np.ndarray], dict]:
    """The tensors and metadata of an inputs entry: ``COMPACT`` features in ``dtype``
    (bfloat16 stored as its 16-bit pattern), everything else as it is."""
    tensors, stored, dtypes = {}, {}, {}
    for name, value in inputs.items():
        if not isinstance(value, torch.Tensor):
            raise OmniRLError(f"model input '{name}' is a {type(value).__name__}, not a tensor: it cannot be cached")
        dtypes[name] = str(value.dtype).removeprefix("torch.")
        if name in COMPACT and value.is_floating_point():
            stored[name] = dtype
            value = value.to(DTYPES[dtype])
        if value.dtype == torch.bfloat16:  # any bf16 tensor: unpack reads its bit pattern back
            stored[name] = "bfloat16"
            value = value.view(torch.int16)
        tensors[name] = value.detach().cpu().contiguous().numpy()
    meta = {"kind": KIND, "media": list(media_keys), "dtype": dtype, "stored": stored, "dtypes": dtypes}
    return tensors, meta


def inputs_of(cache: MediaCache, media: set[str]) -> set[str]:
    """The inputs entries of ``cache`` built from media entries all in ``media`` (what
    ``cache gc`` keeps beside them; an entry of a row without media is not kept)."""
    kept = set()
    for key in cache.entry_keys():
        meta = cache.meta(key) or {}
        if meta.get("kind") == KIND and meta["media"] and set(meta["media"]) <= media:
            kept.add(key)
    return kept


def inputs_made_from(cache: MediaCache, media: set[str]) -> set[str]:
    """The inputs entries of ``cache`` built from any of the media entries ``media``
    (what ``cache verify`` moves aside with a corrupt media entry: their key names the
    media entries, not their bytes, so a rebuilt media entry would find them again)."""
    made = set()
    for key in cache.entry_keys():
        meta = cache.meta(key) or {}
        if meta.get("kind") == KIND and set(meta.get("media") or ()) & media:
            made.add(key)
    return made


def unpack(entry: Entry) -> dict[str, torch.Tensor]:
    """The model inputs of an entry ``pack`` wrote, each tensor in the dtype the
    processor returned it in."""
    out = {}
    for name, value in entry.tensors.items():
        if entry.meta["stored"].get(name) == "bfloat16":
            value = value.view(torch.bfloat16)
        out[name] = value.to(getattr(torch, entry.meta["dtypes"][name]))
    return out
