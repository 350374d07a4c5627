"""An offline byte-level tokenizer and chat template for tiny test models.

No Qwen tokenizer file ships with any installed package, and nothing is downloaded, so
tiny models get a tokenizer built here: the 256 byte symbols of byte-level BPE (no
merges, so every byte is one token) followed by the family's special tokens. It is a
real ``Qwen2Tokenizer``: the family's processor, ``save_pretrained`` and
``AutoTokenizer`` all treat it like the released one.

The chat template dispatches on ``content['type']``: rows read through ``datasets``
carry every key in every content part, so a test like ``'image' in content`` misfires.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import Qwen2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode


@dataclass(frozen=True)
class TokenSpec:
    """The special tokens of one family and how its prompts mark each modality.

    Attributes:
        specials: special tokens in id order, after the 256 byte tokens.
        named: tokenizer attributes the family's processor reads (``image_token``, ...).
        markup: modality (``image``, ``video``, ``audio``) -> the text a content part
            of that type becomes in the prompt.
        system_prompt: the default system message, or "" for none.
    """

    specials: tuple[str, ...]
    named: dict[str, str] = field(default_factory=dict)
    markup: dict[str, str] = field(default_factory=dict)
    system_prompt: str = ""


def chat_template(spec: TokenSpec) -> str:
    """A Jinja chat template in the Qwen ChatML layout for ``spec``'s modalities."""
    branches = "".join(f"{{%- elif part['type'] == '{kind}' -%}}{text}" for kind, text in spec.markup.items())
    # Whitespace control strips literal newlines next to tags, so they are emitted as
    # Jinja string expressions.
    newline = "{{ '\\n' }}"
    system = ""
    if spec.system_prompt:
        system = (
            "{%- if messages[0]['role'] != 'system' -%}"
            f"<|im_start|>system{newline}{spec.system_prompt}<|im_end|>{newline}"
            "{%- endif -%}"
        )
    return (
        system + "{%- for message in messages -%}"
        f"<|im_start|>{{{{ message['role'] }}}}{newline}"
        "{%- if message['content'] is string -%}{{ message['content'] }}"
        "{%- else -%}{%- for part in message['content'] -%}"
        "{%- if part['type'] == 'text' -%}{{ part['text'] }}" + branches + "{%- endif -%}{%- endfor -%}{%- endif -%}"
        f"<|im_end|>{newline}"
        "{%- endfor -%}"
        f"{{%- if add_generation_prompt -%}}<|im_start|>assistant{newline}{{%- endif -%}}"
    )


def byte_level_tokenizer(specials: list[str] | tuple[str, ...], **named) -> Qwen2Tokenizer:
    """A byte-level ``Qwen2Tokenizer``: ids 0-255 are the bytes, ``specials`` follow in
    order, all marked special; ``named``: its ``eos_token``, ``pad_token``,
    ``bos_token``, ``extra_special_tokens``..."""
    byte_symbols = bytes_to_unicode()
    tokens = [byte_symbols[b] for b in range(256)] + list(specials)
    tokenizer = Qwen2Tokenizer(vocab={token: i for i, token in enumerate(tokens)}, merges=[], unk_token=None, **named)
    # The specials are already in the vocabulary (so their ids follow the bytes in
    # order); registering them marks them special, so they are never split.
    tokenizer.add_special_tokens({"extra_special_tokens": list(specials)}, replace_extra_special_tokens=False)
    return tokenizer


def build_tokenizer(spec: TokenSpec) -> Qwen2Tokenizer:
    """A byte-level ``Qwen2Tokenizer`` with ``spec``'s special tokens and template.

    Ids 0-255 are the bytes; the specials follow in ``spec.specials`` order, so the
    first special (``<|endoftext|>``) is id 256.
    """
    tokenizer = byte_level_tokenizer(
        spec.specials, eos_token="<|im_end|>", pad_token="<|endoftext|>", extra_special_tokens=dict(spec.named)
    )
    tokenizer.chat_template = chat_template(spec)
    return tokenizer
