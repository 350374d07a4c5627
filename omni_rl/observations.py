"""The flat observation layout envs write and flow policies read.

``omni_rl.sim`` (the envs, their demonstrations) and ``omni_rl.models`` (the policies)
import none of each other (an import-linter contract of ``make lint``); an image-and-
instruction observation passes between them as a flat float vector laid out by
``FlatLayout``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni_rl.errors import OmniRLError


@dataclass(frozen=True)
class FlatLayout:
    """How an env packs one observation into a flat float vector (what a flow policy's
    rollout buffers and demonstrations hold): one camera's image [3, S, S] (values
    0-255), the instruction's index into ``instructions``, the state, a privileged
    state. The envs write it (``omni_rl.sim``) and the policies read it
    (``omni_rl.models``): the one thing the two share."""

    image_size: int
    instructions: tuple[str, ...]
    state_dim: int
    privileged_dim: int

    @property
    def size(self) -> int:
        return 3 * self.image_size**2 + 1 + self.state_dim + self.privileged_dim

    def split(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(uint8 images [N, 3, S, S], instruction indices [N], state [N, s], privileged
        [N, p])."""
        if obs.ndim != 2 or obs.shape[1] != self.size:
            raise OmniRLError(f"pi0 observations: flat vectors [N, {self.size}] ({self}), got {list(obs.shape)}")
        pixels = 3 * self.image_size**2
        images = obs[:, :pixels].round().clamp(0, 255).to(torch.uint8).view(-1, 3, self.image_size, self.image_size)
        index = obs[:, pixels].round().long()
        if bool(((index < 0) | (index >= len(self.instructions))).any()):
            raise OmniRLError(f"pi0 observations: an instruction index outside 0..{len(self.instructions) - 1}")
        state = obs[:, pixels + 1 : pixels + 1 + self.state_dim]
        return images, index, state, obs[:, pixels + 1 + self.state_dim :]
