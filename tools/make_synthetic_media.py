"""Write synthetic H.264 clips with known ground truth: a square moving in each direction.

    python tools/make_synthetic_media.py --out media/ [--seconds 2 --fps 15 --width 160 --height 120]

Prints one JSON line per clip (path and the direction it shows).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from omni_rl.preprocess.synthetic import DIRECTIONS, moving_square, write_video


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--fps", type=int, default=15)
    parser.add_argument("--width", type=int, default=160)
    parser.add_argument("--height", type=int, default=120)
    args = parser.parse_args()
    for direction in DIRECTIONS:
        frames = moving_square(direction, args.seconds, args.fps, args.width, args.height)
        path = write_video(args.out / f"square_{direction}.mp4", frames, args.fps)
        print(json.dumps({"path": str(path), "direction": direction, "frames": len(frames)}))


if __name__ == "__main__":
    main()
