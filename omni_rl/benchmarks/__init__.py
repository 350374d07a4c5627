"""Benchmark presets with published protocols (``omni-rl eval --benchmark``): MVBench,
Video-MME (with and without subtitles), VSI-Bench, Charades-STA and MMAU test-mini,
read from their files as distributed and named as lmms-eval names its tasks."""

from omni_rl.benchmarks import charades_sta, mmau, mvbench, videomme, vsibench  # noqa: F401 - registers the presets
from omni_rl.benchmarks.base import BENCHMARKS, Benchmark, Protocol, Reading, Scored, register_benchmark

__all__ = ["BENCHMARKS", "Benchmark", "Protocol", "Reading", "Scored", "register_benchmark"]
