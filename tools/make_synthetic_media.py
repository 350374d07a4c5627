"""Write a synthetic video-QA dataset with known ground truth.

    python tools/make_synthetic_media.py --out data/shapes --videos 100 [--tones 20 --images 20 --seed 0]
    python tools/make_synthetic_media.py --motion --out data/motion --videos 400 [--decoy-every 5 --seed 0]
    python tools/make_synthetic_media.py --motion --kinds heading counting grounding --out data/routed --videos 300

Shapes: each video shows 1-3 coloured shapes that enter at known times and move in known
directions; four rows ask about it (direction, count, colour, entry time), several of
which one frame answers. Tones and images get one row each. Writes OUT/data.jsonl,
OUT/truth.jsonl and OUT/media/.

``--motion``: the video quickstart's clips (``write_motion_qa``): one two-option
question per clip, cycling through four kinds whose answers are in the frames (which
way a square moves, which of two squares appears first, how many times one flashes, in
which half one shows); ``--decoy-every K`` makes every K-th question state its answer.
``--kinds`` picks the kinds, among them ``quarter`` (in which quarter of the clip a
square shows, four options), ``wrap_direction``, ``adjacent_order`` and
``equal_count``, which one frame does not answer, and those each routed to a reward of
its own:
``heading`` (four-way multiple choice), ``counting`` (a number, 0 to 4) and
``grounding`` (a [start, end] span scored by IoU; the tool prints the mean IoU of the
best answer that ignores the clip). Writes OUT/data.jsonl and OUT/media/.
"""

from __future__ import annotations

import argparse
import sys

from omni_rl.preprocess.motion import KINDS, QUESTIONS, grounding_baseline, write_motion_qa
from omni_rl.preprocess.scenes import write_video_qa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--motion", action="store_true", help="the video quickstart's clips (see above)")
    parser.add_argument("--decoy-every", type=int, default=0, help="with --motion: every K-th question a decoy")
    parser.add_argument(
        "--kinds", nargs="+", choices=list(QUESTIONS), default=list(KINDS), help="with --motion: the kinds, cycled"
    )
    parser.add_argument("--videos", type=int, default=20)
    parser.add_argument("--tones", type=int, default=0)
    parser.add_argument("--images", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--fps", type=int, default=10)
    parser.add_argument("--width", type=int, default=160)
    parser.add_argument("--height", type=int, default=120)
    args = parser.parse_args()
    if args.decoy_every and not args.motion:
        parser.error("--decoy-every: only the --motion clips have decoys")
    if args.kinds != list(KINDS) and not args.motion:
        parser.error("--kinds: only the --motion clips have kinds")
    if args.motion:
        if "grounding" in args.kinds:
            guess, score = grounding_baseline()
            print(f"grounding: the best answer without the clip, {guess}, scores mean IoU {score:.3f}", file=sys.stderr)
        print(write_motion_qa(args.out, args.videos, args.seed, decoy_every=args.decoy_every, kinds=tuple(args.kinds)))
        return
    data = write_video_qa(
        args.out, args.videos, args.seed, args.seconds, args.fps, args.width, args.height, args.tones, args.images
    )
    print(data)


if __name__ == "__main__":
    main()
