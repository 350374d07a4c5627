"""A batched pixel-and-language reaching task in pure torch, for VLA runs and tests on
a CPU (``PixelTargets-v0``).

Each env holds a point and two targets, a red and a blue one, in the square [-1, 1]^2,
and an instruction naming one of them ("go to the red target"). The policy sees a
small RGB image (the targets as coloured discs, the point as a white one), the
instruction and the point's position (its "joint state"); where the targets are is
only in the image and which one counts only in the instruction, so both must matter.
Dynamics, reward and episode ends are ``PointMassEnv``'s with the named target as its
goal. The privileged observation (point, goal, goal - point: ``PointMassEnv``'s) is
for the scripted expert and a privileged critic, never for the actor.

Observations are flat float vectors (``PixelObservation.flat``: image, instruction
index, state, privileged state), so a flow policy's rollout buffers, demonstrations
files and behaviour cloning hold them as they hold state vectors; a pi_0 policy unpacks
them by the env's ``layout`` (``omni_rl.observations.FlatLayout``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni_rl.observations import FlatLayout
from omni_rl.sim.point_mass import PointMassEnv
from omni_rl.sim.point_mass import expert_action as point_mass_expert

COLOURS = ("red", "blue")
INSTRUCTIONS = tuple(f"go to the {colour} target" for colour in COLOURS)
RGB = {"red": (230, 40, 40), "blue": (40, 80, 230), "point": (255, 255, 255), "background": (30, 30, 30)}


@dataclass
class PixelObservation:
    """N envs' observations, unpacked.

    Attributes:
        images: uint8 [N, 3, S, S], one camera.
        instruction: long [N], an index into ``INSTRUCTIONS``.
        state: [N, 2] float32, the point's position.
        privileged: [N, 6] float32, point, goal, goal - point (the expert's input).
    """

    images: torch.Tensor
    instruction: torch.Tensor
    state: torch.Tensor
    privileged: torch.Tensor

    @property
    def instructions(self) -> list[str]:
        return [INSTRUCTIONS[i] for i in self.instruction.tolist()]

    def flat(self) -> torch.Tensor:
        """[N, 3·S·S + 1 + 2 + 6] float32: the image's values (0-255), the instruction's
        index, the state, the privileged state, one vector per env (the layout a
        flow policy's rollout buffers hold; ``unpack`` reverses it)."""
        parts = [self.images.flatten(1).float(), self.instruction[:, None].float(), self.state, self.privileged]
        return torch.cat(parts, dim=1)


def layout(image_size: int = 32) -> FlatLayout:
    """Where each part lies in the task's flat observations at ``image_size``²."""
    return FlatLayout(image_size, INSTRUCTIONS, state_dim=2, privileged_dim=6)


def unpack(obs: torch.Tensor, image_size: int = 32) -> PixelObservation:
    """``PixelObservation.flat``'s vectors [N, 3·S·S + 9] back into their parts."""
    return PixelObservation(*layout(image_size).split(obs))


def render(points: torch.Tensor, targets: torch.Tensor, size: int, radius: float) -> torch.Tensor:
    """uint8 [N, 3, size, size]: the targets [N, 2, 2] (red, blue) as discs of
    ``radius`` (in the square's units) and the points [N, 2] over them, half as large;
    row 0 is y = 1."""
    centres = (torch.arange(size, device=points.device, dtype=torch.float32) + 0.5) / size * 2 - 1
    ys, xs = centres.flip(0)[:, None].expand(size, size), centres[None, :].expand(size, size)
    grid = torch.stack([xs, ys], dim=-1)  # [S, S, 2], (x, y) of each pixel

    def disc(centre: torch.Tensor, r: float) -> torch.Tensor:  # [N, S, S] bool
        return (grid[None] - centre[:, None, None, :]).norm(dim=-1) < r

    image = torch.tensor(RGB["background"], dtype=torch.uint8, device=points.device)
    image = image[None, :, None, None].repeat(points.shape[0], 1, size, size)
    layers = [(targets[:, 0], radius, "red"), (targets[:, 1], radius, "blue"), (points, radius / 2, "point")]
    for centre, r, name in layers:
        colour = torch.tensor(RGB[name], dtype=torch.uint8, device=points.device)[None, :, None, None]
        image = torch.where(disc(centre, r)[:, None], colour, image)
    return image


class PixelTargetsEnv(PointMassEnv):
    """N envs of the two-target task stepped together (``omni_rl.sim.base.VecEnv``, with
    ``PixelObservation`` observations).

    Two controls change what the policy is shown, never the task: ``blank_images`` (every
    image is the empty background: where the targets are is unseen) and
    ``swap_instructions`` (the instruction names the other target: a policy that follows
    it goes to the wrong one)."""

    task = "PixelTargets-v0"

    def __init__(
        self,
        num_envs: int,
        seed: int = 0,
        image_size: int = 32,
        blank_images: bool = False,
        swap_instructions: bool = False,
        **point_mass,
    ):
        self.blank_images, self.swap_instructions = blank_images, swap_instructions
        self.image_size, self.layout = image_size, layout(image_size)
        self.obs_dim = self.layout.size
        super().__init__(num_envs, seed=seed, **point_mass)
        self.targets = torch.zeros(num_envs, 2, 2, device=self.device)
        self.named = torch.zeros(num_envs, dtype=torch.long, device=self.device)

    def _draw(self, envs: list[int]) -> None:
        """A start point and two targets, each pair at least two radii apart, and the
        named target, from each env's own generator."""
        for i in envs:
            generator = self.generators[i]
            while True:
                spots = torch.rand(3, 2, generator=generator) * 1.8 - 0.9
                if torch.pdist(spots).min() > 2 * self.radius:
                    break
            named = int(torch.randint(2, (1,), generator=generator))
            self.point[i], self.targets[i] = spots[0].to(self.device), spots[1:].to(self.device)
            self.named[i], self.goal[i] = named, spots[1 + named].to(self.device)
            self.steps[i] = 0

    def observe(self) -> PixelObservation:
        """The envs' observations, unpacked."""
        radius = 0.0 if self.blank_images else self.radius  # discs of radius 0 draw nothing
        images = render(self.point, self.targets, self.image_size, radius)
        privileged = torch.cat([self.point, self.goal, self.goal - self.point], dim=1)
        shown = 1 - self.named if self.swap_instructions else self.named.clone()
        return PixelObservation(images, shown, self.point.clone(), privileged)

    def _obs(self) -> torch.Tensor:
        return self.observe().flat()


def expert_action(obs: torch.Tensor, image_size: int = 32) -> torch.Tensor:
    """The scripted expert: ``PointMassEnv``'s, on the privileged part ([N, 2])."""
    return point_mass_expert(unpack(obs, image_size).privileged)
