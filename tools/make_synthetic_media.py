"""Write a synthetic video-QA dataset with known ground truth.

    python tools/make_synthetic_media.py --out data/shapes --videos 100 [--tones 20 --images 20 --seed 0]

Each video shows 1-3 coloured shapes that enter at known times and move in known
directions; four rows ask about it (direction, count, colour, entry time). Tones and
images get one row each. Writes OUT/data.jsonl, OUT/truth.jsonl and OUT/media/.
"""

from __future__ import annotations

import argparse

from omni_rl.preprocess.scenes import write_video_qa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--videos", type=int, default=20)
    parser.add_argument("--tones", type=int, default=0)
    parser.add_argument("--images", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--fps", type=int, default=10)
    parser.add_argument("--width", type=int, default=160)
    parser.add_argument("--height", type=int, default=120)
    args = parser.parse_args()
    data = write_video_qa(
        args.out, args.videos, args.seed, args.seconds, args.fps, args.width, args.height, args.tones, args.images
    )
    print(data)


if __name__ == "__main__":
    main()
