"""Write PNG curves of a run's metrics: python tools/plot_metrics.py RUN_DIR [--out DIR]."""

from __future__ import annotations

import argparse

from omni_rl.plots import plot_metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=None, help="output folder (default: RUN_DIR/plots)")
    args = parser.parse_args()
    for path in plot_metrics(args.run_dir, args.out):
        print(path)


if __name__ == "__main__":
    main()
